"""One outcome vocabulary: every error code a client sees is an `ErrorCode` member (chatcore/outcomes.py),
and chatcore/server/errors.py maps each one, and nothing else, to an HTTP status. Every error body or frame
the server sends is built there, by `ApiError` (which `to_api_error` makes of any exception).

The source scan is on the AST, without importing the modules: a string literal equal to an error code's
value where a code goes (the first argument or `code=` of `ApiError`, an `error`/`emit_error` call or an
error body, a key or value of a dict, a comparison with a `.code`, a class's `code = ...`) is a code
invented outside outcomes.py. Finish reasons share some values ("busy", "conflict") and are not flagged.
"""

from __future__ import annotations

import ast

from chatcore.engine.errors import PrefixOnDisk, QueueFull, RequestRejected
from chatcore.engine.grammar import GrammarBusy, GrammarError
from chatcore.outcomes import ErrorCode
from chatcore.server.errors import (
    CLOSE_CONFLICT,
    CLOSE_POLICY,
    HTTP_STATUS,
    STATUS_CODE,
    ApiError,
    forbidden,
    to_api_error,
    ws_close,
    ws_refusal_close,
)
from chatcore.sessions import errors as session_errors
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


def test_every_error_body_in_the_server_is_built_by_api_error() -> None:
    offenders = []
    for path in sorted((ROOT / "server").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        if path.name != "errors.py":
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
