"""The tokenizer thread is fed round-robin over tenants (chatcore/sessions/tokenize_queue.py): one
tenant's queue of large prompts delays another tenant's prompt by at most the job already running."""

from __future__ import annotations

import asyncio
import threading

import pytest

from chatcore.sessions.tokenize_queue import FairTokenizer


async def test_another_tenants_job_runs_next_whatever_one_tenant_queued() -> None:
    tokenizer = FairTokenizer()
    ran: list[str] = []
    release = threading.Event()

    def job(name: str, wait: bool = False):
        def work() -> str:
            if wait:
                assert release.wait(timeout=60)
            ran.append(name)
            return name
        return work

    try:
        first = asyncio.create_task(tokenizer.run("alpha", job("a0", wait=True)))
        await asyncio.sleep(0)  # a0 is on the thread, waiting for `release`
        alphas = [asyncio.create_task(tokenizer.run("alpha", job(f"a{i}"))) for i in range(1, 5)]
        beta = asyncio.create_task(tokenizer.run("beta", job("b0")))
        await asyncio.sleep(0)
        release.set()
        assert await asyncio.gather(first, beta, *alphas) == ["a0", "b0", "a1", "a2", "a3", "a4"]
        assert ran == ["a0", "b0", "a1", "a2", "a3", "a4"]
    finally:
        release.set()
        tokenizer.close()


async def test_a_failing_or_abandoned_job_leaves_the_queue_running() -> None:
    tokenizer = FairTokenizer()
    release = threading.Event()

    def boom() -> int:
        raise ValueError("bad text")

    try:
        blocker = asyncio.create_task(tokenizer.run("alpha", lambda: release.wait(timeout=60)))
        await asyncio.sleep(0)
        abandoned = asyncio.create_task(tokenizer.run("alpha", lambda: "never"))
        failing = asyncio.create_task(tokenizer.run("beta", boom))
        await asyncio.sleep(0)
        abandoned.cancel()
        release.set()
        assert await blocker is True
        with pytest.raises(ValueError, match="bad text"):
            await failing
        assert await tokenizer.run("gamma", lambda: 7) == 7
    finally:
        release.set()
        tokenizer.close()
