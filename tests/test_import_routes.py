"""POST /v1/sessions/import: a new session holding exported exchanges, which the next turn continues
exactly as if they had been generated in it; bad bodies are refused whole."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from tests.server_helpers import hello, recv_until, start_server, turn, until_tokens

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


# ----- what an import may cost (a server with a small context, so the bounds are cheap to reach) -----------

CONTEXT = 512
MULTIPLE = 32  # imports up to 16,384 tokens and 131,072 characters
QUOTA = 50_000


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("import-limits"), max_context=CONTEXT,
                          import_context_multiple=MULTIPLE, max_stored_chars_per_tenant=QUOTA,
                          max_num_seqs=1, max_waiting_requests=1, max_concurrent_imports=1)
    yield server
    server.stop()


def exchange(user: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def session_ids(server) -> set[str]:
    return {s["id"] for s in server.get("/v1/sessions")[1]}


def test_import_is_capped_relative_to_the_context(limited):
    before = session_ids(limited)
    # Characters first, before anything is tokenized: 8 a token.
    chars = CONTEXT * MULTIPLE * 8
    status, answer = limited.request("POST", "/v1/sessions/import",
                                     {"messages": exchange("x" * (chars // 2), "y" * (chars // 2 + 1))})
    assert status == 413 and answer["error"]["code"] == "too_large", answer
    assert f"the limit is {chars}" in answer["error"]["message"]
    # Within the characters, over the tokens: "a " is about a token a word.
    status, answer = limited.request("POST", "/v1/sessions/import",
                                     {"messages": exchange("a " * 10_000, "b " * 10_000)})
    assert status == 413 and answer["error"]["code"] == "too_large", answer
    assert f"the limit is {CONTEXT * MULTIPLE}" in answer["error"]["message"]
    assert session_ids(limited) == before  # the refused session was deleted
    # Under both: accepted.
    status, body = limited.request("POST", "/v1/sessions/import", {"messages": exchange("a " * 1000, "b " * 1000)})
    assert status == 201 and body["history_tokens"] <= CONTEXT * MULTIPLE, body
    assert limited.request("DELETE", f"/v1/sessions/{body['id']}")[0] == 204


def test_import_respects_the_tenant_store_quota(limited):
    text = "hello world " * 1250  # 15,000 characters a message, 30,000 an import
    status, first = limited.request("POST", "/v1/sessions/import", {"messages": exchange(text, text)})
    assert status == 201, first
    status, answer = limited.request("POST", "/v1/sessions/import", {"messages": exchange(text, text)})
    assert status == 413 and answer["error"]["code"] == "too_large", answer
    assert "max_stored_chars_per_tenant" in answer["error"]["message"] and str(QUOTA) in answer["error"]["message"]
    assert limited.request("DELETE", f"/v1/sessions/{first['id']}")[0] == 204
    status, second = limited.request("POST", "/v1/sessions/import", {"messages": exchange(text, text)})
    assert status == 201, second  # deleting frees the quota
    assert limited.request("DELETE", f"/v1/sessions/{second['id']}")[0] == 204


async def test_imports_count_against_the_tenant_turns_and_the_server_import_slots(limited):
    # Two turns take the tenant's two slots (open mode: the engine's capacity, one, plus its queue, one):
    # an import is busy, like a third turn. (Each reserves 250 tokens' worst case of the store quota, about
    # 20,000 characters: both fit.)
    sockets = [await websockets.connect(limited.ws_url) for _ in range(2)]
    try:
        for ws in sockets:
            await hello(ws)
            await ws.send(json.dumps({"type": "user", "id": "long", "content": "Count to a thousand.",
                                      "params": {"max_tokens": 250, "ignore_eos": True, "temperature": 0}}))
        await until_tokens(sockets[0], 1)
        await recv_until(sockets[1], "start")  # queued behind the first, holding its slot
        status, answer = limited.request("POST", "/v1/sessions/import", {"messages": exchange("a", "b")})
        assert status == 429 and answer["error"]["code"] == "busy", answer
        assert "max_num_seqs=1 + max_waiting_requests=1" in answer["error"]["message"]
    finally:
        for ws in sockets:
            await ws.send(json.dumps({"type": "cancel"}))
            await recv_until(ws, "done")
            await ws.close()

    # One import at a time server-wide: a second one while the first fills its 1,600 rows is busy.
    many = [m for i in range(800) for m in exchange(f"q{i}", f"a{i}")]
    before = session_ids(limited)
    slow = asyncio.create_task(asyncio.to_thread(limited.request, "POST", "/v1/sessions/import",
                                                 {"title": "slow", "messages": many}))
    async with asyncio.timeout(60):
        while not session_ids(limited) - before:  # created before its turns are written
            await asyncio.sleep(0.02)  # polling for the first import to be in flight
    status, answer = limited.request("POST", "/v1/sessions/import", {"messages": exchange("a", "b")})
    assert status == 429 and answer["error"]["code"] == "busy", answer
    assert "max_concurrent_imports" in answer["error"]["message"]
    status, body = await slow
    assert status == 201 and body["turns"] == 800, body
    status, after = limited.request("POST", "/v1/sessions/import", {"messages": exchange("a", "b")})
    assert status == 201, after  # the slot is free again
    for sid in (body["id"], after["id"]):
        assert limited.request("DELETE", f"/v1/sessions/{sid}")[0] == 204
