"""Tokenizer work on one thread, taken from the tenants' queues in turn.

Client text is tokenized off the event loop: a 1 MiB body takes about a second and a half. One thread,
so encodes never run concurrently (a fast tokenizer's truncation and padding are state its encode may
set); the engine thread only decodes. The thread is fed round-robin over tenants: the next job is the
oldest of the next tenant in the round but the one served last, so a tenant's job waits behind at most one job of each
other tenant with work, however many one tenant queued. Text that cannot fit the context is refused
before it gets here (chatcore/sessions/char_bound.py), which bounds each job. A job whose caller left
(its future cancelled) is skipped.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
Job = tuple[Callable[[], Any], "asyncio.Future[Any]"]


class FairTokenizer:
    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatcore-tokenize")
        self._queues: dict[str, deque[Job]] = {}  # in the round's order: the next tenant first
        self._busy = False
        self._last: str | None = None  # the tenant whose job ran last

    async def run(self, tenant: str, work: Callable[[], T]) -> T:
        """`work`'s result, run on the tokenizer thread in `tenant`'s turn."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queues.setdefault(tenant, deque()).append((work, future))
        self._start_next(loop)
        return await future

    def _start_next(self, loop: asyncio.AbstractEventLoop) -> None:
        while not self._busy and self._queues:
            tenant = next((t for t in self._queues if t != self._last), next(iter(self._queues)))
            queue = self._queues.pop(tenant)
            work, future = queue.popleft()
            if queue:
                self._queues[tenant] = queue  # to the back of the round
            if future.done():  # its caller left
                continue
            self._busy, self._last = True, tenant
            running = loop.run_in_executor(self._thread, work)
            running.add_done_callback(lambda ran, f=future: self._finished(loop, ran, f))

    def _finished(self, loop: asyncio.AbstractEventLoop, ran: asyncio.Future[Any], future: asyncio.Future[Any]) -> None:
        self._busy = False
        if not future.done():
            if ran.cancelled():
                future.cancel()
            elif (exc := ran.exception()) is not None:
                future.set_exception(exc)
            else:
                future.set_result(ran.result())
        self._start_next(loop)

    def close(self) -> None:
        """Stop the thread (at shutdown): queued work is cancelled, not run."""
        for queue in self._queues.values():
            for _, future in queue:
                future.cancel()
        self._queues.clear()
        self._thread.shutdown(wait=False, cancel_futures=True)
