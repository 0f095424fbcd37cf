"""What crosses from callers to the engine thread: the items of its queue, and where results go back.

Invariants: an item holds a typed command (`chatcore/engine/commands.py`) and the caller's channels
(its result's future, an added request's stream), never code; the engine thread only hands values
to those channels, each queued on its caller's event loop (`call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from chatcore.engine.commands import Command
from chatcore.engine.outputs import RequestOutput

T = TypeVar("T")


class Stream:
    """Where a request's outputs go: a queue on its consumer's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.abandoned = False  # set by the consumer as it leaves: nothing more is delivered

    def put(self, item: RequestOutput | BaseException) -> None:
        if not self.abandoned:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Reply(Generic[T]):
    """Where a command's result goes: a future on the sender's event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.future: asyncio.Future[T] = self.loop.create_future()

    def result(self, value: T) -> None:
        self.loop.call_soon_threadsafe(_set_result, self.future, value)

    def error(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(_set_exception, self.future, exc)


@dataclass(frozen=True, slots=True)
class Queued:
    """One item of the engine's queue: a command, where its result goes (none for a posted one), and,
    for an `AddRequest`, the stream its outputs go to once it is added."""

    command: Command[Any]
    reply: Reply[Any] | None = None
    stream: Stream | None = None


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
