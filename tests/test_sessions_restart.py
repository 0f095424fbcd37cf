"""SIGKILL during a turn, restart: completed turns survive, the interrupted one is marked, the disk tier serves."""

from __future__ import annotations

import json
import signal

import pytest

from tests.server_helpers import recv_until, start_server

pytestmark = pytest.mark.model
GREEDY = {"temperature": 0, "max_tokens": 32}
LONG = {"temperature": 0, "max_tokens": 400}


async def test_sigkill_mid_turn_then_restart(tmp_path) -> None:
    data = tmp_path / "data"
    server = start_server(data, kv_disk_gb="1", hot_window_s="5")
    try:
        async with server.connect() as ws:
            await ws.send(json.dumps({"type": "hello", "session_id": None,
                                      "system_prompt": "You are a patient teacher who explains things slowly."}))
            session = json.loads(await ws.recv())
            answers = []
            for i, question in enumerate(["What is photosynthesis?", "Why are leaves green?"]):
                await ws.send(json.dumps({"type": "user", "id": f"q{i}", "content": question, "params": GREEDY}))
                frames = await recv_until(ws, "done")
                answers.append("".join(f["text"] for f in frames if f["type"] == "token"))
            history_tokens = frames[-1]["usage"]["prompt_tokens"] + frames[-1]["usage"]["completion_tokens"]
            # Wait until the disk tier has written the history's full blocks (it writes in the background).
            kv_dir = data / "kv"
            expected = (history_tokens - 1) // 16
            await _until(lambda: len(list(kv_dir.rglob("*.kvb"))) >= expected)
            await ws.send(json.dumps({"type": "user", "id": "q2", "content": "Tell me a very long story.",
                                      "params": LONG}))
            await recv_until(ws, "token")
            server.stop(signal.SIGKILL)
    finally:
        server.stop(signal.SIGKILL)

    server = start_server(data, kv_disk_gb="1")
    try:
        status, detail = server.get(f"/v1/sessions/{session['session_id']}")
        assert status == 200
        history = detail["history"]
        assert [m["role"] for m in history] == ["user", "assistant"] * 3
        assert [m["content"] for m in history[1:4:2]] == answers
        assert history[5]["finish_reason"] == "interrupted"
        async with server.connect() as ws:
            await ws.send(json.dumps({"type": "hello", "session_id": session["session_id"],
                                      "resume_token": session["resume_token"], "last_seq": None}))
            resumed = json.loads(await ws.recv())
            assert resumed["type"] == "session"
            assert [m["content"] for m in resumed["history"] if m["role"] == "assistant"] == answers
            await ws.send(json.dumps({"type": "user", "id": "q3", "content": "Summarise that.", "params": GREEDY}))
            done = (await recv_until(ws, "done"))[-1]
        usage = done["usage"]
        assert usage["cached_disk_tokens"] >= expected * 16 - 16, usage
        assert usage["cached_device_tokens"] == 0
        status, cache = server.get("/v1/admin/cache")
        assert cache["audit"]["ok"]
    finally:
        server.stop()


async def _until(condition, timeout: float = 60.0) -> None:
    import asyncio

    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.1)  # polling the file system for a background writer, with a deadline
