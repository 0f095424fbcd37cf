"""The engine's one door: add a request, stream its outputs, abort it, and what else callers need.

`EngineCore` runs on one dedicated thread, which alone touches the block pool, the tables
and the KV tensors. Code outside `chatcore.engine` holds an `InferenceEngine` and nothing of the
core (tests/test_import_graph.py checks): the model's constants (`block_size`, `max_context`,
`salt`, ...) are read from here; everything that reads or changes the pool runs on the engine
thread, between two steps, through `on_thread` (with `blocks`, the engine-thread operations on
the pool's blocks) or `stats`, and its result comes back on the caller's event loop (`check_fits`
reads only the pool's size). Leaving a stream early (the consumer is cancelled or stops
iterating) aborts the request, so its blocks are always released.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import torch

from chatcore import openmp
from chatcore.cache.pool import PoolStats
from chatcore.config import Settings
from chatcore.engine.block_ops import BlockOps
from chatcore.engine.core import EngineCore
from chatcore.engine.errors import describe_failure
from chatcore.engine.grammar import Grammars
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.request import Request, SamplingParams
from chatcore.models.loader import LoadedModel, load_model
from chatcore.outcomes import ErrorCode, FinishReason

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05
# Called on the engine thread with a number of blocks wanted available, before admission gives up
# or a running request is preempted, and a function that counts the blocks available now: the
# sessions layer releases idle pins until that count reaches the number (`PinRegistry.reclaim`).
Reclaim = Callable[[int, Callable[[], int]], object]


class EngineStopped(RuntimeError):
    pass


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class InferenceEngine:
    def __init__(self, core: EngineCore, reclaim: Reclaim | None = None) -> None:
        self.core = core
        # Constants, read before the engine thread starts, so that any thread may use them.
        self.loaded: LoadedModel = core.loaded
        self.tokenizer: Any = core.tokenizer
        self.block_size: int = core.pool.block_size
        self.max_context: int = core.scheduler.max_context  # the longest prompt + max_tokens, in tokens
        self.vocab_size: int = core.vocab_size
        self.kv_dtype: torch.dtype = core.kv.dtype
        # Compiles `response_format`s: thread-safe, and slow (compile off the event loop).
        self.grammars: Grammars = core.grammars
        # Engine-thread operations on the pool's blocks, for functions run by `on_thread`.
        self.blocks = BlockOps(core)
        if reclaim is not None:
            pool = core.pool
            core.scheduler.reclaim = lambda wanted: reclaim(wanted, lambda: pool.num_available)
        # The scheduler's count, published by the engine thread after each step: read on the event loop.
        self.preemptions = 0
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
        self.housekeeping: list[Callable[[], None]] = []
        # Why the last step failed, set by the engine thread and cleared when a step computes again:
        # readiness reads it (chatcore/engine/warmup.py).
        self.failure: str | None = None
        # Called once, on the engine thread, when the device failed for good (`EngineCore.device_lost`):
        # the engine stops, and the server exits so that a supervisor restarts it.
        self.on_device_lost: Callable[[str], None] | None = None

    @classmethod
    def from_settings(cls, settings: Settings, loaded: LoadedModel | None = None,
                      reclaim: Reclaim | None = None) -> InferenceEngine:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        engine = cls(EngineCore(loaded or load_model(settings), settings), reclaim)
        openmp.release_team()  # building the core ran parallel ops here; the engine thread computes
        engine.start()
        return engine

    def salt(self, scope_key: str = "global") -> bytes:
        """The cache salt of a scope: the block hashes of its requests and of its sessions' chains."""
        return self.core.salt(scope_key)

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
                for task in self.housekeeping:
                    task()
                self._publish_quiet()
                computed = False
                if self.core.has_work:
                    before = self.core.steps
                    outputs = self.core.step()
                    computed = self.core.steps != before
                    if computed or self.core.step_failure is not None:  # a step that ran the model, or failed to
                        self.failure = self.core.step_failure
                    if self.core.device_lost is not None:
                        self._lose_device(self.core.device_lost)
                    self.preemptions = self.core.scheduler.preemptions
                    for out in outputs:
                        self._dispatch(out)
                    self._publish_quiet()
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

    def _lose_device(self, cause: str) -> None:
        """Stop taking work (each later call gets `EngineStopped`), and tell the server."""
        log.critical("engine: the device failed and its state is lost (%s); stopping", cause)
        with self._submit_lock:
            self._stopping = True
        if self.on_device_lost is not None:
            self.on_device_lost(cause)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _publish_quiet(self) -> None:
        if self.core.awaiting_first_token:
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
        for request_id in list(self.core.requests):
            self.core.requests[request_id].fail(ErrorCode.INTERNAL, str(exc), FinishReason.ERROR)
            try:
                out = self.core.abort(request_id, FinishReason.ERROR)
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
    async def call(self, fn: Callable[[EngineCore], T], *, prefill: bool = False) -> T:
        """Run `fn(core)` on the engine thread between two steps, and return its result. For the
        engine's own modules and tests; code outside `chatcore.engine` uses `on_thread`.
        `prefill`: `fn` adds a request (see `prefill_quiet`)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.core)
            except BaseException as exc:  # delivered to the caller
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._submit(command, prefill=prefill)
        return await future

    async def on_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the engine thread between two steps, and return its result: where the
        sessions' pins and `blocks` may be used."""
        return await self.call(lambda core: fn())

    def check_fits(self, request: Request) -> None:
        """`RequestRejected` for a request that can never fit the context or the pool.

        Checked on the caller's thread: it reads the context and the pool's size, nothing the
        engine thread changes but a resize, and `generate` checks again when it adds the request.
        A round trip to the engine thread waited for the running step (a prefill chunk: ~200 ms
        on two cores) before a turn could even write its rows."""
        self.core.scheduler.check_fits(request)

    async def stats(self) -> PoolStats:
        """The pool's blocks by state, counted on the engine thread."""
        return await self.call(lambda core: core.pool.stats())

    async def generate(self, request: Request,
                       admit: Callable[[], bool] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has `finished` set.

        Raises `RequestRejected` at once for a request that can never fit. `admit`, if given, runs
        on the engine thread just before the request is added, in the same round trip (each one
        waits for the running step), and may attach the request's prefix; when it returns False,
        the request is not added and the stream ends at once, empty.
        """
        stream = _Stream(asyncio.get_running_loop())

        def add(core: EngineCore) -> bool:
            if admit is not None and not admit():
                return False
            core.add(request)
            self._streams[request.request_id] = stream
            return True

        if not await self.call(add, prefill=True):
            return
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
                with contextlib.suppress(EngineStopped):  # a stopping engine fails every request itself
                    self._submit(lambda: self._abort_now(request.request_id))

    def _abort_now(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.core.abort(request_id)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request in any state; its stream ends with finish reason `cancelled`."""

        def abort(core: EngineCore) -> RequestOutput | None:
            out = core.abort(request_id)
            if out is not None:
                self._dispatch(out)
            return out

        return await self.call(abort)

    def make_request(self, prompt: list[int], params: SamplingParams, **kwargs: Any) -> Request:
        return self.core.make_request(prompt, params, **kwargs)

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
