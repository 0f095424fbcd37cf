"""The engine's one door: add a request, stream its outputs, abort it, and send it commands.

`EngineCore` runs on one dedicated thread, which alone touches the block pool, the tables
and the KV tensors. Code outside `chatcore.engine` holds an `InferenceEngine` and nothing of the
core (tests/test_import_graph.py checks): the model's constants (`block_size`, `max_context`,
`salt`, ...) are read from here; everything that reads or changes the pool is a typed command
(`chatcore/engine/commands.py`) that `send` hands to the engine thread, which handles it between
two steps; its result comes back on the caller's event loop. No caller code runs on the engine
thread (`check_fits` reads only the pool's size, on the caller's). Leaving a stream early (the
consumer is cancelled or stops iterating) sends the request's `Abort`, like any other abort, so its
blocks are always released. What the engine tells callers besides outputs (a lost device) comes out
as events (`events`, chatcore/engine/events.py), which each caller handles on its own event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
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
from chatcore.engine.grammar import GrammarCompiler
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.request import Request, SamplingParams
from chatcore.models.loader import LoadedModel
from chatcore.outcomes import ErrorCode, FinishReason

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05
PIN_TENDING_S = 0.1  # how often the engine thread expires and trims the sessions' pins


class EngineStopped(RuntimeError):
    pass


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.abandoned = False  # set by the consumer as it leaves: nothing more is delivered

    def put(self, item: RequestOutput | BaseException) -> None:
        if not self.abandoned:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class InferenceEngine:
    def __init__(self, core: EngineCore) -> None:
        self._core = core
        # Constants, read before the engine thread starts, so that any thread may use them.
        self.loaded: LoadedModel = core.loaded
        self.tokenizer: Any = core.tokenizer
        self.block_size: int = core.pool.block_size
        self.max_context: int = core.scheduler.max_context  # the longest prompt + max_tokens, in tokens
        self.max_num_seqs: int = core.scheduler.max_num_seqs  # sequences running at once at most
        self.vocab_size: int = core.vocab_size
        self.kv_dtype: torch.dtype = core.kv.dtype
        # Compiles `response_format`s (the callers' half; the matchers stay in the core): thread-safe, and
        # slow (`compile_async` compiles on its pool, off the event loop).
        self.grammar_compiler: GrammarCompiler = core.grammar_compiler
        self._handlers = CommandHandlers(core, self._dispatch)
        # Published by the engine thread (after each step, and each command, before its result): read
        # on the event loop. The scheduler's count, and the sessions whose chains are pinned.
        self.preemptions = 0
        self.pinned_sessions: frozenset[str] = frozenset()
        self._pins_tended = 0.0
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        # Guards `_stopping` against `_submit`: once it is set, no command enters the queue, and the
        # thread runs every command queued before it (the last drain), so no caller waits forever.
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="chatcore-engine", daemon=True)
        # Set while no request awaits its first token. Background work that competes for the
        # cores (the disk tier's writes) waits for it, so a prefill that users wait on runs alone.
        # Cleared (under `_submit_lock`) when a request is submitted, set by the engine thread only
        # when no command is queued and no request awaits a first token: never set too early.
        self.prefill_quiet = threading.Event()
        self.prefill_quiet.set()
        # Why the last step failed, set by the engine thread and cleared when a step computes again:
        # readiness reads it (chatcore/engine/warmup.py).
        self.failure: str | None = None
        # Published by the engine thread, handled on each subscriber's loop (`events`).
        self._events = EngineEvents()

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
                self._publish_quiet()
                computed = self._core.has_work and self._step()
                if not computed:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
            except Exception as exc:  # never let one bad step kill the server
                log.exception("engine loop error")
                self.failure = describe_failure(exc)
                self._fail_all(exc)
        while True:  # run what was queued after the loop's last drain
            try:
                self._drain_commands()
                break
            except Exception:
                log.exception("engine command failed at shutdown")
        self._fail_all(EngineStopped("the engine is shutting down"))
        self.prefill_quiet.set()  # nothing will compute again: let the waiting writers go
        self._events.close()

    def _step(self) -> bool:
        """One step of the core, its outputs to their streams; whether it ran the model."""
        core = self._core
        before = core.steps
        outputs = core.step()
        computed = core.steps != before
        if computed or core.step_failure is not None:  # a step that ran the model, or failed to
            self.failure = core.step_failure
        if core.device_lost is not None:
            self._lose_device(core.device_lost)
        self.preemptions = core.scheduler.preemptions
        self._publish_pins()  # before the outputs: a finished turn's caller finds its session pinned
        for out in outputs:
            self._dispatch(out)
        self._publish_quiet()
        return computed

    def _tend_pins(self) -> None:
        now = time.monotonic()
        if now - self._pins_tended >= PIN_TENDING_S:
            self._pins_tended = now
            self._core.tend_pins()
            self._publish_pins()

    def _publish_pins(self) -> None:
        pinned = self._core.kv_cache.pinned_sessions
        if len(pinned) != len(self.pinned_sessions) or not self.pinned_sessions.issuperset(pinned):
            self.pinned_sessions = frozenset(pinned)

    def _lose_device(self, cause: str) -> None:
        """Stop taking work (each later call gets `EngineStopped`), and publish `DeviceLost`."""
        log.critical("engine: the device failed and its state is lost (%s); stopping", cause)
        with self._submit_lock:
            self._stopping = True
        self._events.publish(DeviceLost(cause))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _publish_quiet(self) -> None:
        if self._core.awaiting_first_token:
            self.prefill_quiet.clear()
            return
        with self._submit_lock:  # a request submitted meanwhile is still in the queue
            if self._commands.empty():
                self.prefill_quiet.set()

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

    def _submit(self, command: Callable[[], None], *, prefill: bool = False) -> None:
        """`prefill`: the command adds a request, which will await its first token."""
        with self._submit_lock:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            self._commands.put(command)
            if prefill:
                self.prefill_quiet.clear()
        self._wake.set()

    # ----- the async API ---------------------------------------------------------------------
    async def send(self, command: Command[T]) -> T:
        """Have the engine thread handle `command` between two steps; its result."""
        return await self._run_on_thread(lambda: self._handlers.handle(command))

    def _post(self, command: Command[Any]) -> None:
        """Have the engine thread handle `command` as `send` does, its result dropped: for a caller that
        cannot await (a stream's consumer leaving, its loop maybe closing). `EngineStopped` once stopping."""

        def handle() -> None:
            self._handlers.handle(command)
            self._publish_pins()

        self._submit(handle)

    def events(self) -> AsyncIterator[EngineEvent]:
        """The engine's events (chatcore/engine/events.py) on the caller's event loop, those already
        published first, until the engine's thread ends."""
        return self._events.subscribe()

    async def _run_on_thread(self, fn: Callable[[], T], *, prefill: bool = False) -> T:
        """`prefill`: `fn` adds a request (see `prefill_quiet`)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn()
                self._publish_pins()
            except BaseException as exc:  # delivered to the caller
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._submit(command, prefill=prefill)
        return await future

    def check_fits(self, request: Request) -> None:
        """`RequestRejected` for a request that can never fit the context or the pool.

        Checked on the caller's thread: it reads the context and the pool's size, nothing the
        engine thread changes but a resize, and `generate` checks again when it adds the request.
        A round trip to the engine thread waited for the running step (a prefill chunk: ~200 ms
        on two cores) before a turn could even write its rows."""
        self._core.scheduler.check_fits(request)

    async def stats(self) -> PoolStats:
        """The pool's blocks by state, counted on the engine thread."""
        return await self.send(Stats())

    async def generate(self, request: Request, prefix: SessionPrefix | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has `finished` set.

        Raises `RequestRejected` at once for a request that can never fit. `prefix`: a session
        turn's, prepared as the request is added, in the same round trip (each one waits for the
        running step); `PrefixOnDisk` when it declines, before anything is streamed.
        """
        stream = _Stream(asyncio.get_running_loop())
        command = AddRequest(request, prefix)

        def add() -> int | None:
            declined = self._handlers.handle(command)
            if declined is None:
                self._streams[request.request_id] = stream
            return declined

        declined = await self._run_on_thread(add, prefill=True)
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
            if not finished:  # the consumer left: nobody reads the abort's final output
                stream.abandoned = True
                with contextlib.suppress(EngineStopped):  # a stopping engine fails every request itself
                    self._post(Abort(request.request_id))

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request in any state; its stream ends with finish reason `cancelled`."""
        output: RequestOutput | None = await self.send(Abort(request_id))
        return output

    def make_request(self, prompt: list[int], params: SamplingParams, **kwargs: Any) -> Request:
        return self._core.make_request(prompt, params, **kwargs)

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of `messages` (and `tools`, for a template that takes them) rendered by the model's
        chat template, with the generation prompt."""
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
