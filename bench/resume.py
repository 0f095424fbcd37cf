"""Suite 6, resume: TTFT of the first turn after a server restart, disk tier against recompute.

Real `chatcore serve` processes sharing one data directory (one SQLite database, one kv dir):
1. Server A (disk tier on, CHATCORE_KV_DISK_GB=2) builds the histories: for each target length
   (500, 1,000, 2,000 tokens) and each repeat, two sessions (one per mode), each with its own
   system prompt (so no two sessions share a block), grown turn by turn with long user
   messages and short greedy answers until the history reaches the target. The disk tier
   writes every turn's full blocks in the background; A is stopped with SIGTERM, which waits
   for those writes, and the kv dir is checked for block files.
2. Server B (disk tier on, the same data directory) and server C (disk tier off,
   CHATCORE_KV_DISK_GB=0, a copy of the database and no kv dir) start with empty KV pools.
   After one warm-up turn each in an unrelated session (first-forward costs are not the disk
   tier's), they take turns resuming sessions one at a time, B the disk-mode ones and C the
   recompute ones (whose whole history is prefilled again): hello with the session id and
   resume token, then a short new turn.
TTFT is the server's `done.timing.ttft_ms` (the engine's arrival-to-first-token, including the
disk read); `done.usage.cached_disk_tokens` shows what came from disk. The client-side TTFT
(user frame sent to first token frame) is recorded too.

Right after each disk-tier resume, transformers' cold prefill of a prompt of the same length (the
resumed turn's `prompt_tokens`, natural text) runs in this process: one forward into a fresh
static cache, batch 1, then the first token (`baselines.hf_cold_ttft`). Reported beside the target:
resume TTFT / that cold TTFT, so the disk tier is measured against transformers too, not only
against chatcore's own recompute.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

from chatcore.bench import baselines, live
from chatcore.bench.common import Context, median, reported, target
from chatcore.bench.sessions import cold_message
from chatcore.bench.workload import text_of_tokens
from chatcore.sessions.template import ChatTemplate

ANSWER_TOKENS = 16


def sizes(ctx: Context) -> dict[str, Any]:
    if ctx.tiny:
        return {"lengths": [160], "repeats": 1, "user_tokens": 60}
    if ctx.quick:
        return {"lengths": [600], "repeats": 1, "user_tokens": 600}
    return {"lengths": [500, 1000, 2000], "repeats": 3, "user_tokens": 300}


async def _build(server: Any, tok: Any, system: str, length: int, user_tokens: int, rng: random.Random) -> dict:
    """A session whose history reaches about `length` tokens."""
    session = await live.connect(server, system_prompt=system)
    history = 0
    try:
        while True:
            remaining = length - history
            if remaining <= 40:
                break
            size = max(20, min(user_tokens, remaining - 30))
            content = text_of_tokens(tok, rng, size)
            result = await session.turn(content, ANSWER_TOKENS)
            usage = result.usage
            history = usage["prompt_tokens"] + usage["completion_tokens"] + 1
    finally:
        await session.ws.close()
    return {"session_id": session.session_id, "resume_token": session.resume_token, "history_tokens": history}


async def _resume(server: Any, built: dict, content: str) -> dict:
    session = await live.connect(server, session_id=built["session_id"], resume_token=built["resume_token"])
    try:
        result = await session.turn(content, 4)
    finally:
        await session.ws.close()
    return {"ttft_ms": result.server_ttft_ms, "client_ttft_ms": 1e3 * result.client_ttft_s if result.client_ttft_s else None,
            "prompt_tokens": result.usage["prompt_tokens"], "cached_tokens": result.usage["cached_tokens"],
            "cached_disk_tokens": result.usage.get("cached_disk_tokens", 0),
            "recomputed_tokens": result.usage.get("recomputed_tokens")}


def _hf_cold(ctx: Context, template: ChatTemplate, length: int, prefix: str) -> dict[str, Any]:
    """transformers' cold TTFT for a first-turn prompt of `length` tokens (or within a token or two)."""
    prompt = template.first_turn(None, cold_message(template, ctx.tokenizer, length, prefix))
    return {"prompt_tokens": len(prompt), "ttft_ms": 1e3 * baselines.hf_cold_ttft(ctx.hf_model, prompt)[1]}


async def _warm(server: Any, tok: Any) -> None:
    session = await live.connect(server, system_prompt="Warm-up session.")
    try:
        await session.turn(text_of_tokens(tok, random.Random(99), 200), 2)
    finally:
        await session.ws.close()


def run(ctx: Context) -> dict[str, Any]:
    sz = sizes(ctx)
    tok = ctx.tokenizer
    root = Path(tempfile.mkdtemp(prefix="chatcore-bench-resume-"))
    template = ChatTemplate(tok, ctx.loaded.stop_token_ids)
    _hf_cold(ctx, template, 200, "Warm-up.")  # untimed: first-forward costs (allocations, kernel choices)
    try:
        plan = [(length, rep, mode) for length in sz["lengths"] for rep in range(sz["repeats"])
                for mode in ("disk", "recompute")]
        built, files = _build_all(ctx, root, plan, sz["user_tokens"])
        resumed, hf_cold = _resume_all(ctx, root, plan, built, template)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rows = [_row(ctx, length, resumed, hf_cold) for length in sz["lengths"]]
    return _result(sz, rows, files)


def _build_all(ctx: Context, root: Path, plan: list[tuple[int, int, str]],
               user_tokens: int) -> tuple[list[dict], int]:
    """Server A builds every planned session, writing through to the disk tier in `root`: (the sessions,
    the block files written)."""
    tok = ctx.tokenizer
    ctx.log(f"  server A: building {len(plan)} sessions")
    server = live.start(ctx, root, kv_disk_gb=2)
    try:
        async def build_all() -> list[dict]:
            jobs = [_build(server, tok, f"Session {i}: you are assistant number {i} of a study on caching.",
                           length, user_tokens, random.Random(1000 + i)) for i, (length, _, _) in enumerate(plan)]
            return await asyncio.gather(*jobs)

        built = asyncio.run(build_all())
    finally:
        server.stop()
    kv_dir = root / "kv"
    files = sum(1 for _ in kv_dir.rglob("*.kvb")) if kv_dir.exists() else 0
    if files == 0:
        raise RuntimeError("the disk tier wrote no block files before the restart")
    return built, files


def _resume_all(ctx: Context, root: Path, plan: list[tuple[int, int, str]], built: list[dict],
                template: ChatTemplate) -> tuple[dict[str, list[tuple[int, dict]]], list[tuple[int, dict]]]:
    """Each built session's next turn after the restart, per mode; and transformers' cold prefill at
    each disk resume's length, right after it."""
    tok = ctx.tokenizer
    rng = random.Random(11)
    hf_cold: list[tuple[int, dict]] = []
    # B resumes from the disk tier; C gets a copy of the database only (no kv dir) and the disk
    # tier off. Both run at once and take turns, so a load change hits both modes alike.
    root_c = Path(tempfile.mkdtemp(prefix="chatcore-bench-resume-c-"))
    for db in root.glob("chatcore.db*"):
        shutil.copy(db, root_c / db.name)
    resumed: dict[str, list[tuple[int, dict]]] = {"disk": [], "recompute": []}
    ctx.log("  servers B (disk tier) and C (recompute): resuming, alternately")
    servers: dict[str, Any] = {}
    try:
        servers.update(live.start_many(ctx, {"disk": (root, {"kv_disk_gb": 2}),
                                             "recompute": (root_c, {"kv_disk_gb": 0})}))
        for server in servers.values():
            asyncio.run(_warm(server, tok))
        for (length, _, mode), b in zip(plan, built, strict=True):
            content = text_of_tokens(tok, rng, 20, prefix="One more question:")
            r = asyncio.run(_resume(servers[mode], b, content))
            r["history_tokens"] = b["history_tokens"]
            resumed[mode].append((length, r))
            if mode == "disk":  # transformers' cold prefill at the same length, right after
                hf_cold.append((length, _hf_cold(ctx, template, r["prompt_tokens"],
                                                 f"Cold prompt {len(hf_cold)} of {r['prompt_tokens']} tokens:")))
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(root_c, ignore_errors=True)
    return resumed, hf_cold


def _row(ctx: Context, length: int, resumed: dict[str, list[tuple[int, dict]]],
         hf_cold: list[tuple[int, dict]]) -> dict[str, Any]:
    """The medians at one history length, logged."""
    disk = [r for n, r in resumed["disk"] if n == length]
    rec = [r for n, r in resumed["recompute"] if n == length]
    hf = [r for n, r in hf_cold if n == length]
    row = {
        "target_tokens": length,
        "history_tokens": median([r["prompt_tokens"] for r in disk + rec]),
        "disk_ttft_ms": median([r["ttft_ms"] for r in disk]),
        "disk_client_ttft_ms": median([r["client_ttft_ms"] for r in disk if r["client_ttft_ms"]]),
        "disk_cached_disk_tokens": median([r["cached_disk_tokens"] for r in disk]),
        "recompute_ttft_ms": median([r["ttft_ms"] for r in rec]),
        "recompute_client_ttft_ms": median([r["client_ttft_ms"] for r in rec if r["client_ttft_ms"]]),
        "recompute_cached_tokens": median([r["cached_tokens"] for r in rec]),
        "hf_cold_ttft_ms": median([r["ttft_ms"] for r in hf]),
        "hf_cold_prompt_tokens": median([r["prompt_tokens"] for r in hf]),
        "runs": {"disk": disk, "recompute": rec, "hf_cold": hf},
    }
    row["ratio"] = row["disk_ttft_ms"] / row["recompute_ttft_ms"]
    row["ratio_vs_hf_cold"] = row["disk_ttft_ms"] / row["hf_cold_ttft_ms"]
    ctx.log(f"  {row['history_tokens']:.0f} tokens: disk {row['disk_ttft_ms']:.0f} ms "
            f"({row['disk_cached_disk_tokens']:.0f} from disk) vs recompute {row['recompute_ttft_ms']:.0f} ms, "
            f"transformers cold {row['hf_cold_ttft_ms']:.0f} ms")
    return row


def _result(sz: dict[str, Any], rows: list[dict[str, Any]], files: int) -> dict[str, Any]:
    """The suite's result: the longest history's resume against recompute (its target) and transformers."""
    last = rows[-1]
    recompute = [r["ttft_ms"] for r in last["runs"]["recompute"]]
    hf = [r["ttft_ms"] for r in last["runs"]["hf_cold"]]
    return {
        "sizes": sz, "rows": rows, "kv_files_after_build": files,
        "targets": [
            target(f"resume TTFT <= 0.3x recompute at {last['target_tokens']} tokens", last["ratio"], "<=", 0.3,
                   f"{last['disk_ttft_ms']:.0f} ms, {last['disk_cached_disk_tokens']:.0f} of "
                   f"{last['history_tokens']:.0f} tokens from disk, vs recompute (a server without the disk tier "
                   f"prefills the whole history): {last['recompute_ttft_ms']:.0f} ms", baseline_runs=recompute),
            reported(f"resume TTFT / transformers cold prefill at {last['target_tokens']} tokens",
                     last["ratio_vs_hf_cold"],
                     f"{last['disk_ttft_ms']:.0f} ms vs transformers' cold prefill, static cache, batch 1, "
                     f"{last['hf_cold_prompt_tokens']:.0f} prompt tokens: {last['hf_cold_ttft_ms']:.0f} ms "
                     f"(repeats: {', '.join(f'{v:.0f}' for v in hf)} ms)"),
        ],
    }
