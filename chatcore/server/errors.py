"""API errors: the HTTP status of every `ErrorCode` (chatcore/outcomes.py), for WebSocket frames and
HTTP bodies alike. This module invents no code: each error a client sees carries an `ErrorCode` member."""

from __future__ import annotations

import logging
import re

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from chatcore.outcomes import ErrorCode
from chatcore.sessions.errors import SessionError

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
# The code of an HTTP error that litestar raised itself (a 404 route, a 405 method): statuses not listed
# here are `internal` from 500 up and `bad_request` below.
STATUS_CODE: dict[int, ErrorCode] = {
    401: ErrorCode.UNAUTHORIZED, 403: ErrorCode.UNAUTHORIZED, 404: ErrorCode.NOT_FOUND, 405: ErrorCode.BAD_REQUEST,
    409: ErrorCode.CONFLICT, 413: ErrorCode.TOO_LARGE, 429: ErrorCode.BUSY,
}


class ApiError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.code]

    def frame(self) -> dict[str, str]:
        return {"type": "error", "code": self.code, "message": self.message}


def from_session_error(exc: SessionError) -> ApiError:
    return ApiError(exc.code, str(exc))


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


def _body(code: ErrorCode, message: str, status: int) -> Response[dict[str, dict[str, str]]]:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
    return Response({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def api_error_handler(_: Request, exc: ApiError) -> Response[dict[str, dict[str, str]]]:
    return _body(exc.code, exc.message, exc.status)


def session_error_handler(_: Request, exc: SessionError) -> Response[dict[str, dict[str, str]]]:
    return api_error_handler(_, from_session_error(exc))


def http_error_handler(_: Request, exc: HTTPException) -> Response[dict[str, dict[str, str]]]:
    status = exc.status_code
    if isinstance(exc, ValidationException) or status == 400:
        return _body(ErrorCode.BAD_REQUEST, _validation_message(exc), 400)
    code = STATUS_CODE.get(status, ErrorCode.INTERNAL if status >= 500 else ErrorCode.BAD_REQUEST)
    return _body(code, str(exc.detail), status)


def _validation_message(exc: HTTPException) -> str:
    extra = exc.extra if isinstance(exc.extra, list) else []
    details = "; ".join(f"{e.get('key', '')}: {e.get('message', '')}".strip(": ") for e in extra if isinstance(e, dict))
    return details or str(exc.detail)


def recursion_error_handler(_: Request, exc: RecursionError) -> Response[dict[str, dict[str, str]]]:
    """Input nested deeper than a decoder's (or a renderer's) recursion limit is the client's error, not
    ours: a JSON body, or JSON text inside one (tool call arguments). Logged, without the client's data."""
    if "deserializ" in str(exc):
        return _body(ErrorCode.BAD_REQUEST, "the JSON body is nested too deeply", 400)
    log.warning("a request failed with RecursionError (%s): answered 400", exc)
    return _body(ErrorCode.BAD_REQUEST, "the request holds data nested too deeply", 400)


def internal_error_handler(_: Request, exc: Exception) -> Response[dict[str, dict[str, str]]]:
    log.exception("unhandled error", exc_info=exc)
    return _body(ErrorCode.INTERNAL, "internal error", 500)
