"""Suite 7, server: output tokens/s through the WebSocket API against the in-process engine.

The same 16 chats as the throughput suite (a shared ~300-token system prompt, distinct
~100-token user messages asking for detailed answers, 64 greedy tokens each, EOS ignored):
* server: a real `chatcore serve` process (same model, dtype, block size, threads) and a real
  client (`websockets`) in this process: 16 sessions opened, then 16 user frames sent at once.
  Time from the first user frame to the last `done` frame.
* engine: `InferenceEngine` in this process, 16 `generate` streams started at once, the prompts
  rendered by the same chat template.
Each repeat uses a new system prompt, made warm on both sides by one untimed request, so all
16 requests find it cached on both sides and the two measure the same work.
Overhead = 1 - server tok/s / engine tok/s: the sessions layer, SQLite, JSON and WebSocket
framing, and the client, which shares this machine's cores.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from chatcore.bench import live
from chatcore.bench.common import Context, median, target
from chatcore.bench.engine_runs import chat_prompts
from chatcore.bench.workload import chat_workload
from chatcore.engine.engine import InferenceEngine
from chatcore.engine.request import SamplingParams


def sizes(ctx: Context) -> dict[str, int]:
    if ctx.tiny:
        return {"sessions": 4, "system": 60, "user": 24, "new_tokens": 4}
    if ctx.quick:
        return {"sessions": 8, "system": 150, "user": 50, "new_tokens": 16}
    return {"sessions": 16, "system": 300, "user": 100, "new_tokens": 64}


def _workload(ctx: Context, sz: dict[str, int], rep: int) -> tuple[str, list[str]]:
    system, users = chat_workload(ctx.tokenizer, sz["sessions"], sz["system"], sz["user"], seed=1)
    return f"Conversation batch {rep}. {system}", users


async def _server_run(server: Any, system: str, users: list[str], new: int) -> dict[str, Any]:
    sessions = await asyncio.gather(*[live.connect(server, system_prompt=system) for _ in users])
    try:
        t0 = time.perf_counter()
        results = await asyncio.gather(*[s.turn(u, new, ignore_eos=True) for s, u in zip(sessions, users, strict=True)])
        wall = time.perf_counter() - t0
    finally:
        await asyncio.gather(*[s.ws.close() for s in sessions], return_exceptions=True)
    tokens = sum(r.usage["completion_tokens"] for r in results)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "ttft_ms": median([r.server_ttft_ms for r in results]),
            "client_ttft_ms": median([1e3 * r.client_ttft_s for r in results if r.client_ttft_s]),
            "cached_tokens": sum(r.usage["cached_tokens"] for r in results)}


async def _engine_run(engine: InferenceEngine, prompts: list[list[int]], new: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> Any:
        final = None
        async for out in engine.generate(engine.make_request(prompt, params)):
            if out.finished:
                final = out
        return final

    t0 = time.perf_counter()
    finals = await asyncio.gather(*[one(p) for p in prompts])
    wall = time.perf_counter() - t0
    errors = [f.error for f in finals if f is None or f.error]
    if errors:
        raise RuntimeError(f"in-process engine run failed: {errors[:2]}")
    tokens = sum(f.usage.completion_tokens for f in finals)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "ttft_ms": median([f.timings.ttft_ms for f in finals]),
            "cached_tokens": sum(f.usage.cached_tokens for f in finals)}


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"tok_s": median([r["tok_s"] for r in runs]), "wall_s": median([r["wall_s"] for r in runs]),
            "tokens": median([r["tokens"] for r in runs]), "ttft_ms": median([r["ttft_ms"] for r in runs]),
            "runs": runs}


def _start_both(ctx: Context, root: Path) -> tuple[InferenceEngine, Any]:
    """The in-process engine and a `chatcore serve` process (its data in `root`), started together."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:  # the server loads its model while this process builds its engine
        starting = pool.submit(live.start, ctx, root, kv_disk_gb=0)
        engine = InferenceEngine.launch(ctx.engine_settings(kv_cache_gb=1.0), ctx.loaded)
        try:
            return engine, starting.result()
        except Exception:
            engine.shutdown()
            raise


def run(ctx: Context) -> dict[str, Any]:
    sz = sizes(ctx)
    reps = 1 if (ctx.quick or ctx.tiny) else 5
    new = sz["new_tokens"]
    workloads = [_workload(ctx, sz, rep) for rep in range(reps + 1)]  # 0: warm-up

    root = Path(tempfile.mkdtemp(prefix="chatcore-bench-server-"))
    engine_runs: list[dict[str, Any]] = []
    server_runs: list[dict[str, Any]] = []
    engine, server = _start_both(ctx, root)
    try:
        # Repeat 0 is a short warm-up of both; then the two alternate, so load drifts hit both.
        for rep, (system, users) in enumerate(ctx.each_repeat(workloads)):
            count, tokens = (len(users), new) if rep else (2, 4)
            if rep:
                ctx.log(f"  repeat {rep}/{reps}: in-process InferenceEngine, then the WebSocket server "
                        f"({count} sessions x {tokens} tokens)")
            prompts = chat_prompts(ctx.tokenizer, system, users[:count])
            # The shared system prompt is made warm on both sides first (one untimed request with
            # it), so each side's 16 requests find it cached whatever order they arrive in.
            asyncio.run(_engine_run(engine, chat_prompts(ctx.tokenizer, system, ["Hello."]), 1))
            e = asyncio.run(_engine_run(engine, prompts, tokens))
            asyncio.run(_server_run(server, system, ["Hello."], 1))
            s = asyncio.run(_server_run(server, system, users[:count], tokens))
            if rep:
                engine_runs.append(e)
                server_runs.append(s)
    finally:
        engine.shutdown()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)

    eng, srv = _summary(engine_runs), _summary(server_runs)
    # The median over repeats of the within-repeat overhead.
    overheads = [100 * (1 - s["tok_s"] / e["tok_s"]) for e, s in zip(engine_runs, server_runs, strict=True)]
    overhead = median(overheads) / 100
    ctx.log(f"  engine {eng['tok_s']:.1f} tok/s, server {srv['tok_s']:.1f} tok/s: overhead {overhead:.1%}")
    return {
        "sizes": sz, "sessions": sz["sessions"], "repeats": reps, "engine": eng, "server": srv, "overhead": overhead,
        "targets": [target("server overhead <= 10%", overhead * 100, "<=", 10.0,
                           f"server {srv['tok_s']:.1f} tok/s vs the in-process InferenceEngine, "
                           f"{sz['sessions']} chats: {eng['tok_s']:.1f} tok/s", overheads,
                           baseline_runs=[e["tok_s"] for e in engine_runs])],
    }
