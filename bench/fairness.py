"""Suite fairness: a tenant's latency beside another tenant's hogs (issue 53), as ratios to its idle figure.

A real `chatcore serve` in keyed mode, tenants alpha and beta. Beta sends short streamed chats one at a
time (`probe`): its TTFT (to the first token) and ITL (the mean gap between its tokens) idle, then
beside each of alpha's hogs, all in one run:
* slots: 8 concurrent chats of `n: 8`, 800 tokens each, `ignore_eos` (every sequence slot on the CPU);
* prompt: one `/v1/completions` of 8,000 token ids;
* bodies: 16 concurrent chats of 1 MB messages.
Targets: beta's TTFT p50 at most 2x idle beside each hog, and no 429 for beta. A hog is stopped (its
streams closed, which aborts its requests) once beta's probes are done; beta's probes must end before
the hog does, so they ran beside it. `--quick` scales the hogs down (their shape kept).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chatcore.bench import live
from chatcore.bench.common import Context, median, target

PROBE_MESSAGE = "Name a color."
Hog = Callable[[httpx.AsyncClient, str, asyncio.Event], Awaitable[list[int]]]


@dataclass
class Probes:
    """Beta's requests: their HTTP statuses, and each answered one's TTFT and mean ITL in seconds."""

    statuses: list[int] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"requests": len(self.statuses), "refused_429": self.statuses.count(429),
                "ttft_p50_ms": 1e3 * median(self.ttft_s), "itl_p50_ms": 1e3 * median(self.itl_s)}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def stream_chat(http: httpx.AsyncClient, key: str, body: dict[str, Any],
                      first: Callable[[], None] = lambda: None) -> tuple[int, list[float]]:
    """POST a streamed chat (or completion, with `prompt`); its status and the arrival time of each chunk
    that carries text. `first` is called at the first such chunk."""
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    times: list[float] = []
    async with http.stream("POST", path, json={**body, "stream": True}, headers=bearer(key)) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, times
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if any(c.get("text") or (c.get("delta") or {}).get("content") for c in choices):
                times.append(time.perf_counter())
                if len(times) == 1:
                    first()
    return resp.status_code, times


async def probe(http: httpx.AsyncClient, key: str, count: int, max_tokens: int) -> Probes:
    """Beta's `count` short chats, one after another."""
    probes = Probes()
    for i in range(count):
        body = {"messages": [{"role": "user", "content": f"{PROBE_MESSAGE} ({i})"}], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}
        sent = time.perf_counter()
        status, times = await stream_chat(http, key, body)
        probes.statuses.append(status)
        if times:
            probes.ttft_s.append(times[0] - sent)
            if len(times) > 1:
                probes.itl_s.append((times[-1] - times[0]) / (len(times) - 1))
    return probes


def slots_hog(concurrency: int, n: int, max_tokens: int) -> Hog:
    """`concurrency` chats of `n` answers, `max_tokens` each with `ignore_eos`; `running` is set once every
    one of them streams."""
    async def hog(http: httpx.AsyncClient, key: str, running: asyncio.Event) -> list[int]:
        started = 0

        def one_more() -> None:
            nonlocal started
            started += 1
            if started == concurrency:
                running.set()

        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "n": n,
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8}
        results = await asyncio.gather(*(stream_chat(http, key, body, one_more) for _ in range(concurrency)))
        return [status for status, _ in results]
    return hog


def prompt_hog(tokens: int) -> Hog:
    """One completion of `tokens` token ids; `running` is set once it is sent (it streams nothing until
    its prompt is computed, which is the hog)."""
    async def hog(http: httpx.AsyncClient, key: str, running: asyncio.Event) -> list[int]:
        body = {"prompt": [1000 + i % 5000 for i in range(tokens)], "max_tokens": 4, "temperature": 0}
        task = asyncio.ensure_future(stream_chat(http, key, body))
        running.set()
        status, _ = await task
        return [status]
    return hog


def bodies_hog(count: int, chars: int) -> Hog:
    """`count` concurrent chats of a `chars`-character message; `running` is set once they are sent."""
    async def hog(http: httpx.AsyncClient, key: str, running: asyncio.Event) -> list[int]:
        body = {"messages": [{"role": "user", "content": "pear " * (chars // 5)}], "max_tokens": 4}
        tasks = [asyncio.ensure_future(stream_chat(http, key, body)) for _ in range(count)]
        running.set()
        return [status for status, _ in await asyncio.gather(*tasks)]
    return hog


@dataclass
class Beside:
    probes: Probes
    hog_statuses: list[int] | None  # None: the hog was still running when beta's probes ended (stopped then)


async def beside(base_url: str, keys: dict[str, str], hog: Hog, count: int, max_tokens: int) -> Beside:
    """Beta's probes while alpha's hog runs; the hog is stopped once they end."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=900, limits=limits) as hogs, \
            httpx.AsyncClient(base_url=base_url, timeout=900) as http:
        running = asyncio.Event()
        task = asyncio.ensure_future(hog(hogs, keys["alpha"], running))
        waiter = asyncio.ensure_future(running.wait())
        await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        probes = await probe(http, keys["beta"], count, max_tokens)
        statuses = task.result() if task.done() else None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return Beside(probes, statuses)


def create_keys(env: dict[str, str], tenants: tuple[str, ...] = ("alpha", "beta")) -> dict[str, str]:
    """A key for each tenant, made with `chatcore keys create` on the server's database."""
    keys = {}
    for tenant in tenants:
        out = subprocess.run([sys.executable, "-m", "chatcore.cli", "keys", "create", "--tenant", tenant],
                             env=env, capture_output=True, text=True, check=True, timeout=120)
        keys[tenant] = out.stdout.strip().splitlines()[-1]
    return keys


def sizes(ctx: Context) -> dict[str, Any]:
    if ctx.tiny:
        return {"probes": 3, "probe_tokens": 4, "slots": (2, 4, 32), "prompt": 600, "bodies": (4, 1_000_000)}
    if ctx.quick:
        return {"probes": 3, "probe_tokens": 6, "slots": (4, 8, 200), "prompt": 4000, "bodies": (16, 1_000_000)}
    return {"probes": 9, "probe_tokens": 16, "slots": (8, 8, 800), "prompt": 8000, "bodies": (16, 1_000_000)}


def run(ctx: Context) -> dict[str, Any]:
    sz = sizes(ctx)
    root = Path(tempfile.mkdtemp(prefix="chatcore-bench-fairness-"))
    try:
        env = {**os.environ, "CHATCORE_DATA_DIR": str(root)}
        keys = create_keys(env)
        server = live.start(ctx, root, max_queue_wait_s=None)  # alpha may run 64 sequences (its hog)
        try:
            rows = asyncio.run(_measure(server.base_url, keys, sz))
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _result(sz, rows)


async def _measure(base_url: str, keys: dict[str, str], sz: dict[str, Any]) -> dict[str, dict[str, Any]]:
    count, tokens = sz["probes"], sz["probe_tokens"]
    async with httpx.AsyncClient(base_url=base_url, timeout=900) as http:
        await probe(http, keys["beta"], 1, tokens)  # untimed: beta's system prompt cached, first-call costs paid
        idle = await probe(http, keys["beta"], count, tokens)
    rows = {"idle": {**idle.summary(), "hog": "none"}}
    hogs = {"slots": slots_hog(*sz["slots"]), "prompt": prompt_hog(sz["prompt"]), "bodies": bodies_hog(*sz["bodies"])}
    for name, hog in hogs.items():
        got = await beside(base_url, keys, hog, count, tokens)
        summary = got.probes.summary()
        rows[name] = {**summary, "ttft_ratio": summary["ttft_p50_ms"] / rows["idle"]["ttft_p50_ms"],
                      "itl_ratio": summary["itl_p50_ms"] / rows["idle"]["itl_p50_ms"],
                      "hog_statuses": got.hog_statuses, "ttft_ms": [1e3 * t for t in got.probes.ttft_s]}
    return rows


def _result(sz: dict[str, Any], rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    concurrency, n, max_tokens = sz["slots"]
    count, chars = sz["bodies"]
    described = {"slots": f"{concurrency} x n={n} x {max_tokens} tokens (ignore_eos)",
                 "prompt": f"one {sz['prompt']}-token completion", "bodies": f"{count} x {chars:,}-character messages"}
    targets = []
    for name, what in described.items():
        row = rows[name]
        row["hog"] = what
        targets.append(target(f"beta TTFT p50 beside alpha's {name} hog / idle", row["ttft_ratio"], "<=", 2.0,
                              f"{row['ttft_p50_ms']:.0f} ms vs {rows['idle']['ttft_p50_ms']:.0f} ms idle; {what}"))
        targets.append(target(f"beta 429s beside alpha's {name} hog", row["refused_429"], "<=", 0, what))
    return {"sizes": sz, "rows": rows, "targets": targets}
