"""SQLite transactions queued in the process, not in SQLite's busy handler.

SQLite lets one writer in at a time. The others wait in its busy handler, which sleeps in growing
steps (1, 2, 5, ... up to 100 ms) between retries, so under a burst each waiter sleeps far
longer than the writes before it take: with 16 turns starting at once on the server benchmark,
the last turn's four-statement transaction (its rows and frame numbers) took 340-550 ms, which
all came before its request reached the engine. A `QueuedSession` takes an asyncio lock before
each `begin()`, so the transactions of this process run one after another, each waiting only for
those queued before it. The busy timeout still covers other processes (the CLI) writing the file.

The lock is reentrant per task: a transaction that a task opens inside its own is not queued
behind itself. It is one lock per event loop (a lock belongs to the loop that waits on it).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, AsyncSessionTransaction


class _LoopLock:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.owner: asyncio.Task[Any] | None = None


class WriteQueue:
    """One writer at a time per event loop; reentrant for the task that holds it."""

    def __init__(self) -> None:
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopLock] = weakref.WeakKeyDictionary()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        state = self._locks.get(loop)
        if state is None:
            state = self._locks[loop] = _LoopLock()
        task = asyncio.current_task()
        if task is not None and state.owner is task:
            yield
            return
        async with state.lock:
            state.owner = task
            try:
                yield
            finally:
                state.owner = None


class QueuedSession(AsyncSession):
    """An `AsyncSession` whose `begin()` waits for its turn in `write_queue` first."""

    def __init__(self, *args: Any, write_queue: WriteQueue, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.write_queue = write_queue

    def begin(self) -> Any:  # an async context manager, as `AsyncSession.begin()`'s result is used
        return self._queued(super().begin())

    @asynccontextmanager
    async def _queued(self, transaction: AsyncSessionTransaction) -> AsyncIterator[AsyncSessionTransaction]:
        async with self.write_queue.turn(), transaction:
            yield transaction
