"""The WebSocket server driven step by step: the real app in the test's event loop, so that a test
can hold it between two awaits or learn the moment it acts, without sleeps."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
import websockets

from chatcore.config import Settings
from tests.inprocess_server import serve
from tests.server_helpers import hello, turn

pytestmark = pytest.mark.model


async def test_a_socket_taken_over_mid_frame_starts_no_turn(tmp_path, loaded_fp32) -> None:
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=128, kv_disk_gb=0)
    async with serve(settings, loaded_fp32) as server, server.connect() as first:
        session = await hello(first)
        manager, turns = server.services.sessions, server.services.turns
        entered, release, started = asyncio.Event(), asyncio.Event(), []
        client_id_used, start = manager.client_id_used, turns.start

        async def gated_client_id_used(*args: Any) -> bool:
            entered.set()
            await release.wait()
            return await client_id_used(*args)

        async def recorded_start(*args: Any, **kwargs: Any) -> Any:
            started.append(args)  # before its first await: recorded before the test runs again
            return await start(*args, **kwargs)

        manager.client_id_used, turns.start = gated_client_id_used, recorded_start
        await first.send(json.dumps({"type": "user", "id": "m1", "content": "Say hello.",
                                     "params": {"temperature": 0, "max_tokens": 4}}))
        await entered.wait()  # the first socket's frame waits inside its handling
        async with server.connect() as second:
            await hello(second, session_id=session["session_id"], resume_token=session["resume_token"])
            assert json.loads(await first.recv())["code"] == "conflict"
            manager.client_id_used = client_id_used
            release.set()
            with pytest.raises(websockets.ConnectionClosed):
                await first.recv()
        assert started == []
        state = manager.live[session["session_id"]]
        assert state.current is None and not state.turn_running


async def test_a_client_that_never_reads_is_closed_before_its_frames_pile_up(tmp_path, loaded_fp32) -> None:
    """Each resume answers with the whole history (~15 KB here). A client that resumes 1,000 times
    and reads nothing would have the server hold 15 MB for it: past the kernel's socket buffers
    and a bound of its own, the server drops what it queued and closes with 1008. (`hello` is rate-limited
    per socket too, which would answer most of them with a small `busy`: lifted here, to reach the bound.)"""
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=256, kv_disk_gb=0,
                        max_history_reads_per_minute=100_000)
    async with serve(settings, loaded_fp32) as server:
        async with server.connect() as ws:
            session = await hello(ws)
            _, done = await turn(ws, "Repeat: " + " word" * 3000, {"temperature": 0, "max_tokens": 1})
            assert done["finish_reason"] == "length"
        resume = json.dumps({"type": "hello", "session_id": session["session_id"],
                             "resume_token": session["resume_token"]})
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.connect(("127.0.0.1", server.port))
        async with server.connect(sock=raw, max_queue=1, compression=None) as ws:  # deflate would shrink them
            await ws.send(resume)
            assert len(await ws.recv()) > 15_000
            conn = server.services.ws_attached[session["session_id"]]
            closing, close = asyncio.Event(), conn.close

            def observed_close(code: int, reason: str = "") -> None:
                closing.set()
                close(code, reason)

            conn.close = observed_close
            for _ in range(1000):
                await ws.send(resume)
            await asyncio.wait_for(closing.wait(), 120)  # the server gave up on this client
            received = 0
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    assert json.loads(await ws.recv())["type"] == "session"
                    received += 1
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008, closed.value
        assert 0 < received < 1000


async def test_a_socket_taken_over_while_its_turn_waits_for_the_session_starts_no_turn(tmp_path, loaded_fp32) -> None:
    """The first socket passes its checks and waits for the session's lock inside `start`, held by
    the second socket's `hello`, which attaches as soon as it lets go: the first must start nothing."""
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=128, kv_disk_gb=0)
    async with serve(settings, loaded_fp32) as server, server.connect() as first:
        session = await hello(first)
        manager, turns = server.services.sessions, server.services.turns
        client_id_used, hold, start = manager.client_id_used, manager.hold, turns.start
        first_checked, first_go, second_holds, second_go = (asyncio.Event() for _ in range(4))
        in_start, start_ended, begun = asyncio.Event(), asyncio.Event(), []

        async def gated_client_id_used(*args: Any) -> bool:
            first_checked.set()
            await first_go.wait()
            return await client_id_used(*args)

        async def gated_hold(*args: Any) -> None:
            second_holds.set()  # the second socket's `open`, with the session's lock held
            await second_go.wait()
            await hold(*args)

        async def observed_start(*args: Any, **kwargs: Any) -> Any:
            in_start.set()  # then, before the test runs again, it queues on the session's lock
            try:
                return await start(*args, **kwargs)
            finally:
                start_ended.set()

        async def recorded_begin(*args: Any) -> Any:
            begun.append(args)
            return await begin(*args)

        begin = turns._begin
        manager.client_id_used, turns.start, turns._begin = gated_client_id_used, observed_start, recorded_begin
        await first.send(json.dumps({"type": "user", "id": "m1", "content": "Say hello.",
                                     "params": {"temperature": 0, "max_tokens": 4}}))
        await first_checked.wait()
        manager.hold = gated_hold
        async with server.connect() as second:
            await second.send(json.dumps({"type": "hello", "session_id": session["session_id"],
                                          "resume_token": session["resume_token"]}))
            await second_holds.wait()
            manager.hold = hold
            first_go.set()
            await in_start.wait()
            second_go.set()
            assert json.loads(await second.recv())["type"] == "session"
            assert json.loads(await first.recv())["code"] == "conflict"
            await start_ended.wait()
            assert begun == []
            state = manager.live[session["session_id"]]
            assert state.current is None and not state.turn_running
            assert manager.slots.held(state.tenant_id) == 0
