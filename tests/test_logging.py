"""Logs: `CHATCORE_LOG_FORMAT=json` makes every line of `chatcore serve` one JSON object, and each turn's
line carries its tenant, session, request id, tokens, TTFT and finish reason as keys."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from chatcore.logs import configure_logging
from chatcore.turnlog import log_turn


@pytest.fixture
def root_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_a_turns_fields_as_keys(root_restored: None) -> None:
    out = io.StringIO()
    configure_logging("json", out)
    log_turn(tenant_id="t1", session_id="s1", request_id="r1", prompt_tokens=100, cached_device=48, cached_disk=16,
             ttft_ms=12.4, completion_tokens=7, finish_reason="stop")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("uvicorn.error").exception("Exception in ASGI application")
    turn, error = (json.loads(line) for line in out.getvalue().splitlines())
    assert {k: turn[k] for k in ("level", "logger", "tenant", "session", "request_id", "prompt_tokens",
                                 "cached_device", "cached_disk", "recomputed", "ttft_ms", "generated",
                                 "finish_reason")} == {
        "level": "INFO", "logger": "chatcore.turns", "tenant": "t1", "session": "s1", "request_id": "r1",
        "prompt_tokens": 100, "cached_device": 48, "cached_disk": 16, "recomputed": 36, "ttft_ms": 12,
        "generated": 7, "finish_reason": "stop"}
    assert turn["message"].startswith("turn tenant=t1 session=s1 request=r1 prompt=100")
    assert error["level"] == "ERROR" and "RuntimeError: boom" in error["exception"]


def test_text_lines_start_with_the_level(root_restored: None) -> None:
    out = io.StringIO()
    configure_logging("text", out)
    log_turn(tenant_id="t1", session_id=None, request_id="r1", prompt_tokens=10, cached_device=0, cached_disk=0,
             ttft_ms=None, completion_tokens=1, finish_reason="length")
    line = out.getvalue().strip()
    assert line.startswith("INFO ") and line.endswith(
        "chatcore.turns: turn tenant=t1 session=- request=r1 prompt=10 cached_device=0 cached_disk=0 recomputed=10 "
        "ttft_ms=- generated=1 finish=length")


@pytest.mark.model
def test_a_json_server_logs_only_json_lines(tmp_path) -> None:
    from tests.server_helpers import start_server

    server = start_server(tmp_path / "data", log_format="json")
    try:
        status, body = server.request("POST", "/v1/chat/completions",
                                      {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert status == 200, body
    finally:
        server.stop()
    lines = [line for line in server.log().splitlines() if line.strip()]
    assert lines and not [line for line in lines if not _is_json(line)], [line for line in lines if not _is_json(line)]
    records = [json.loads(line) for line in lines]
    loggers = {r["logger"] for r in records}
    assert {"uvicorn.error", "uvicorn.access", "chatcore.turns"} <= loggers, loggers
    turn = next(r for r in records if r["logger"] == "chatcore.turns")
    assert turn["prompt_tokens"] == body["usage"]["prompt_tokens"] and turn["generated"] == 2
    assert turn["session"] is None and turn["finish_reason"] == "length" and turn["request_id"]


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True
