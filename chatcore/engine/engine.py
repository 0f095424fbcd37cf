"""The engine's one door: add a request, stream its outputs, abort it, and send it commands.

`EngineCore` runs on one dedicated thread, which alone touches the block pool, the tables and the KV
tensors. Code outside `chatcore.engine` holds an `InferenceEngine` and nothing of the core
(tests/test_import_graph.py, tests/test_engine_door.py check), and gets facts, never objects:
- what the engine is, fixed at its start: `info` (`EngineInfo`: sizes, the tokenizer, the
  fingerprint; never the loaded model);
- what it is now: `state`, the `EngineSnapshot` the engine thread last published to the caller's
  event loop (chatcore/engine/snapshot.py), and the `prefill_quiet` gate derived from it;
- what happened: `events` (a lost device, chatcore/engine/events.py), handled on the caller's loop;
- everything that reads or changes the pool is a typed command (chatcore/engine/commands.py) that
  `send` queues for the engine thread, which handles it between two steps; its result comes back on
  the caller's event loop. The queue holds commands and where their results go, never code: no
  caller code runs on the engine thread.
`check_fits` runs on the caller's thread against the pool's limits in `state` (a round trip would
wait for the running step); `generate` checks again as the engine thread adds the request. Leaving
a stream early (the consumer is cancelled or stops iterating) sends the request's `Abort`, like any
other abort, so its blocks are always released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import torch

from chatcore import openmp
from chatcore.cache.pool import PoolStats
from chatcore.config import Settings
from chatcore.engine.command_handlers import CommandHandlers
from chatcore.engine.commands import Abort, AddRequest, Command, SessionPrefix, Stats
from chatcore.engine.core import EngineCore
from chatcore.engine.errors import PrefixOnDisk, describe_failure
from chatcore.engine.events import DeviceLost, EngineEvent, EngineEvents
from chatcore.engine.fits import check_fits
from chatcore.engine.grammar import GrammarCompiler
from chatcore.engine.info import EngineInfo
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.queued import Queued, Reply, Stream
from chatcore.engine.request import Request, SamplingParams
from chatcore.engine.snapshot import EngineSnapshot
from chatcore.kv.tensors import KVTensors
from chatcore.models.loader import LoadedModel
from chatcore.outcomes import ErrorCode, FinishReason

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05
PIN_TENDING_S = 0.1  # how often the engine thread expires and trims the sessions' pins


class EngineStopped(RuntimeError):
    pass


def engine_info(core: EngineCore) -> EngineInfo:
    """The facts of `core`'s model and cache that the door hands out."""
    loaded = core.loaded
    return EngineInfo(
        model_name=loaded.path.name, device=str(loaded.device), model_dtype=loaded.dtype_name,
        fingerprint=loaded.fingerprint, tokenizer=core.tokenizer, stop_token_ids=frozenset(loaded.stop_token_ids),
        block_size=core.kv_cache.block_size, max_context=core.scheduler.max_context,
        max_num_seqs=core.scheduler.max_num_seqs, vocab_size=core.vocab_size,
        kv_dtype=str(core.kv.dtype).removeprefix("torch."),
        kv_bytes_per_token=KVTensors.bytes_per_block(loaded.num_layers, 1, loaded.num_kv_heads, loaded.head_dim,
                                                     core.kv.dtype))


class InferenceEngine:
    # What the door hands out besides its methods (tests/test_engine_door.py reads these names).
    info: EngineInfo  # built before the engine thread starts: any thread may read it
    # Compiles `response_format`s (the callers' half; the matchers stay in the core): thread-safe, and
    # slow (`compile_async` compiles on its pool, off the event loop).
    grammar_compiler: GrammarCompiler

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self.info = engine_info(core)
        self.grammar_compiler = core.grammar_compiler
        self._handlers = CommandHandlers(core, self._dispatch)
        self._failure: str | None = None  # why the last step failed (engine thread; published in `state`)
        self._pins_tended = 0.0
        self._commands: queue.SimpleQueue[Queued] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, Stream] = {}
        self._stopping = False
        # Guards `_stopping` against `_submit`: once it is set, no command enters the queue, and the
        # thread runs every command queued before it (the last drain), so no caller waits forever.
        # The engine thread reads the queue's emptiness under it too, so that it never publishes
        # `prefill_quiet` while a request is queued.
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="chatcore-engine", daemon=True)
        # Published by the engine thread, handled on each subscriber's loop (`events`, `state`).
        self._events = EngineEvents(self._snapshot(pinned=frozenset(), quiet=True))

    @classmethod
    def launch(cls, settings: Settings, loaded: LoadedModel) -> InferenceEngine:
        """Build the core over a loaded model (`chatcore.models.loader.load_model`) and start its thread."""
        if settings.threads:
            torch.set_num_threads(settings.threads)
        engine = cls(EngineCore(loaded, settings))
        openmp.release_team()  # building the core ran parallel ops here; the engine thread computes
        engine.start()
        return engine

    def salt(self, scope_key: str = "global") -> bytes:
        """The cache salt of a scope: the block hashes of its requests and of its sessions' chains."""
        return self._core.salt(scope_key)

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._submit_lock:
            self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    # ----- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._drain_commands()
                self._tend_pins()
                self._publish_state()
                computed = self._core.has_work and self._step()
                if not computed:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
            except Exception as exc:  # never let one bad step kill the server
                log.exception("engine loop error")
                self._failure = describe_failure(exc)
                self._publish_state()
                self._fail_all(exc)
        while True:  # run what was queued after the loop's last drain
            try:
                self._drain_commands()
                break
            except Exception:
                log.exception("engine command failed at shutdown")
        self._fail_all(EngineStopped("the engine is shutting down"))
        self._publish_state()  # nothing computes or is queued any more: quiet, so waiting writers go
        self._events.close()

    def _step(self) -> bool:
        """One step of the core, its outputs to their streams; whether it ran the model."""
        core = self._core
        before = core.steps
        outputs = core.step()
        computed = core.steps != before
        if computed or core.step_failure is not None:  # a step that ran the model, or failed to
            self._failure = core.step_failure
        if core.device_lost is not None:
            self._lose_device(core.device_lost)
        self._publish_state()  # before the outputs: a finished turn's caller finds its session pinned
        for out in outputs:
            self._dispatch(out)
        return computed

    def _tend_pins(self) -> None:
        now = time.monotonic()
        if now - self._pins_tended >= PIN_TENDING_S:
            self._pins_tended = now
            self._core.tend_pins()

    def _publish_state(self) -> None:
        """Publish the engine's state to every caller's view, if it changed since it was last published."""
        last = self._events.state
        pinned = self._core.kv_cache.pinned_sessions
        if len(pinned) != len(last.pinned_sessions) or not last.pinned_sessions.issuperset(pinned):
            pinned_now = frozenset(pinned)
        else:
            pinned_now = last.pinned_sessions
        state = self._snapshot(pinned=pinned_now, quiet=self._quiet())
        if state != last:
            self._events.publish_state(state)

    def _snapshot(self, *, pinned: frozenset[str], quiet: bool) -> EngineSnapshot:
        core = self._core
        return EngineSnapshot(core.kv_cache.limits(), self._failure, quiet, pinned, core.scheduler.preemptions)

    def _quiet(self) -> bool:
        """No request awaits its first token, and none is queued (nor any other command)."""
        if self._core.awaiting_first_token:
            return False
        with self._submit_lock:
            return self._commands.empty()

    def _lose_device(self, cause: str) -> None:
        """Stop taking work (each later call gets `EngineStopped`), and publish `DeviceLost`."""
        log.critical("engine: the device failed and its state is lost (%s); stopping", cause)
        with self._submit_lock:
            self._stopping = True
        self._events.publish(DeviceLost(cause))

    def _drain_commands(self) -> None:
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item: Queued) -> None:
        """Handle one queued command; publish the state it left, then hand its result back."""
        try:
            result = self._handlers.handle(item.command)
        except BaseException as exc:
            self._publish_state()
            if item.reply is None:
                raise
            item.reply.error(exc)  # delivered to the caller
            return
        if item.stream is not None and isinstance(item.command, AddRequest) and result is None:
            self._streams[item.command.request.request_id] = item.stream  # added: its outputs go there
        self._publish_state()
        if item.reply is not None:
            item.reply.result(result)

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if out.finished:
            self._streams.pop(out.request_id, None)
        if stream is not None:
            stream.put(out)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._core.requests):
            self._core.requests[request_id].fail(ErrorCode.INTERNAL, str(exc), FinishReason.ERROR)
            try:
                out = self._core.abort(request_id, FinishReason.ERROR)
                if out is not None:
                    self._dispatch(out)
            except Exception:
                log.exception("failed to release request %s", request_id)
        for request_id, stream in list(self._streams.items()):
            self._streams.pop(request_id, None)
            stream.put(exc)

    def _submit(self, item: Queued) -> None:
        with self._submit_lock:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            self._commands.put(item)
        self._wake.set()

    # ----- what the engine is now --------------------------------------------------------------
    @property
    def state(self) -> EngineSnapshot:
        """The engine's last published state, on the caller's event loop: failure, pins, preemptions, pool."""
        return self._events.view().snapshot

    @property
    def prefill_quiet(self) -> threading.Event:
        """Set while no request awaits its first token: the disk tier's writer waits for it (read the
        gate on any thread; take it on an event loop, whose view keeps it)."""
        return self._events.view().prefill_quiet

    def check_fits(self, request: Request) -> None:
        """`RequestRejected` for a request that can never fit the context or the pool: on the caller's
        thread, against the pool's limits in `state` (a round trip to the engine thread waited for the
        running step: a prefill chunk, ~200 ms on two cores); `generate` checks again as it adds it."""
        check_fits(request, self.info.max_context, self.state.pool)

    # ----- the async API ---------------------------------------------------------------------
    async def send(self, command: Command[T]) -> T:
        """Have the engine thread handle `command` between two steps; its result."""
        reply: Reply[T] = Reply()
        self._submit(Queued(command, reply))
        return await reply.future

    def _post(self, command: Command[Any]) -> None:
        """Have the engine thread handle `command` as `send` does, its result dropped: for a caller that
        cannot await (a stream's consumer leaving, its loop maybe closing). `EngineStopped` once stopping."""
        self._submit(Queued(command))

    def events(self) -> AsyncIterator[EngineEvent]:
        """The engine's events (chatcore/engine/events.py) on the caller's event loop, those already
        published first, until the engine's thread ends."""
        return self._events.subscribe()

    async def stats(self) -> PoolStats:
        """The pool's blocks by state, counted on the engine thread."""
        return await self.send(Stats())

    async def generate(self, request: Request, prefix: SessionPrefix | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has `finished` set.

        Raises `RequestRejected` at once for a request that can never fit. `prefix`: a session
        turn's, prepared as the request is added, in the same round trip (each one waits for the
        running step); `PrefixOnDisk` when it declines, before anything is streamed.
        """
        stream = Stream(asyncio.get_running_loop())
        try:
            declined = await self._add(AddRequest(request, prefix), stream)
        except asyncio.CancelledError:  # the add is queued and runs: the abort, queued after it, ends it
            self._abandon(request, stream)
            raise
        if declined is not None:
            raise PrefixOnDisk(declined)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abandon(request, stream)

    def _abandon(self, request: Request, stream: Stream) -> None:
        """The consumer left: abort the request (nobody reads the abort's final output)."""
        stream.abandoned = True
        with contextlib.suppress(EngineStopped):  # a stopping engine fails every request itself
            self._post(Abort(request.request_id))

    async def _add(self, command: AddRequest, stream: Stream) -> int | None:
        """Send `command`, its outputs to `stream` once it is added; this loop's prefill gate stays clear
        until the engine thread has answered (its state then says whether a prefill runs)."""
        view = self._events.view()
        reply: Reply[int | None] = Reply()
        view.add_sent()
        try:
            self._submit(Queued(command, reply, stream))
            return await reply.future
        finally:
            view.add_answered()

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request in any state; its stream ends with finish reason `cancelled`."""
        return await self.send(Abort(request_id))

    def make_request(self, prompt: list[int], params: SamplingParams, **kwargs: Any) -> Request:
        return self._core.make_request(prompt, params, **kwargs)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of `messages` (and `tools`, for a template that takes them) rendered by the model's
        chat template, with the generation prompt."""
        ids = self.info.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

