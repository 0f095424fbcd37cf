"""A coroutine run every few seconds on the event loop, from `start()` until `stop()`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class Periodic:
    """Runs `job` every `interval_s`. A run that raises is logged and the next one runs anyway:
    a background chore must never die of one bad pass."""

    def __init__(self, name: str, interval_s: float, job: Callable[[], Awaitable[object]]) -> None:
        self.name = name
        self.interval_s = interval_s
        self.job = job
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.job()
            except Exception:
                log.exception("%s failed", self.name)
