"""One outcome vocabulary: every error code a client sees is an `ErrorCode` member (chatcore/outcomes.py),
and chatcore/server/errors.py maps each one, and nothing else, to an HTTP status. Every error body or frame
the server sends is built there, by `ApiError` (which `to_api_error` makes of any exception).

The source scans are on the AST, without importing the modules: a string literal equal to an error code's
value where a code goes (the first argument or `code=` of `ApiError`, an `error`/`emit_error` call or an
error body, a key or value of a dict, a comparison with a `.code`, a class's `code = ...`) is a code
invented outside outcomes.py. Finish reasons share some values ("busy", "conflict") and are not flagged.
Every module that serves (the server, the sessions layer, the engine and the rest, all but the `chat`
client and the benchmarks' reports) is scanned for error bodies and frames built, error statuses
answered, error bodies encoded and codes parsed back anywhere but chatcore/server/errors.py: the
sessions layer tells of a failed turn with a typed `TurnError`, and the server makes the wire of it.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
from pathlib import Path

import httptools

from chatcore.engine.errors import PrefixOnDisk, QueueFull, RequestRejected
from chatcore.engine.grammar import GrammarBusy, GrammarError
from chatcore.outcomes import ErrorCode
from chatcore.server.errors import (
    CLOSE_CONFLICT,
    CLOSE_FRAME_TOO_BIG,
    CLOSE_POLICY,
    CLOSE_REVOKED,
    CLOSE_TAKEN_OVER,
    CLOSE_UNREAD,
    CLOSE_UPGRADE_REFUSED,
    HTTP_STATUS,
    STATUS_CODE,
    ApiError,
    forbidden,
    idle_close,
    raw_error_response,
    to_api_error,
    turn_frame,
    upgrade_refusal,
    ws_close,
    ws_refusal_close,
)
from chatcore.sessions import errors as session_errors
from chatcore.sessions.frames import TurnError, TurnFrames
from tests.shipped_sources import ROOT, shipped_files

CODES = {code.value for code in ErrorCode}
CODE_CALLS = {"ApiError", "error", "emit_error", "fail"}  # callables whose first argument is a code


def test_every_error_code_has_an_http_status_and_nothing_else_does() -> None:
    assert set(HTTP_STATUS) == set(ErrorCode)
    assert all(type(key) is ErrorCode for key in HTTP_STATUS)
    assert all(400 <= status < 600 for status in HTTP_STATUS.values())
    assert all(type(code) is ErrorCode for code in STATUS_CODE.values())


def test_wire_values_are_the_documented_names() -> None:
    assert sorted(CODES) == sorted(["bad_request", "unsupported_parameter", "unauthorized", "not_found", "busy",
                                    "too_large", "conflict", "internal"])
    error = ApiError(ErrorCode.NOT_FOUND, "no such session")
    assert error.status == 404
    assert error.frame() == {"type": "error", "code": "not_found", "message": "no such session"}


def test_session_errors_carry_their_member() -> None:
    classes = [session_errors.SessionError, session_errors.NotFound, session_errors.Busy, session_errors.TooLarge,
               session_errors.Unauthorized, session_errors.Conflict]
    assert all(type(cls.code) is ErrorCode for cls in classes)
    assert len({cls.code for cls in classes}) == len(classes)


def _callee(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    return node.func.attr if isinstance(node.func, ast.Attribute) else None


def _is_code(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value in CODES


def _names_code(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "code") or (isinstance(node, ast.Name)
                                                                          and node.id == "code")


def _literal_codes(tree: ast.AST) -> list[int]:
    """Lines where a string literal stands for an error code."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _callee(node) in CODE_CALLS:
            found += [arg for arg in node.args[:1] if _is_code(arg)]
            found += [kw.value for kw in node.keywords if kw.arg == "code" and _is_code(kw.value)]
        elif isinstance(node, ast.Dict):  # a "code" entry, or a mapping to or from codes
            found += [k for k in node.keys if _is_code(k)]
            found += [v for k, v in zip(node.keys, node.values, strict=True)
                      if _is_code(v) and not (isinstance(k, ast.Constant) and k.value == "finish_reason")]
        elif isinstance(node, ast.Compare) and _names_code(node.left):
            found += [c for c in node.comparators if _is_code(c)]
        elif isinstance(node, ast.Assign) and any(_names_code(t) for t in node.targets) and _is_code(node.value):
            found.append(node.value)
    return sorted(n.lineno for n in found)


def test_no_error_code_is_spelled_outside_outcomes() -> None:
    offenders = []
    for path in shipped_files():  # the linked kernels/ and bench/ included
        if path.name == "outcomes.py" and path.parent == ROOT:
            continue
        lines = _literal_codes(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        offenders += [f"{path}:{line}" for line in lines]
    assert offenders == [], "error codes must be ErrorCode members: " + ", ".join(offenders)


def test_the_scan_sees_the_spellings_it_forbids() -> None:
    source = '''
raise ApiError("bad_request", "x")
conn.error(code="busy", message="y")
body = {"error": {"code": "not_found"}}
if exc.code == "unauthorized": pass
class E(Exception):
    code = "conflict"
STATUS = {401: "unauthorized"}.get(status, "internal")
HTTP = {"too_large": 413}
done(finish_reason="busy", frame={"finish_reason": "conflict"})  # finish reasons, not codes
'''
    assert _literal_codes(ast.parse(source)) == [2, 3, 4, 5, 7, 8, 9]


def test_engine_refusals_carry_their_member_and_reach_the_wire_as_it() -> None:
    cases = [(RequestRejected("the prompt is empty"), ErrorCode.TOO_LARGE, 413, "the prompt is empty"),
             (QueueFull("9 requests are already waiting"), ErrorCode.BUSY, 429, "9 requests are already waiting"),
             (GrammarError("no output satisfies it"), ErrorCode.BAD_REQUEST, 400,
              "response_format: no output satisfies it"),
             (GrammarBusy("all 2 grammar compile threads are busy"), ErrorCode.BUSY, 429,
              "all 2 grammar compile threads are busy"),
             (session_errors.Conflict("another replica serves it"), ErrorCode.CONFLICT, 409,
              "another replica serves it")]
    for exc, code, status, message in cases:
        assert type(type(exc).code) is ErrorCode
        error = to_api_error(exc)
        assert (error.code, error.status, error.message) == (code, status, message), exc
    assert not hasattr(PrefixOnDisk, "code")  # the turn's own business: it never reaches a client
    bug = to_api_error(KeyError("secret"))
    assert (bug.code, bug.status, bug.message) == (ErrorCode.INTERNAL, 500, "internal error")


def test_a_status_never_disagrees_with_its_code() -> None:
    refused = forbidden("origin not allowed")  # a browser's origin: no key cures it
    assert (refused.code, refused.status) == (ErrorCode.UNAUTHORIZED, 403) and STATUS_CODE[403] == refused.code
    assert HTTP_STATUS[ErrorCode.UNAUTHORIZED] == 401  # a missing or bad key: the code's own status
    assert ApiError(ErrorCode.BAD_REQUEST, "the body did not arrive", 408).status == 408
    try:
        ApiError(ErrorCode.NOT_FOUND, "x", 403)
    except ValueError as exc:
        assert "403" in str(exc)
    else:
        raise AssertionError("a 403 not_found was built")


def test_the_socket_closes_as_the_table_says() -> None:
    assert ws_close(ErrorCode.UNAUTHORIZED) == (CLOSE_POLICY, "unauthorized") and CLOSE_POLICY == 1008
    assert ws_close(ErrorCode.CONFLICT) == (CLOSE_CONFLICT, "session served elsewhere") and CLOSE_CONFLICT == 4409
    assert all(ws_close(code) is None for code in ErrorCode if code not in (ErrorCode.UNAUTHORIZED,
                                                                            ErrorCode.CONFLICT))
    assert ws_refusal_close(ErrorCode.BUSY) == (1008, "busy")
    assert [CLOSE_UPGRADE_REFUSED.code, CLOSE_UNREAD.code, CLOSE_REVOKED.code] == [1008] * 3
    assert (CLOSE_TAKEN_OVER.code, CLOSE_FRAME_TOO_BIG.code, idle_close(30).code) == (4409, 1009, 4408)
    assert "socket_idle_timeout_s" in idle_close(30).reason and "30 s" in idle_close(30).reason


def _error_bodies(tree: ast.AST) -> list[int]:
    """Lines where a dict literal is an error body (`{"error": ...}`) or an error frame (`{"type": "error"}`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            pairs = [(k.value, v.value if isinstance(v, ast.Constant) else None)
                     for k, v in zip(node.keys, node.values, strict=True) if isinstance(k, ast.Constant)]
            if any(key == "error" or (key, value) == ("type", "error") for key, value in pairs):
                found.append(node.lineno)
    return found


ERRORS = ROOT / "server" / "errors.py"
NOT_SERVING = (ROOT / "chat", ROOT / "bench")  # a client that reads error frames; benchmark reports


def serving_files() -> list[Path]:
    """Every module that serves clients, errors.py included: all of chatcore/ but `NOT_SERVING`."""
    return [p for p in shipped_files() if not any(p.is_relative_to(folder) for folder in NOT_SERVING)]


def test_the_scans_cover_the_sessions_and_the_server() -> None:
    scanned = set(serving_files())
    for folder in ("server", "sessions", "engine"):
        assert set(shipped_files(ROOT / folder)) <= scanned, folder
    assert ERRORS in scanned and not scanned & set(shipped_files(ROOT / "chat"))


def test_every_error_body_and_frame_is_built_by_api_error() -> None:
    offenders = []
    for path in serving_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        if path != ERRORS:
            offenders += [f"{path}:{line}" for line in _error_bodies(tree)]
            continue
        builders = {fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and _error_bodies(fn)}
        assert builders == {"body", "frame"}  # ApiError's, and nothing else in errors.py
    assert offenders == [], "error bodies must be ApiError's body() or frame() (to_api_error): " + ", ".join(offenders)


def test_the_body_scan_sees_the_spellings_it_forbids() -> None:
    source = '''
Response({"error": {"code": ErrorCode.BUSY, "message": "m"}}, status_code=429)
conn.send({"type": "error", "code": code, "message": message})
frames.emit({"type": "token", "text": "error"})  # not an error
'''
    assert _error_bodies(ast.parse(source)) == [2, 3]


STATUS_LINE = re.compile(r"HTTP/1\.[01] [45]\d\d")


def _error_answers(tree: ast.AST) -> list[int]:
    """Lines that answer an error, or read one back, by hand: a `Response` whose `status_code` is not a
    constant below 400, a raw HTTP status line of an error, a WebSocket closed with a code or reason of its own, an error body encoded (`.body()` not awaited,
    which only errors.py's HTTP and SSE encoders call), an `ErrorCode` parsed from wire text, a frame's `type`
    compared with "error"."""
    found: list[ast.AST] = []
    awaited = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Await)}  # a request's body()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            found += _error_call(node, id(node) in awaited)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            text = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
            found += [node] if STATUS_LINE.match(text) else []
        elif isinstance(node, ast.Compare) and _is_type_lookup(node.left):
            found += [c for c in node.comparators if isinstance(c, ast.Constant) and c.value == "error"]
    return sorted(n.lineno for n in found)


def _error_call(node: ast.Call, awaited: bool) -> list[ast.AST]:
    callee = _callee(node)
    if callee == "Response":
        return [kw.value for kw in node.keywords if kw.arg == "status_code"
                and not (isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, int) and kw.value.value < 400)]
    if callee == "body" and not (awaited or node.args or node.keywords):
        return [node]
    if callee == "close":  # a WebSocket's close: its code and reason are errors.py's
        return [arg for arg in [*node.args, *(kw.value for kw in node.keywords)] if _literal_close(arg)]
    return [node] if callee == "ErrorCode" else []


def _literal_close(node: ast.AST) -> bool:
    """A close reason (a string, or an f-string) or a close code (a number) spelled out."""
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str | int))


def _is_type_lookup(node: ast.AST) -> bool:
    """`x["type"]` or `x.get("type")`."""
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "type"
    return (isinstance(node, ast.Call) and _callee(node) == "get" and bool(node.args)
            and isinstance(node.args[0], ast.Constant) and node.args[0].value == "type")


def test_no_error_is_answered_or_read_back_outside_errors_py() -> None:
    offenders = []
    for path in serving_files():
        if path != ERRORS:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            offenders += [f"{path}:{line}" for line in _error_answers(tree)]
    assert offenders == [], "errors are answered by chatcore/server/errors.py alone: " + ", ".join(offenders)


def test_the_answer_scan_sees_the_spellings_it_forbids() -> None:
    source = '''
return Response(body, status_code=503 if failing else 200)
transport.write(b"HTTP/1.1 503 Service Unavailable\\r\\n")
yield f"data: {json.dumps(to_api_error(exc).body())}"
error = ApiError(ErrorCode(frame["code"]), frame["message"])
if frame["type"] == "error": pass
if frame.get("type") == "error": pass
conn.close(CLOSE_IDLE, f"idle for {idle_s:g} s")
await socket.close(code=1008, reason=reason)
return Response(None, status_code=204)  # not an error
conn.close(*CLOSE_REVOKED)  # errors.py's
os.close(fd)  # not a socket's
yield completion.body(choices)  # a completion's body, not an error's
raw = await request.body()  # a request's body
if frame["type"] == "done": pass
'''
    assert _error_answers(ast.parse(source)) == [2, 3, 4, 5, 6, 7, 8, 9]


def test_a_failed_turn_reaches_followers_as_a_typed_outcome_and_the_wire_as_api_errors_frame() -> None:
    async def follow() -> list[object]:
        numbers = iter(range(7, 100))
        frames = TurnFrames(0, None, lambda: next(numbers))
        follower = frames.subscribe(None)
        frames.emit({"type": "start", "truncated_turns": 0})
        frames.emit_error(ErrorCode.BUSY, "no capacity right now, try again")
        frames.emit({"type": "done", "finish_reason": "error"})
        assert [f["type"] for f in frames.frames] == ["start", "done"]  # a failure is not replayed
        return [follower.get_nowait() for _ in range(follower.qsize())]

    start, failed, done = asyncio.run(follow())
    assert failed == TurnError(ErrorCode.BUSY, "no capacity right now, try again")
    assert turn_frame(failed) == ApiError(ErrorCode.BUSY, "no capacity right now, try again").frame()
    assert turn_frame(failed) == {"type": "error", "code": "busy", "message": "no capacity right now, try again"}
    assert turn_frame(start) is start and turn_frame(done) is done  # the frames of a turn go out as they are


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of a whole HTTP/1.1 response, as a client's parser reads them."""
    parsed: dict[str, object] = {"headers": {}, "body": b""}

    class Reader:
        def on_header(self, name: bytes, value: bytes) -> None:
            parsed["headers"][name.decode().lower()] = value.decode()  # type: ignore[index]

        def on_body(self, body: bytes) -> None:
            parsed["body"] += body  # type: ignore[operator]

        def on_message_complete(self) -> None:
            parsed["complete"] = True

    parser = httptools.HttpResponseParser(Reader())
    parser.feed_data(raw)
    assert parsed.get("complete"), raw
    return parser.get_status_code(), parsed["headers"], parsed["body"]  # type: ignore[return-value]


def test_the_answers_written_on_the_transport_are_whole_responses() -> None:
    status, headers, body = _parse(upgrade_refusal())
    assert (status, headers["content-type"], headers["connection"]) == (503, "text/plain; charset=utf-8", "close")
    assert body == b"Service Unavailable: too many connections"
    error = ApiError(ErrorCode.BAD_REQUEST, "the request body did not arrive in full (body_timeout_s) é", 408)
    status, headers, body = _parse(raw_error_response(error, [(b"server", b"uvicorn")]))
    assert (status, headers["content-type"], headers["server"]) == (408, "application/json", "uvicorn")
    assert json.loads(body) == {"error": {"code": "bad_request", "message": error.message}}
