"""The engine's door hands out facts (issue 56, deliverable 3): a frozen `EngineInfo` instead of the loaded
model, the engine's state as snapshots published to the caller's event loop instead of attributes read
across threads, and a queue of typed commands instead of closures (the real default model, fp32)."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import inspect
import queue
import threading
import typing
from contextlib import aclosing
from typing import Any

import pytest
import torch

from chatcore.engine import commands
from chatcore.engine.commands import Abort, AddRequest, Command, Resize, Stats, Unpin
from chatcore.engine.engine import InferenceEngine, Queued
from chatcore.engine.errors import RequestRejected
from chatcore.engine.info import EngineInfo
from chatcore.engine.request import SamplingParams
from chatcore.engine.snapshot import EngineSnapshot
from tests.engine_helpers import LONG_SYSTEM, QUESTIONS, chat_ids, on_engine_thread
from tests.test_import_graph import INSIDE, documented_layers, sources, unit_of

ENGINE_HOLDERS = {"engine"}  # what code outside the engine calls an `InferenceEngine` (`self.engine`, `engine`)


def door_surface() -> set[str]:
    """What an `InferenceEngine` hands out: its public methods and properties, and its declared attributes."""
    names = set(vars(InferenceEngine)) | set(InferenceEngine.__annotations__)
    return {name for name in names if not name.startswith("_")}


def reads_behind_the_door(source: str, module: str, surface: set[str]) -> list[str]:
    """Where `source` reads `.loaded`, or an attribute of an engine that its door does not hand out."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute):
            continue
        holder = node.value
        held = holder.id if isinstance(holder, ast.Name) else holder.attr if isinstance(holder, ast.Attribute) else ""
        if node.attr == "loaded":
            out.append(f"{module}:{node.lineno} reads .loaded")
        elif held in ENGINE_HOLDERS and node.attr not in surface:
            out.append(f"{module}:{node.lineno} reads engine.{node.attr}")
    return out


def test_nothing_outside_the_engine_reads_the_loaded_model_or_its_insides() -> None:
    layers = documented_layers()
    users = [(m, s) for m, s in sources()
             if m != "chatcore" and unit_of(m) not in INSIDE and "engine" in layers.get(unit_of(m), set())]
    assert {"server", "sessions"} <= {unit_of(m) for m, _ in users}
    surface = door_surface()
    assert {"info", "state", "send", "generate", "check_fits"} <= surface
    assert not surface & {"loaded", "failure", "pinned_sessions", "preemptions", "tokenizer", "block_size"}
    assert [v for m, s in users for v in reads_behind_the_door(s, m, surface)] == []


def test_the_read_check_catches_what_it_looks_for() -> None:
    surface = door_surface()
    for source in ["x = services.engine.loaded.model", "n = self.engine.failure", "s = engine.pinned_sessions",
                   "p = engine._core.scheduler", "f = ctx.loaded.fingerprint", "q = self.engine.preemptions"]:
        assert reads_behind_the_door(source, "chatcore.server.x", surface), source
    assert reads_behind_the_door("n = self.engine.info.max_context\ns = engine.state.pinned_sessions",
                                 "chatcore.sessions.x", surface) == []


def test_every_command_field_is_typed() -> None:
    """Each command's fields name their types (none is `Any`), and `AddRequest` carries a `Request`."""
    kinds = [k for k in vars(commands).values()
             if inspect.isclass(k) and issubclass(k, Command) and k is not Command and dataclasses.is_dataclass(k)]
    assert len(kinds) >= 12
    for kind in kinds:
        hints = typing.get_type_hints(kind)
        for f in dataclasses.fields(kind):
            assert hints[f.name] is not Any, f"{kind.__name__}.{f.name} is typed Any"
    assert typing.get_type_hints(AddRequest)["request"].__name__ == "Request"


@pytest.mark.model
def test_engine_info_is_frozen_and_holds_no_model_or_tensor(make_core) -> None:
    core = make_core(block_size=16)
    engine = InferenceEngine(core)  # not started: the facts exist before the thread
    info = engine.info
    assert isinstance(info, EngineInfo)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.block_size = 8  # type: ignore[misc]
    for f in dataclasses.fields(info):
        value = getattr(info, f.name)
        assert not isinstance(value, torch.nn.Module | torch.Tensor), f.name
        assert type(value).__name__ != "LoadedModel", f.name
    assert not hasattr(engine, "loaded")
    loaded = core.loaded
    assert (info.block_size, info.max_context, info.vocab_size) == (16, core.scheduler.max_context, core.vocab_size)
    assert (info.fingerprint, info.tokenizer, info.model_dtype, info.kv_dtype) == (
        loaded.fingerprint, loaded.tokenizer, "float32", "float32")
    assert info.stop_token_ids == loaded.stop_token_ids and info.model_name == loaded.path.name
    assert info.kv_bytes_per_token * 16 * core.pool.num_blocks == core.kv.data.numel() * core.kv.data.element_size()


class RecordingQueue(queue.SimpleQueue):  # type: ignore[type-arg]
    """The engine's queue, keeping each item put on it."""

    def __init__(self) -> None:
        self.items: list[Any] = []

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        self.items.append(item)
        super().put(item, block, timeout)


@pytest.mark.model
async def test_the_queue_holds_typed_commands_only(make_core) -> None:
    engine = InferenceEngine(make_core())
    recorded = engine._commands = RecordingQueue()
    engine.start()
    try:
        req = engine.make_request(engine.chat_prompt([{"role": "user", "content": QUESTIONS[1]}]),
                                  SamplingParams(max_tokens=50, ignore_eos=True))
        async with aclosing(engine.generate(req)) as stream:
            async for out in stream:
                if out.deltas:
                    break  # the consumer leaves: its abort is posted
        await engine.stats()
        await engine.send(Unpin("nobody"))
    finally:
        engine.shutdown()
    assert [type(item) for item in recorded.items] == [Queued] * 4
    assert [type(item.command) for item in recorded.items] == [AddRequest, Abort, Stats, Unpin]
    assert recorded.items[0].command.request is req and recorded.items[1].reply is None  # posted: no result
    for item in recorded.items:
        assert isinstance(item.command, Command) and not callable(item.command)
        assert not any(inspect.isfunction(getattr(item.command, f.name)) for f in dataclasses.fields(item.command))


@pytest.mark.model
async def test_the_state_arrives_before_the_outputs_and_results_that_change_it(make_core, loaded_fp32) -> None:
    """A finished session turn's caller finds the session pinned; an unpin's, the pin gone; a resize's,
    the pool's new limits, which `check_fits` then uses. The prefill gate is clear from the add to the
    first token, and set after."""
    engine = InferenceEngine(make_core(num_blocks=64, block_size=16))
    order: list[tuple[str, Any]] = []  # on the engine thread: each state published, each output handed out
    publish, dispatch = engine._events.publish_state, engine._dispatch
    engine._events.publish_state = lambda state: (order.append(("state", state)), publish(state))  # type: ignore
    engine._dispatch = lambda out: (order.append(("output", out.finished)), dispatch(out))  # type: ignore
    engine.start()
    try:
        req = engine.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[0]), SamplingParams(max_tokens=4))
        req.session_id = "s1"
        gates = []
        async for out in engine.generate(req):
            gates.append(engine.prefill_quiet.is_set())
            if out.finished:
                assert engine.state.pinned_sessions == {"s1"}
        pinned_at = next(i for i, (kind, s) in enumerate(order) if kind == "state" and s.pinned_sessions == {"s1"})
        assert pinned_at < order.index(("output", True))  # the pin was published before the last output
        states: list[EngineSnapshot] = [s for kind, s in order if kind == "state"]
        assert all(gates) and any(not s.prefill_quiet for s in states) and states[-1].prefill_quiet
        assert await engine.send(Unpin("s1")) and engine.state.pinned_sessions == frozenset()

        long = engine.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[0], LONG_SYSTEM),
                                   SamplingParams(max_tokens=1))
        engine.check_fits(long)
        assert await engine.send(Resize(8)) == 8 and engine.state.pool.num_blocks == 8
        with pytest.raises(RequestRejected):
            engine.check_fits(long)  # no round trip: against the limits the resize published
        assert await engine.send(Resize(64)) == 64
        engine.check_fits(long)
    finally:
        engine.shutdown()


@pytest.mark.model
async def test_failures_and_preemptions_arrive_as_state(make_core, loaded_fp32) -> None:
    core = make_core(num_blocks=24, block_size=8, max_queue_wait_s=3600)
    engine = InferenceEngine(core)
    execute = core.runner.execute

    def failing(plan: Any) -> Any:
        raise RuntimeError("injected step failure")

    engine.start()
    try:
        core.runner.execute = failing  # type: ignore[method-assign]
        req = engine.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[0]), SamplingParams(max_tokens=2))
        outs = [out async for out in engine.generate(req)]
        assert outs[-1].error is not None and engine.state.failure == "RuntimeError: injected step failure"
        core.runner.execute = execute  # type: ignore[method-assign]

        params = SamplingParams(max_tokens=16, ignore_eos=True)
        requests = [engine.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[i % len(QUESTIONS)]), params)
                    for i in range(6)]  # together twice the pool at least: preempted for room

        async def run(r: Any) -> Any:
            return [out async for out in engine.generate(r)][-1]

        finals = await asyncio.gather(*(run(r) for r in requests))
        assert all(f.error is None for f in finals)
        assert engine.state.failure is None  # a step computed again
        await engine.stats()
        preempted = engine.state.preemptions
    finally:
        engine.shutdown()
    assert preempted > 0 and preempted == core.scheduler.preemptions


@pytest.mark.model
async def test_each_event_loop_has_its_own_view(make_core, loaded_fp32) -> None:
    """A view belongs to the loop that made it; another loop's starts from the last published state."""
    engine = InferenceEngine(make_core())
    engine.start()
    try:
        req = engine.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[0]), SamplingParams(max_tokens=2))
        req.session_id = "s2"
        async for _ in engine.generate(req):
            pass
        here = engine._events.view()

        def other_loop() -> tuple[Any, frozenset[str]]:
            async def look() -> tuple[Any, frozenset[str]]:
                return engine._events.view(), engine.state.pinned_sessions
            return asyncio.run(look())

        there, pinned = await asyncio.to_thread(other_loop)
        assert there is not here and pinned == {"s2"}  # the other loop's view started from the last state
        assert await engine.send(Unpin("s2")) and engine.state.pinned_sessions == frozenset()  # the closed
        # loop's view is dropped as the engine thread publishes this, and this loop's still hears it
    finally:
        engine.shutdown()


async def held_between_steps(core: Any) -> tuple[InferenceEngine, threading.Event]:
    """A started engine whose thread is held in its housekeeping, past a round's drain of the queue and
    before the next step, until the returned event is set (commands sent meanwhile stay queued)."""
    engine = InferenceEngine(core)
    in_housekeeping, release = threading.Event(), threading.Event()
    tend = core.tend_pins
    core.tend_pins = lambda: (in_housekeeping.set(), release.wait(), tend())
    engine.start()
    await asyncio.to_thread(in_housekeeping.wait)
    return engine, release


@pytest.mark.model
async def test_the_prefill_gate_clears_as_a_request_is_sent(make_core, loaded_fp32) -> None:
    """The disk tier's gate is clear from the moment a request leaves the loop, before the engine thread
    has taken it, and set again once its first token is out."""
    engine, release = await held_between_steps(make_core())
    try:
        assert engine.prefill_quiet.is_set()
        req = engine.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[0]), SamplingParams(max_tokens=2))

        async def gate_at_first_token() -> bool | None:
            async with aclosing(engine.generate(req)) as stream:
                async for out in stream:
                    if out.deltas:
                        return engine.prefill_quiet.is_set()  # leaving aborts the rest
            return None

        run = asyncio.create_task(gate_at_first_token())
        while engine._commands.empty():  # the task's first step queues the add
            await asyncio.sleep(0)
        assert not engine.prefill_quiet.is_set() and engine.state.prefill_quiet  # the engine has not seen it
        release.set()
        assert await run is True
    finally:
        release.set()
        engine.shutdown()


@pytest.mark.model
async def test_a_generate_cancelled_while_its_add_waits_is_aborted(make_core, loaded_fp32) -> None:
    """A caller that leaves before the engine thread has taken its add (a client gone while a step runs)
    leaves no request behind: the abort queued after the add ends it, and its blocks go back."""
    engine, release = await held_between_steps(make_core())
    try:
        req = engine.make_request(chat_ids(loaded_fp32.tokenizer, QUESTIONS[0]),
                                  SamplingParams(max_tokens=2000, ignore_eos=True))

        async def consume() -> None:
            async with aclosing(engine.generate(req)) as stream:
                async for _ in stream:
                    pass

        run = asyncio.create_task(consume())
        while engine._commands.empty():  # the task's first step queues the add
            await asyncio.sleep(0)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        release.set()
        left = await on_engine_thread(engine, lambda c: (list(c.requests), c.pool.stats().used))
        assert left == ([], 0)
    finally:
        release.set()
        engine.shutdown()
