"""POST /v1/sessions/import: a new session holding exported exchanges, which the next turn continues
exactly as if they had been generated in it; bad bodies are refused whole."""

from __future__ import annotations

import pytest
import websockets

from tests.server_helpers import hello, turn

pytestmark = pytest.mark.model
GREEDY = {"temperature": 0, "max_tokens": 8}


async def test_an_imported_history_is_continued_like_a_generated_one(live_server):
    # A history generated here, then the same exchange imported into a new session.
    async with websockets.connect(live_server.ws_url) as ws:
        first = await hello(ws, system_prompt="You are terse.")
        answer, done = await turn(ws, "Name a colour.", GREEDY)
        assert done["finish_reason"] in ("stop", "length")
        _, generated_next = await turn(ws, "Another one?", GREEDY)

    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": answer}]
    status, body = live_server.request("POST", "/v1/sessions/import",
                                       {"title": "Imported", "system_prompt": "You are terse.", "messages": messages})
    assert status == 201, body
    assert body["turns"] == 1 and body["title"] == "Imported" and body["history_tokens"] > 0
    status, detail = live_server.get(f"/v1/sessions/{body['id']}")
    assert status == 200
    assert [(m["role"], m["content"]) for m in detail["history"]] == [(m["role"], m["content"]) for m in messages]
    assert detail["history"][1]["finish_reason"] == "stop"
    assert detail["system_prompt"] == "You are terse."
    assert detail["cache"]["history_tokens"] == body["history_tokens"]
    sessions = {s["id"]: s for s in live_server.get("/v1/sessions")[1]}
    assert sessions[body["id"]]["turns"] == 1

    # The imported session resumes with its token and shows the history; its next turn reads the
    # same prompt as the generated session's did (the canonical tokens are the template's).
    async with websockets.connect(live_server.ws_url) as ws:
        frame = await hello(ws, session_id=body["id"], resume_token=body["resume_token"])
        assert frame["history"] == messages
        _, imported_next = await turn(ws, "Another one?", GREEDY)
    assert imported_next["usage"]["prompt_tokens"] == generated_next["usage"]["prompt_tokens"]
    status, detail = live_server.get(f"/v1/sessions/{body['id']}")
    assert [m["role"] for m in detail["history"]] == ["user", "assistant", "user", "assistant"]
    for sid in (first["session_id"], body["id"]):
        assert live_server.request("DELETE", f"/v1/sessions/{sid}")[0] == 204
    status, cache = live_server.get("/v1/admin/cache")
    assert status == 200 and cache["audit"]["ok"], cache["audit"]


@pytest.mark.parametrize("body", [
    {},
    {"messages": []},
    {"messages": [{"role": "user", "content": "only a question"}]},
    {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
    {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}]},
    {"messages": [{"role": "user", "content": "a", "extra": 1}, {"role": "assistant", "content": "b"}]},
    {"messages": [{"role": "system", "content": "a"}, {"role": "assistant", "content": "b"}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "model": "x"},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "title": 5},
])
def test_a_bad_import_is_refused_and_creates_nothing(live_server, body):
    before = {s["id"] for s in live_server.get("/v1/sessions")[1]}
    status, answer = live_server.request("POST", "/v1/sessions/import", body)
    assert status == 400 and answer["error"]["code"] == "bad_request", answer
    assert {s["id"] for s in live_server.get("/v1/sessions")[1]} == before


def test_import_refuses_an_oversized_history(live_server):
    big = "x" * 1_000_001
    body = {"messages": [{"role": "user", "content": big}, {"role": "assistant", "content": big}]}
    status, answer = live_server.request("POST", "/v1/sessions/import", body)
    assert status == 413 and answer["error"]["code"] == "too_large", answer
