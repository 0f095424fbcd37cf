"""The async front of the engine: add a request, stream its outputs, abort it.

`EngineCore` runs on one dedicated thread, which alone touches the block pool, the tables
and the KV tensors. Everything else reaches it through `call()` (a function run between two
steps) and gets results back on its own event loop. Leaving a stream early (the consumer is
cancelled or stops iterating) aborts the request, so its blocks are always released.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import torch

from chatcore.config import Settings
from chatcore.engine.core import EngineCore
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.request import FinishReason, Request, SamplingParams
from chatcore.models.loader import LoadedModel, load_model

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.05


class EngineStopped(RuntimeError):
    pass


class _Stream:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="chatcore-engine", daemon=True)
        self.housekeeping: list[Callable[[], None]] = []

    @classmethod
    def from_settings(cls, settings: Settings, loaded: LoadedModel | None = None) -> AsyncEngine:
        if settings.threads:
            torch.set_num_threads(settings.threads)
        engine = cls(EngineCore(loaded or load_model(settings), settings))
        engine.start()
        return engine

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
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
                computed = False
                if self.core.has_work:
                    before = self.core.steps
                    outputs = self.core.step()
                    computed = self.core.steps != before
                    for out in outputs:
                        self._dispatch(out)
                if not computed:
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
            except Exception as exc:  # never let one bad step kill the server
                log.exception("engine loop error")
                self._fail_all(exc)
        self._fail_all(EngineStopped("the engine is shutting down"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _dispatch(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if out.finished:
            self._streams.pop(out.request_id, None)
        if stream is not None:
            stream.put(out)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self.core.requests):
            self.core.requests[request_id].error = str(exc)
            try:
                out = self.core.abort(request_id, FinishReason.ERROR)
                if out is not None:
                    self._dispatch(out)
            except Exception:
                log.exception("failed to release request %s", request_id)
        for request_id, stream in list(self._streams.items()):
            self._streams.pop(request_id, None)
            stream.put(exc)

    def _submit(self, command: Callable[[], None]) -> None:
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        self._commands.put(command)
        self._wake.set()

    # ----- the async API ---------------------------------------------------------------------
    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(core)` on the engine thread between two steps, and return its result."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.core)
            except BaseException as exc:  # delivered to the caller
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._submit(command)
        return await future

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; the last one has `finished` set.

        Raises `RequestRejected` at once for a request that can never fit.
        """
        stream = _Stream(asyncio.get_running_loop())

        def add(core: EngineCore) -> None:
            core.add(request)
            self._streams[request.request_id] = stream

        await self.call(add)
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
            if not finished and not self._stopping:
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
