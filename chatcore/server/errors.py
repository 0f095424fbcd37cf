"""The one route from an outcome to the wire: `to_api_error` turns whatever a request or a frame failed with
into an `ApiError` (an `ErrorCode` of chatcore/outcomes.py and a message), and every error body and frame
the server sends is that `ApiError`'s `body()` or `frame()`, encoded here for what is not a route's answer
(an SSE stream's last event, a response written on the transport). The tables that go with it live here
too: the HTTP status of every code, the code of an HTTP status, and every close (code and reason) of a
WebSocket the server ends, after an error frame or not. This module invents no code: exceptions that
reach a client carry their `ErrorCode` as a class attribute `code` (chatcore/sessions/errors.py,
chatcore/engine/errors.py, chatcore/engine/grammar.py); any other exception is a bug, answered
`internal`. The sessions layer tells of a turn that failed with a typed outcome (a `TurnError`,
chatcore/sessions/frames.py), which becomes an `ApiError` here too.

Two answers keep a shape of their own, and are built here all the same: `/readyz`'s 503, which names its
failing checks (`not_ready`), and the plain-text 503 of a WebSocket upgrade past `max_connections`
(`upgrade_refusal`), the answer uvicorn itself gives an HTTP request past it."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import msgspec
from litestar import MediaType, Request, Response
from litestar.exceptions import HTTPException, ValidationException
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from chatcore.outcomes import ErrorCode
from chatcore.sessions.frames import Followed, Frame, TurnError

log = logging.getLogger(__name__)

HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNSUPPORTED_PARAMETER: 400,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 409,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.BUSY: 429,
    ErrorCode.INTERNAL: 500,
}
# The code of an error sent with another status than its code's own: one litestar raised itself (a 404
# route, a 405 method), a browser's origin or host refused (403: no key cures it, yet it is a refusal of
# the caller, `unauthorized`), a body that never arrived (408). Statuses not listed here are `internal`
# from 500 up and `bad_request` below.
STATUS_CODE: dict[int, ErrorCode] = {
    401: ErrorCode.UNAUTHORIZED, 403: ErrorCode.UNAUTHORIZED, 404: ErrorCode.NOT_FOUND, 405: ErrorCode.BAD_REQUEST,
    408: ErrorCode.BAD_REQUEST, 409: ErrorCode.CONFLICT, 413: ErrorCode.TOO_LARGE, 429: ErrorCode.BUSY,
}

FORBIDDEN = 403  # the status of a refusal no key cures (`forbidden`)

CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_CONFLICT = 4409
CLOSE_IDLE = 4408  # no frame and no turn for socket_idle_timeout_s (as HTTP's 408)


class WsClose(NamedTuple):
    code: int
    reason: str


# How a WebSocket closes after the error frame of a code (docs/protocol.md, "Error codes"); a code not
# listed leaves it open. Before the socket has authenticated, every refusal closes it (`ws_refusal_close`).
WS_CLOSE: dict[ErrorCode, WsClose] = {
    ErrorCode.UNAUTHORIZED: WsClose(CLOSE_POLICY, "unauthorized"),
    ErrorCode.CONFLICT: WsClose(CLOSE_CONFLICT, "session served elsewhere"),  # another replica serves the session
}
# The closes no error code calls for, named for why the server closes the socket.
CLOSE_UPGRADE_REFUSED = WsClose(CLOSE_POLICY, "origin or host not allowed")  # before accept: the upgrade gets 403
CLOSE_UNREAD = WsClose(CLOSE_POLICY, "too many unread frames")  # a client that does not read
CLOSE_REVOKED = WsClose(CLOSE_POLICY, "key revoked")  # after its `unauthorized` frame
CLOSE_TAKEN_OVER = WsClose(CLOSE_CONFLICT, "session taken over")  # after its `conflict` frame
CLOSE_FRAME_TOO_BIG = WsClose(CLOSE_TOO_BIG, "frame too large")  # after its `too_large` frame


def idle_close(idle_s: float) -> WsClose:
    """The close of a socket that sent no frame and ran no turn for `idle_s` (`socket_idle_timeout_s`)."""
    return WsClose(CLOSE_IDLE, f"idle for {idle_s:g} s: no frame and no turn (socket_idle_timeout_s)")


def code_for_status(status: int) -> ErrorCode:
    return STATUS_CODE.get(status, ErrorCode.INTERNAL if status >= 500 else ErrorCode.BAD_REQUEST)


def forbidden(message: str) -> ApiError:
    """A caller refused whatever key it sends (a browser's page on an origin, or a Host in open mode, the
    server does not serve): `unauthorized`, as every refusal of the caller is, sent as 403 and not its
    code's own 401, which asks for a key (docs/protocol.md); `STATUS_CODE` maps 403 back to it."""
    return ApiError(ErrorCode.UNAUTHORIZED, message, FORBIDDEN)


def ws_close(code: ErrorCode) -> WsClose | None:
    """The close (code, reason) that follows an error frame of `code` on an authenticated socket, or None
    when the socket stays open."""
    return WS_CLOSE.get(code)


def ws_refusal_close(code: ErrorCode) -> WsClose:
    """The close that follows the error frame of a socket refused before it authenticated (`unauthorized`,
    or `busy` past the per-address bound): always a policy close, its reason the code's name."""
    return WsClose(CLOSE_POLICY, str(code))


class ApiError(Exception):
    """An error as a client sees it. `status`: the HTTP status, the code's own unless given; a status given
    must be one whose code (`STATUS_CODE`) is this one, so that a status and its code never disagree."""

    def __init__(self, code: ErrorCode, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None and status != HTTP_STATUS[code] and code_for_status(status) != code:
            raise ValueError(f"status {status} does not carry the code {code}")
        self.code = code
        self.message = message
        self.status = HTTP_STATUS[code] if status is None else status

    def body(self) -> dict[str, dict[str, str]]:
        """The HTTP error body (a response's, or an SSE event's)."""
        return {"error": {"code": self.code, "message": self.message}}

    def frame(self) -> dict[str, str]:
        """The WebSocket error frame."""
        return {"type": "error", "code": self.code, "message": self.message}


def to_api_error(exc: BaseException) -> ApiError:
    """What a client is told of `exc`: an `ApiError` as it is; an exception carrying its `ErrorCode` (`code`)
    with its message; a body or frame that does not match its Struct, an HTTP error litestar raised, input
    nested too deeply, each as `bad_request` (or the HTTP error's code); anything else, logged, `internal`."""
    if isinstance(exc, ApiError):
        return exc
    code = getattr(type(exc), "code", None)
    if isinstance(code, ErrorCode):
        return ApiError(code, str(exc))
    if isinstance(exc, msgspec.ValidationError):
        return from_validation_error(exc)
    if isinstance(exc, HTTPException):
        return _from_http(exc)
    if isinstance(exc, RecursionError):
        return _from_recursion(exc)
    log.error("unhandled error", exc_info=exc)
    return ApiError(ErrorCode.INTERNAL, "internal error")


KINDS = {"bool": "a boolean", "int": "an integer", "float": "a number", "str": "a string", "array": "a list",
         "object": "an object", "null": "null"}
EXPECTED = re.compile(r"Expected `(?P<types>[^`]+)`(?:, got `[^`]+`)?(?P<bound>.*)")


def from_validation_error(exc: msgspec.ValidationError) -> ApiError:
    """A body or frame that does not match its Struct: `bad_request` naming the field ("top_p must be a number
    <= 1.0", "params: Object contains unknown field `x`")."""
    what, _, where = str(exc).partition(" - at `$")
    where = where.removesuffix("`").removeprefix(".")
    expected = EXPECTED.fullmatch(what)
    if expected is not None and where:
        types = expected["types"].split(" | ")
        kinds = [KINDS.get(t, t) for t in types if t != "null"] + ["null"] * ("null" in types)
        return ApiError(ErrorCode.BAD_REQUEST, f"{where} must be {' or '.join(kinds)}{expected['bound']}")
    return ApiError(ErrorCode.BAD_REQUEST, f"{where}: {what}" if where else what)


RETRY_AFTER_S = 1  # `busy` is a moment's congestion (a full queue, a tenant's turns in flight)


def error_response(error: ApiError) -> Response[dict[str, dict[str, str]]]:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else None
    return Response(error.body(), status_code=error.status, headers=headers, media_type=MediaType.JSON)


def error_handler(_: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, dict[str, str]]]:
    """The app's one exception handler: every error a route raises, answered through `to_api_error`."""
    return error_response(to_api_error(exc))


def sse_error(exc: BaseException) -> str:
    """The last event of a stream (chat or legacy completions) that failed after it began: `exc`'s body."""
    return f"data: {json.dumps(to_api_error(exc).body(), ensure_ascii=False)}\n\n"


def turn_error(failure: TurnError) -> ApiError:
    """What a client is told of a session's turn that failed: the outcome's code and message."""
    return ApiError(failure.code, failure.message)


def turn_frame(followed: Followed) -> Frame:
    """The wire frame of what a turn's subscription yields: a frame as it is, a failure as its error frame."""
    return turn_error(followed).frame() if isinstance(followed, TurnError) else followed


def raw_error_response(error: ApiError, default_headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """`error` as a whole HTTP/1.1 response written on the transport itself, the connection then closed
    (the 408 of a body that never arrived, chatcore/server/connections.py): the JSON body and the
    server's default headers, as the app's answers carry them."""
    body = msgspec.json.encode(error.body())
    return _raw_response(STATUS_LINE[error.status], default_headers, b"application/json", body)


def upgrade_refusal() -> bytes:
    """The 503 of a WebSocket upgrade past `max_connections`: plain text, as uvicorn's own answer to an
    HTTP request past it (which carries no JSON body either)."""
    return _raw_response(STATUS_LINE[503], (), b"text/plain; charset=utf-8",
                         b"Service Unavailable: too many connections")


def _raw_response(status_line: bytes, headers: Iterable[tuple[bytes, bytes]], content_type: bytes,
                  body: bytes) -> bytes:
    head = [status_line]
    for name, value in headers:
        head += [name, b": ", value, b"\r\n"]
    head += [b"content-type: ", content_type, b"\r\ncontent-length: ", str(len(body)).encode(),
             b"\r\nconnection: close\r\n\r\n"]
    return b"".join(head) + body


def not_ready(checks: dict[str, str], causes: dict[str, str]) -> Response[dict[str, Any]]:
    """`/readyz`'s 503 (docs/protocol.md): each check's state, and the cause of each failing one."""
    return Response({"status": "not ready", "checks": checks, "causes": causes}, status_code=503,
                    media_type=MediaType.JSON)


def _from_http(exc: HTTPException) -> ApiError:
    status = exc.status_code
    if isinstance(exc, ValidationException) or status == 400:
        return ApiError(ErrorCode.BAD_REQUEST, _validation_message(exc), 400)
    return ApiError(code_for_status(status), str(exc.detail), status)


def _validation_message(exc: HTTPException) -> str:
    extra = exc.extra if isinstance(exc.extra, list) else []
    details = "; ".join(f"{e.get('key', '')}: {e.get('message', '')}".strip(": ") for e in extra if isinstance(e, dict))
    return details or str(exc.detail)


def _from_recursion(exc: RecursionError) -> ApiError:
    """Input nested deeper than a decoder's (or a renderer's) recursion limit is the client's error, not
    ours: a JSON body, or JSON text inside one (tool call arguments). Logged, without the client's data."""
    if "deserializ" in str(exc):
        return ApiError(ErrorCode.BAD_REQUEST, "the JSON body is nested too deeply")
    log.warning("a request failed with RecursionError (%s): answered 400", exc)
    return ApiError(ErrorCode.BAD_REQUEST, "the request holds data nested too deeply")
