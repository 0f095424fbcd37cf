"""The WebSocket protocol against a real server process, with a real `websockets` client."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest
import websockets

from tests.server_helpers import GREEDY, SYSTEM, hello, recv_until, turn

pytestmark = pytest.mark.model


@pytest.fixture(autouse=True)
def audit_after(live_server):
    yield
    status, body = live_server.get("/v1/admin/cache")
    assert status == 200 and body["audit"]["ok"], body["audit"]






async def test_shared_system_prompt_and_whole_history_are_cached(live_server) -> None:
    async with live_server.connect() as ws:
        await hello(ws, system_prompt=SYSTEM)
        _, first = await turn(ws, "Can I get a refund?")
        _, second = await turn(ws, "What about luggage?")
    async with live_server.connect() as ws:
        await hello(ws, system_prompt=SYSTEM)
        _, other = await turn(ws, "When are you open?")
    bs = 16
    system_tokens = first["usage"]["prompt_tokens"] - 20  # the question and the generation prompt
    assert other["usage"]["cached_tokens"] >= (system_tokens // bs) * bs > 0
    # Turn 2 reuses all of turn 1: its prompt and its answer, except the last sampled token.
    turn1_tokens = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    assert second["usage"]["cached_tokens"] == turn1_tokens - 1
    assert second["usage"]["cached_device_tokens"] == second["usage"]["cached_tokens"]
    assert second["usage"]["recomputed_tokens"] == second["usage"]["prompt_tokens"] - turn1_tokens + 1


async def test_reconnect_with_last_seq_resumes_without_gaps(live_server) -> None:
    question = "Write three sentences about the ocean."
    async with live_server.connect() as ws:
        await hello(ws)
        reference, _ = await turn(ws, question)
    async with live_server.connect() as ws:
        session = await hello(ws)
        await ws.send(json.dumps({"type": "user", "id": "q1", "content": question, "params": GREEDY}))
        seen = []
        while True:
            frame = json.loads(await ws.recv())
            seen.append(frame)
            if sum(f["type"] == "token" for f in seen) >= 3:
                break
    async with live_server.connect() as ws:
        last_seq = seen[-1]["seq"]
        await hello(ws, session_id=session["session_id"], resume_token=session["resume_token"], last_seq=last_seq)
        # Resending the same id starts no second turn.
        await ws.send(json.dumps({"type": "user", "id": "q1", "content": question, "params": GREEDY}))
        rest = await recv_until(ws, "done")
    frames = seen + rest
    seqs = [f["seq"] for f in frames if "seq" in f]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    text = "".join(f["text"] for f in frames if f["type"] == "token")
    assert text == reference
    status, detail = live_server.get(f"/v1/sessions/{session['session_id']}")
    assert status == 200
    assert [m["role"] for m in detail["history"]] == ["user", "assistant"]


async def test_malformed_frames_get_errors_and_the_socket_lives(live_server) -> None:
    async with live_server.connect() as ws:
        async def expect(payload, code: str) -> None:
            await ws.send(payload)
            frame = json.loads(await ws.recv())
            assert frame == {"type": "error", "code": code, "message": frame["message"]}, frame

        await expect("{not json", "bad_request")
        await expect(json.dumps([1, 2]), "bad_request")
        await expect(json.dumps({"type": 7}), "bad_request")
        await expect(json.dumps({"type": "teleport"}), "bad_request")
        await expect(json.dumps({"type": "user", "id": "x", "content": "hi"}), "bad_request")  # before hello
        await expect(b"\x00\x01binary", "bad_request")
        await hello(ws)
        await expect(json.dumps({"type": "user", "content": "hi"}), "bad_request")  # missing id
        await expect(json.dumps({"type": "user", "id": "a", "content": 5}), "bad_request")
        await expect(json.dumps({"type": "user", "id": "b", "content": "hi", "params": {"temperature": -1}}),
                     "bad_request")
        await expect(json.dumps({"type": "user", "id": "c", "content": "hi", "params": {"top_p": "x"}}),
                     "bad_request")
        await expect(json.dumps({"type": "user", "id": "d", "content": "hi", "params": {"bogus": 1}}),
                     "bad_request")
        await expect(json.dumps({"type": "user", "id": "d2", "content": "hi", "params": {"ignore_eos": 1}}),
                     "bad_request")
        await expect(json.dumps({"type": "user", "id": "e", "content": "hi", "params": {"max_tokens": 10**9}}),
                     "too_large")
        await expect(json.dumps({"type": "user", "id": "f", "content": "word " * 5000}), "too_large")
        await expect(json.dumps({"type": "hello", "session_id": "nope", "resume_token": "x"}), "not_found")
        await ws.send(json.dumps({"type": "ping"}))
        assert json.loads(await ws.recv()) == {"type": "pong"}
        # An oversize frame is the one bad frame that closes the socket.
        await ws.send(json.dumps({"type": "user", "id": "g", "content": "x" * 70000}))
        frame = json.loads(await ws.recv())
        assert frame["code"] == "too_large"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1009


async def test_cancel_stops_the_turn(live_server) -> None:
    async with live_server.connect() as ws:
        await hello(ws)
        await ws.send(json.dumps({"type": "user", "id": "long", "content": "Tell me a long story about a dragon.",
                                  "params": {"temperature": 0, "max_tokens": 400}}))
        frames = []
        while sum(f["type"] == "token" for f in frames) < 2:
            frames.append(json.loads(await ws.recv()))
        await ws.send(json.dumps({"type": "cancel"}))
        done = (await recv_until(ws, "done"))[-1]
        assert done["finish_reason"] == "cancelled"
        assert done["usage"]["completion_tokens"] < 400


async def test_second_socket_takes_over(live_server) -> None:
    async with live_server.connect() as first:
        session = await hello(first)
        async with live_server.connect() as second:
            await hello(second, session_id=session["session_id"], resume_token=session["resume_token"])
            frame = json.loads(await first.recv())
            assert frame["code"] == "conflict"
            with pytest.raises(websockets.ConnectionClosed):
                await first.recv()
            text, done = await turn(second, "Say hello.")
            assert done["finish_reason"] in ("stop", "length") and text


async def test_wrong_resume_token_is_unauthorized(live_server) -> None:
    async with live_server.connect() as ws:
        session = await hello(ws)
    async with live_server.connect() as ws:
        await ws.send(json.dumps({"type": "hello", "session_id": session["session_id"], "resume_token": "guess"}))
        frame = json.loads(await ws.recv())
        assert frame["code"] == "unauthorized"
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()


async def test_a_wrong_resume_token_takes_no_lease_and_writes_nothing(live_server) -> None:
    async with live_server.connect() as ws:
        session = await hello(ws)
    database = sqlite3.connect(live_server.data_dir / "chatcore.db")
    try:  # as when the session went cold here: nobody owns it
        with database:
            database.execute("UPDATE sessions SET owner_replica = NULL, lease_expires_at = NULL WHERE id = ?",
                             (session["session_id"],))
        before = database.execute("SELECT * FROM sessions WHERE id = ?", (session["session_id"],)).fetchall()
        async with live_server.connect() as ws:
            await ws.send(json.dumps({"type": "hello", "session_id": session["session_id"], "resume_token": "guess"}))
            assert json.loads(await ws.recv())["code"] == "unauthorized"
            with pytest.raises(websockets.ConnectionClosed):
                await ws.recv()
        assert database.execute("SELECT * FROM sessions WHERE id = ?", (session["session_id"],)).fetchall() == before
    finally:
        database.close()


async def test_metrics_move_after_a_turn(live_server) -> None:
    def scrape() -> dict[str, float]:
        _, text = live_server.get("/metrics")
        values = {}
        for line in text.splitlines():
            if line.startswith("chatcore_") and " " in line:
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    before = scrape()
    async with live_server.connect() as ws:
        await hello(ws, system_prompt=SYSTEM)
        await turn(ws, "Hello!")
    after = scrape()
    key = 'chatcore_prefix_cache_queries_tokens_total{tier="device"}'
    assert after[key] > before[key]
    assert after.get('chatcore_requests_total{finish_reason="stop"}', 0) + after.get(
        'chatcore_requests_total{finish_reason="length"}', 0) > before.get(
        'chatcore_requests_total{finish_reason="stop"}', 0) + before.get(
        'chatcore_requests_total{finish_reason="length"}', 0)
    assert after["chatcore_ttft_seconds_count"] > before.get("chatcore_ttft_seconds_count", 0)
    assert 'chatcore_kv_blocks{state="used"}' in after
    assert 'chatcore_sessions{state="hot"}' in after


async def test_concurrent_sessions_all_complete(live_server) -> None:
    async def one(i: int) -> dict:
        async with live_server.connect() as ws:
            await hello(ws, system_prompt=SYSTEM)
            _, done = await turn(ws, f"Question number {i}: what is {i} plus {i}?",
                                 {"temperature": 0, "max_tokens": 16})
            return done

    results = await asyncio.gather(*(one(i) for i in range(6)))
    assert all(r["finish_reason"] in ("stop", "length") for r in results)

