"""A socket that another socket took over acts on nothing, even when the takeover lands while it
waits inside a frame's handling. Driven step by step on the real app in the test's event loop."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import websockets

from chatcore.cache.audit import audit
from chatcore.config import Settings
from tests.inprocess_server import serve
from tests.server_helpers import hello

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
        report = await server.services.engine.call(lambda core: audit(core.pool))
        assert report.ok, report.format()
