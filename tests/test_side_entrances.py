"""No side entrances to the engine (issue 46, item 2): a stream its consumer leaves aborts through the
`Abort` command, and a lost device reaches callers as an event, handled on their event loop, never as
their code run on the engine thread (fp32, default model)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import aclosing
from typing import Any

import httpx
import pytest
import torch

from chatcore.config import Settings
from chatcore.engine.commands import Abort, Audit, Command
from chatcore.engine.engine import EngineStopped, InferenceEngine
from chatcore.engine.events import DeviceLost
from chatcore.engine.request import SamplingParams
from chatcore.engine.warmup import NotReady, Readiness
from tests.engine_helpers import QUESTIONS
from tests.inprocess_server import serve
from tests.server_helpers import GREEDY

pytestmark = pytest.mark.model

INJECTED = "CUDA error: an illegal memory access was encountered (injected)"


def handled_commands(engine: InferenceEngine) -> list[Command[Any]]:
    """The commands the engine thread handles from now on, in order (each still handled for real)."""
    seen: list[Command[Any]] = []
    handle = engine._handlers.handle

    def recording(command: Command[Any]) -> Any:
        seen.append(command)
        return handle(command)

    engine._handlers.handle = recording  # type: ignore[method-assign]
    return seen


def lose_the_device(engine: InferenceEngine) -> None:
    """Every later forward raises what CUDA raises for an illegal memory access (the device is lost)."""

    def failing(plan: Any) -> Any:
        raise torch.AcceleratorError(INJECTED)

    engine._core.runner.execute = failing  # type: ignore[method-assign]


@pytest.mark.parametrize("how", ["stops iterating", "is cancelled"])
async def test_a_stream_its_consumer_leaves_is_aborted_by_the_abort_command(make_core, how: str) -> None:
    engine = InferenceEngine(make_core())
    seen = handled_commands(engine)
    engine.start()
    try:
        req = engine.make_request(engine.chat_prompt([{"role": "user", "content": QUESTIONS[1]}]),
                                  SamplingParams(max_tokens=200, ignore_eos=True))
        if how == "stops iterating":
            async with aclosing(engine.generate(req)) as stream:
                async for out in stream:
                    if out.deltas:
                        break
        else:
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate(req):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        report = await engine.send(Audit())  # queued after the abort: it ran first
        assert Abort(req.request_id) in seen, seen
        assert report.ok and report.used == 0, report.format()  # its blocks went back
        assert not engine._core.requests and req.request_id not in engine._streams
    finally:
        engine.shutdown()


async def test_a_lost_device_reaches_the_caller_as_an_event_on_its_own_loop(make_core) -> None:
    engine = InferenceEngine(make_core())
    readiness = Readiness(engine)
    told: list[tuple[str, int]] = []
    lost = asyncio.Event()

    def on_device_lost(cause: str) -> None:
        told.append((cause, threading.get_ident()))
        lost.set()

    engine.start()
    readiness.start(on_device_lost)
    try:
        await readiness.check()  # ready: the engine answers and its last step did not fail
        lose_the_device(engine)
        req = engine.make_request(engine.chat_prompt([{"role": "user", "content": QUESTIONS[0]}]),
                                  SamplingParams(max_tokens=4))
        outs = [out async for out in engine.generate(req)]
        assert outs[-1].finished and INJECTED in (outs[-1].error or "")
        await lost.wait()
        cause = f"AcceleratorError: {INJECTED}"
        assert told == [(cause, threading.get_ident())]  # once, on this loop's thread: not the engine's
        with pytest.raises(NotReady) as not_ready:
            await readiness.check()
        assert str(not_ready.value) == f"the device failed and its state is lost: {cause}"
        # A caller that subscribes after the loss still learns of it; the subscription ends with the thread.
        assert [event async for event in engine.events()] == [DeviceLost(cause)]
        with pytest.raises(EngineStopped):
            await engine.stats()
    finally:
        await readiness.stop()
        engine.shutdown()


async def test_readyz_names_a_lost_device(tmp_path, loaded_fp32) -> None:
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=64, kv_disk_gb=0)
    async with serve(settings, loaded_fp32) as server, httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.port}", timeout=60) as http:
        assert (await http.get("/readyz")).status_code == 200
        engine = server.services.engine
        lose_the_device(engine)
        failed = await http.post("/v1/chat/completions", json={
            **GREEDY, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hello."}]})
        assert failed.status_code == 500, failed.text
        cause = f"AcceleratorError: {INJECTED}"
        assert [event async for event in engine.events()] == [DeviceLost(cause)]  # the engine thread has ended
        gone = await http.get("/readyz")
        assert gone.status_code == 503
        assert gone.json() == {"status": "not ready", "checks": {"engine": "failing", "database": "ok"},
                               "causes": {"engine": f"the device failed and its state is lost: {cause}"}}
        assert (await http.get("/healthz")).status_code == 200
