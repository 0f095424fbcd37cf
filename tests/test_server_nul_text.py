"""NUL (U+0000) in text a client sends, on a server whose database is PostgreSQL, which cannot
store it in a text column ("invalid byte sequence for encoding UTF8: 0x00"): a title, a system
prompt, a message, a client id or a session id holding one was a 500 with a traceback in the log,
or a turn the store never recorded. Every request and frame holding one is now refused with
`bad_request` naming where it was, whatever the database, before anything is stored; the same
texts without the NUL still work."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.pg_helpers import fresh_database_url, postgres_available
from tests.reliability_helpers import log_problems
from tests.server_helpers import LiveServer, hello, recv_until, start_server, turn

pytestmark = [pytest.mark.model, pytest.mark.skipif(not postgres_available(), reason="needs PostgreSQL")]
NUL = "\u0000"
SHORT = {"temperature": 0, "max_tokens": 4}
BYTE_ZERO_TOKEN = 190  # SmolLM2's byte-level token for byte 0 ("Ā"), which decodes to NUL


@pytest.fixture(scope="module")
def pg_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
              default_model_dir: Path) -> Iterator[LiveServer]:
    server = start_server(tmp_path_factory.mktemp("nul"), database_url=fresh_database_url(request.config, "nul"),
                          max_tokens_limit=8)
    yield server
    server.stop()


def _refused(server: LiveServer, method: str, path: str, body: Any = None,
             headers: dict[str, str] | None = None) -> str:
    status, answer = server.request(method, path, body, headers=headers)
    assert status == 400 and answer["error"]["code"] == "bad_request", (method, path, status, answer)
    assert "NUL" in answer["error"]["message"], answer
    return answer["error"]["message"]


def test_http_text_with_a_nul_is_a_400_on_postgresql(pg_server: LiveServer) -> None:
    assert "title" in _refused(pg_server, "POST", "/v1/sessions", {"title": f"a{NUL}b"})
    assert "system_prompt" in _refused(pg_server, "POST", "/v1/sessions", {"system_prompt": f"Be brief.{NUL}"})
    status, made = pg_server.request("POST", "/v1/sessions", {"title": "plain", "system_prompt": "Be brief."})
    assert status == 201, made
    sid = made["id"]
    assert "title" in _refused(pg_server, "PATCH", f"/v1/sessions/{sid}", {"title": f"{NUL}"})
    exchange = [{"role": "user", "content": f"hi{NUL}"}, {"role": "assistant", "content": "hello"}]
    assert "messages[0].content" in _refused(pg_server, "POST", "/v1/sessions/import", {"messages": exchange})
    chat = {"messages": [{"role": "user", "content": f"Say hi{NUL}"}], **SHORT}
    assert "messages[0].content" in _refused(pg_server, "POST", "/v1/chat/completions", chat,
                                             headers={"X-Session-Id": sid})
    for method, path in (("GET", f"/v1/sessions/{sid}%00"), ("DELETE", f"/v1/sessions/%00{sid}"),
                         ("GET", "/v1/sessions?session_id=%00")):
        assert "path and query" in _refused(pg_server, method, path)
    status, detail = pg_server.get(f"/v1/sessions/{sid}")
    assert status == 200 and detail["title"] == "plain" and detail["history"] == [], detail
    status, answer = pg_server.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "Say hi"}], **SHORT},
                                       headers={"X-Session-Id": sid})
    assert status == 200, answer
    assert not log_problems(pg_server), log_problems(pg_server)


async def test_frames_with_a_nul_get_an_error_frame_on_postgresql(pg_server: LiveServer) -> None:
    async with pg_server.connect() as ws:
        await ws.send(json.dumps({"type": "hello", "title": f"x{NUL}"}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "bad_request" and "NUL" in error["message"], error
        session = await hello(ws, title="plain")
        for frame in ({"type": "user", "id": "q1", "content": f"hi{NUL}", "params": SHORT},
                      {"type": "user", "id": f"q{NUL}", "content": "hi", "params": SHORT}):
            await ws.send(json.dumps(frame))
            error = (await recv_until(ws, "error"))[-1]
            assert error["code"] == "bad_request" and "NUL" in error["message"], error
        text, done = await turn(ws, "Say hi", SHORT)  # the socket is still open and serves
        assert done["finish_reason"] in ("stop", "length") and text
    async with pg_server.connect() as ws:
        await ws.send(json.dumps({"type": "hello", "session_id": f"{session['session_id']}{NUL}",
                                  "resume_token": session["resume_token"]}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "bad_request", error
    status, detail = pg_server.get(f"/v1/sessions/{session['session_id']}")
    assert status == 200 and [m["role"] for m in detail["history"]] == ["user", "assistant"], detail
    assert not log_problems(pg_server), log_problems(pg_server)


def test_a_reply_of_nul_tokens_is_stored_on_postgresql(pg_server: LiveServer) -> None:
    """The model can be pushed to generate byte 0 (`logit_bias` on its byte token): the turn failed
    to save ("the turn failed", 500) and was lost. Now it is answered and stored, each NUL kept as
    U+FFFD, and the session's history reads back and takes the next turn."""
    status, made = pg_server.request("POST", "/v1/sessions", {"title": "nul reply"})
    assert status == 201, made
    forced = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3, "temperature": 0,
              "logit_bias": {str(BYTE_ZERO_TOKEN): 100}}
    status, answer = pg_server.request("POST", "/v1/chat/completions", forced, headers={"X-Session-Id": made["id"]})
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == NUL * 3, answer
    status, detail = pg_server.get(f"/v1/sessions/{made['id']}")
    assert status == 200 and [m["content"] for m in detail["history"]] == ["Say hi", "\ufffd" * 3], detail
    status, answer = pg_server.request("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "Again"}], **SHORT},
                                       headers={"X-Session-Id": made["id"]})
    assert status == 200, answer
    assert not log_problems(pg_server), log_problems(pg_server)
