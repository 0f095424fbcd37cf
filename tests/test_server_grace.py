"""Reconnect grace expiry: a turn whose socket went away and never came back ends `disconnected`, keeps
its partial answer, and releases its blocks. Real server process, real `websockets` client."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server_helpers import hello, recv_until, start_server, until_tokens

pytestmark = pytest.mark.model
GRACE_S = 1.0
MAX_TOKENS = 300
DEADLINE_S = 60
STORY = "Write a long story about a brave knight and a dragon."  # runs past 100 tokens at temperature 0


@pytest.fixture(scope="module")
def grace(tmp_path_factory):
    """A one-second grace period, and no hot window: a finished turn's pin expires at once."""
    server = start_server(tmp_path_factory.mktemp("grace-server"), disconnect_grace_s=GRACE_S, hot_window_s=0)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def idle(tmp_path_factory):
    """Sessions go cold (out of memory) as soon as they are idle and unpinned; the engine runs one
    sequence at a time and a request waits at most half a second for it."""
    server = start_server(tmp_path_factory.mktemp("idle-server"), warm_idle_s=0, hot_window_s=0,
                          max_num_seqs=1, max_queue_wait_s=0.5)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def audit_after(request):
    yield
    for name in ("grace", "idle"):
        if name in request.fixturenames:
            server = request.getfixturevalue(name)
            status, body = server.get("/v1/admin/cache")
            assert status == 200 and body["audit"]["ok"], body["audit"]


async def poll(check, what: str, deadline_s: float = DEADLINE_S):
    """Poll `check()` until it returns something truthy, or fail after the deadline."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        await asyncio.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.parametrize("how", ["close", "abort"])
async def test_dropped_turn_ends_disconnected_and_releases_its_blocks(grace, how: str) -> None:
    async with grace.connect() as ws:
        session = await hello(ws)
        sid = session["session_id"]
        await ws.send(json.dumps({"type": "user", "id": "long", "content": "Count from 1 to 1000, one per line.",
                                  "params": {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}}))
        seen = await until_tokens(ws, 3)
        if how == "abort":
            ws.transport.abort()  # no close frame: the TCP connection just goes away
        dropped_at = time.monotonic()
    partial = "".join(f["text"] for f in seen if f["type"] == "token")

    def finished() -> dict | None:
        status, detail = grace.get(f"/v1/sessions/{sid}")
        assert status == 200
        last = detail["history"][-1]
        return last if last["role"] == "assistant" and last["finish_reason"] is not None else None

    answer = await poll(finished, "the dropped turn to end")
    assert time.monotonic() - dropped_at >= GRACE_S  # it ran on through the grace period
    assert answer["finish_reason"] == "disconnected"
    assert 3 <= answer["usage"]["completion_tokens"] < MAX_TOKENS
    assert answer["content"].startswith(partial) and len(answer["content"]) > len(partial)

    def released() -> dict | None:
        status, cache = grace.get("/v1/admin/cache")
        assert status == 200 and cache["audit"]["ok"], cache["audit"]
        return cache if cache["audit"]["used"] == 0 else None

    cache = await poll(released, "used blocks to go back to 0")
    assert not [b for b in cache["blocks"] if b["state"] == "used"]
    assert sid not in [s["id"] for s in cache["sessions"]]
    assert cache["audit"]["sum_refs"] == cache["audit"]["sum_table_lens"] == 0
    # Coming back later: the rest of the turn is replayed up to its `disconnected` end, without gaps.
    last_seq = max(f["seq"] for f in seen if "seq" in f)
    async with grace.connect() as ws:
        resumed = await hello(ws, session_id=sid, resume_token=session["resume_token"], last_seq=last_seq)
        assert [m["role"] for m in resumed["history"]] == ["user", "assistant"]
        assert resumed["history"][1]["content"] == answer["content"]
        rest = await recv_until(ws, "done")
    assert rest[-1]["finish_reason"] == "disconnected"
    assert [f["seq"] for f in rest] == list(range(last_seq + 1, last_seq + 1 + len(rest)))
    assert partial + "".join(f["text"] for f in rest if f["type"] == "token") == answer["content"]
    assert grace.request("DELETE", f"/v1/sessions/{sid}")[0] == 204


def assistant_turns(server, sid: str) -> list[dict]:
    status, detail = server.get(f"/v1/sessions/{sid}")
    assert status == 200
    return [m for m in detail["history"] if m["role"] == "assistant"]


async def test_an_expired_grace_timer_does_not_cancel_a_later_turn(grace) -> None:
    """The socket drops with one token to go; the turn ends on its own; a new turn (over HTTP, in the
    same session) is still running when the first socket's grace period runs out: it must not be
    cancelled as `disconnected`."""
    async with grace.connect() as ws:
        session = await hello(ws)
        sid = session["session_id"]
        await ws.send(json.dumps({"type": "user", "id": "short", "content": "Say hello.",
                                  "params": {"temperature": 0, "max_tokens": 2}}))
        await until_tokens(ws, 1)
    dropped_at = time.monotonic()
    first = await poll(lambda: [t for t in assistant_turns(grace, sid) if t["finish_reason"]], "the short turn")
    assert first[0]["finish_reason"] in ("stop", "length")
    assert time.monotonic() - dropped_at < GRACE_S, "precondition: the short turn ended within the grace period"
    body = {"messages": [{"role": "user", "content": STORY}], "max_tokens": 60, "temperature": 0}
    resp = await asyncio.to_thread(httpx.post, grace.base_url + "/v1/chat/completions", json=body,
                                   headers={"X-Session-Id": sid}, timeout=120)
    assert resp.status_code == 200, resp.text
    assert time.monotonic() - dropped_at > GRACE_S, "precondition: the second turn outlived the grace period"
    second = assistant_turns(grace, sid)[-1]
    assert second["finish_reason"] in ("stop", "length"), second
    assert resp.json()["usage"]["completion_tokens"] == second["usage"]["completion_tokens"] > 0
    assert grace.request("DELETE", f"/v1/sessions/{sid}")[0] == 204


def read_a_little(server, body: dict, headers: dict | None = None) -> None:
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=headers or {},
                      timeout=120) as resp:
        assert resp.status_code == 200
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 6:
                return  # closing the response drops the connection mid-answer


async def test_a_stateless_stream_closed_early_is_aborted(grace) -> None:
    body = {"messages": [{"role": "user", "content": STORY}], "max_tokens": 1000, "temperature": 0, "stream": True}
    await asyncio.to_thread(read_a_little, grace, body)
    # Finishing 1000 tokens would take far longer than this deadline: the request was aborted.
    cache = await poll(lambda: (c := grace.get("/v1/admin/cache")[1])["audit"]["used"] == 0 and c,
                       "the aborted request's blocks", deadline_s=10)
    assert cache["audit"]["ok"] and cache["audit"]["sum_refs"] == 0, cache["audit"]


async def test_an_http_session_stream_closed_early_is_cancelled_after_grace(grace) -> None:
    status, session = grace.request("POST", "/v1/sessions", {"title": "http stream"})
    assert status == 201
    sid = session["id"]
    body = {"messages": [{"role": "user", "content": STORY}], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}
    await asyncio.to_thread(read_a_little, grace, body, {"X-Session-Id": sid})
    answer = await poll(lambda: [t for t in assistant_turns(grace, sid) if t["finish_reason"]], "the turn to end")
    assert answer[0]["finish_reason"] == "disconnected", answer
    assert answer[0]["usage"]["completion_tokens"] < MAX_TOKENS
    cache = await poll(lambda: (c := grace.get("/v1/admin/cache")[1])["audit"]["used"] == 0 and c,
                       "used blocks to go back to 0")
    assert cache["audit"]["ok"], cache["audit"]
    assert grace.request("DELETE", f"/v1/sessions/{sid}")[0] == 204


async def test_a_socket_whose_session_went_cold_keeps_using_the_one_session(idle) -> None:
    """The socket stays attached while its idle session goes cold. Its next turn must run on the session
    as the server now holds it, so that a request over HTTP sees that turn (busy), not a second copy."""
    async with idle.connect() as ws:
        session = await hello(ws)
        sid = session["session_id"]
        await ws.send(json.dumps({"type": "user", "id": "one", "content": "Say hello.",
                                  "params": {"temperature": 0, "max_tokens": 2}}))
        await recv_until(ws, "done")
        await poll(lambda: [s for s in idle.get("/v1/sessions")[1] if s["id"] == sid and s["state"] == "cold"],
                   "the session to go cold")
        await ws.send(json.dumps({"type": "user", "id": "two", "content": STORY,
                                  "params": {"temperature": 0, "max_tokens": 200}}))
        await until_tokens(ws, 1)
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        resp = await asyncio.to_thread(httpx.post, idle.base_url + "/v1/chat/completions", json=body,
                                       headers={"X-Session-Id": sid}, timeout=120)
        assert resp.status_code == 429 and resp.json()["error"]["code"] == "busy", resp.text
        await ws.send(json.dumps({"type": "cancel"}))
        done = (await recv_until(ws, "done"))[-1]
        assert done["finish_reason"] == "cancelled"
    history = idle.get(f"/v1/sessions/{sid}")[1]["history"]
    assert [(m["role"], m.get("finish_reason")) for m in history][2:] == [("user", None), ("assistant", "cancelled")]
    assert len(history) == 4
    assert idle.request("DELETE", f"/v1/sessions/{sid}")[0] == 204


async def test_no_engine_capacity_is_busy_on_every_path(idle) -> None:
    """While one turn holds the engine's only sequence slot, other requests wait `max_queue_wait_s`
    and then fail with `busy`: over the WebSocket, over HTTP with X-Session-Id (429), and stateless."""
    async with idle.connect() as a, idle.connect() as b:
        await hello(a)
        session_b = await hello(b)
        await a.send(json.dumps({"type": "user", "id": "long", "content": STORY,
                                 "params": {"temperature": 0, "max_tokens": 200}}))
        await until_tokens(a, 1)
        await b.send(json.dumps({"type": "user", "id": "b", "content": "Hi",
                                 "params": {"temperature": 0, "max_tokens": 2}}))
        frames = await recv_until(b, "done")
        assert [f["code"] for f in frames if f["type"] == "error"] == ["busy"], frames
        assert frames[-1]["finish_reason"] == "error"
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for headers in ({"X-Session-Id": session_b["session_id"]}, {}):
            resp = await asyncio.to_thread(httpx.post, idle.base_url + "/v1/chat/completions", json=body,
                                           headers=headers, timeout=120)
            assert resp.status_code == 429 and resp.json()["error"]["code"] == "busy", (headers, resp.text)
        await a.send(json.dumps({"type": "cancel"}))
        assert (await recv_until(a, "done"))[-1]["finish_reason"] == "cancelled"  # A ran throughout
        # With the slot free again, B's next turn runs.
        await b.send(json.dumps({"type": "user", "id": "b2", "content": "Hi",
                                 "params": {"temperature": 0, "max_tokens": 2}}))
        assert (await recv_until(b, "done"))[-1]["finish_reason"] in ("stop", "length")
    for s in idle.get("/v1/sessions")[1]:
        assert idle.request("DELETE", f"/v1/sessions/{s['id']}")[0] == 204
