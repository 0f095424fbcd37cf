"""Suite 8, sessions: many conversations taking turns round-robin over a real server.

Each run starts a fresh `chatcore serve` (its own data directory: database and disk tier) and
opens N WebSocket sessions, kept open across turns. The sessions have no system prompt (all
share the template's default one) and take T turns each, round-robin and one turn at a time:
turn 1 of every session, then turn 2 of every session, and so on. A turn is a ~90-token user
message (seeded English-like text) answered with 8 greedy tokens, EOS ignored, so each
history grows by ~100 tokens a turn. Per turn: the median and p90 of the server's TTFT
(`done.timing.ttft_ms`) and the mean prompt, device-cached, disk-cached and recomputed tokens.

Hot TTFT, the targets' baseline (issue 36, target 5), on the same server before and after the
trace (each time after the cold probes below): three fresh sessions that take all T turns back
to back, with messages and answers of the trace's sizes, so each turn finds its session's
history pinned in the device pool (nothing else runs between their turns); their final turns' median TTFT is "hot", the same turn
with unlimited memory. Each probe's final turn is checked to have been served from the device
pool (`cached_device_tokens` at least its history less a block, nothing from disk); when one was
not, the baseline is not hot and the targets against it are inconclusive. The probe sessions are
deleted after their turns, so their pins and disk-tier entries leave the trace's tiers alone.
Cold TTFT, also before and after the trace: three fresh sessions each time whose first prompt has
the final turn's token count (unique text: only the shared template prefix can hit). Right after
each set of cold probes, transformers' cold prefill of the same prompts runs in this process (one
forward into a fresh static cache, batch 1, then the first token: `baselines.hf_cold_ttft`).
Every ratio uses the faster of a baseline's two medians (after a long trace the cold probes ran up
to 1.5x slower, which would flatter a ratio); the two medians are the baseline's repeats, and a
target whose baseline moved by more than 20% between them is inconclusive (`common.target`).

Targets: each default-tier run's final-turn median TTFT <= 1.25x hot (the tiers may lose at most a
quarter against unlimited memory); on `overflow`, the final turns served from the disk tier
(`cached_disk_tokens` > 0), median TTFT <= 1.6x hot, and the replay target below. Reported, no
verdict: every run's final turn over cold and over transformers' cold prefill, and overflow's final
turn over hot.

Runs: the given session counts (default 64 and 256; --quick none unless `--sessions` names
some) on the given tier sizes (default: the server's own), and `overflow`: 32 sessions (--quick
6 sessions x 3 turns of 60-token messages, 4-token answers) on tiny tiers, sized from
the model's KV bytes per token so that the final turn's working set is `OVERFLOW` x the device
pool plus the disk budget, the device pool being 1/9 of the two (at least two final-turn
histories). Each run's token trace is also replayed offline (`bench.replay`) at one cache of the
device pool's size (overflow: device plus disk blocks) under LRU, the pool's cost and session
policies, Belady's optimum, and a one-cache-per-slot server.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chatcore.bench import baselines, live
from chatcore.bench.common import Context, median, quantile, reported, target
from chatcore.bench.replay import Request, replay
from chatcore.bench.workload import TOKEN_HI, TOKEN_LO, text_of_tokens
from chatcore.engine.pool_sizing import depth_cost, kv_storage_dtype
from chatcore.sessions.template import ChatTemplate

OVERFLOW = 1.5
DEVICE_SHARE = 1 / 9  # of device + disk in the overflow run
COLD_PROBES = HOT_PROBES = 3
HOT_TARGET = 1.25  # final-turn median TTFT over hot, on default tiers
DISK_TARGET, BELADY_TARGET = 1.6, 0.8  # overflow: disk-served final turns over hot; replay vs Belady


@dataclass
class Plan:
    name: str
    sessions: int
    turns: int
    tiers: dict[str, Any]  # CHATCORE_* settings for the server (none: its defaults)
    overflow: bool = False
    sizing: dict[str, Any] = field(default_factory=dict)


def sizes(ctx: Context) -> dict[str, Any]:
    opts = ctx.options
    if ctx.tiny:
        base = {"sessions": [3], "turns": 3, "overflow_sessions": 6, "user_tokens": 16, "answer_tokens": 4}
    elif ctx.quick:
        base = {"sessions": [], "turns": 3, "overflow_sessions": 6, "user_tokens": 60, "answer_tokens": 4}
    else:
        base = {"sessions": [64, 256], "turns": 10, "overflow_sessions": 32, "user_tokens": 90, "answer_tokens": 8}
    if opts.get("sessions"):
        base["sessions"] = [int(n) for n in str(opts["sessions"]).split(",")]
    if opts.get("turns"):
        base["turns"] = int(opts["turns"])
    return base


def kv_bytes_per_token(ctx: Context) -> int:
    """Layers x 2 (K and V) x KV heads x head dim x the KV dtype's size, from the loaded model."""
    loaded = ctx.loaded
    dtype = kv_storage_dtype(ctx.settings, loaded)
    return loaded.num_layers * 2 * loaded.num_kv_heads * loaded.head_dim * torch.empty((), dtype=dtype).element_size()


def messages(tok: Any, sessions: int, turns: int, user_tokens: int, seed: int,
             label: str = "Session") -> list[list[str]]:
    """messages[s][t]: session s's user message at turn t."""
    out = []
    for s in range(sessions):
        rng = random.Random(seed * 100_003 + s)
        out.append([text_of_tokens(tok, rng, user_tokens, prefix=f"{label} {s}, turn {t + 1}:") for t in range(turns)])
    return out


def token_trace(template: ChatTemplate, msgs: list[list[str]], answer_tokens: int, seed: int) -> list[Request]:
    """The prompts the server builds for `msgs` round-robin; answers are seeded stand-in ids."""
    rng = random.Random(seed)
    eot = tuple(template.close_answer([]))
    histories: list[tuple[int, ...]] = [()] * len(msgs)
    trace = []
    for turn in range(len(msgs[0])):
        for s, session in enumerate(msgs):
            if turn == 0:
                prompt = tuple(template.first_turn(None, session[0]))
            else:
                delta = template.next_turn([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}],
                                           session[turn])
                if delta.rerendered:
                    raise RuntimeError("the chat template is not prefix-stable: the replay cannot follow the server")
                prompt = histories[s] + tuple(delta.tokens)
            generated = tuple(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(answer_tokens))
            trace.append(Request(s, turn, prompt, generated, eot))
            histories[s] = trace[-1].history
    return trace


def overflow_tiers(trace: list[Request], block_size: int, per_token: int) -> dict[str, Any]:
    """Device pool and disk budget whose sum is the final working set / OVERFLOW."""
    final = {r.session: len(r.history) for r in trace}
    working = sum(n // block_size for n in final.values())
    combined = round(working / OVERFLOW)
    device = max(round(combined * DEVICE_SHARE), 2 * -(-max(final.values()) // block_size))
    disk = max(1, combined - device)
    block_bytes = per_token * block_size
    return {"working_set_blocks": working, "device_blocks": device, "disk_blocks": disk,
            "disk_bytes": disk * block_bytes, "block_bytes": block_bytes,
            "working_set_over_tiers": working / (device + disk)}


def plans(ctx: Context, sz: dict[str, Any], overflow_trace: list[Request], per_token: int) -> list[Plan]:
    opts = ctx.options
    tiers = {"kv_cache_gb": opts.get("kv_cache_gb"), "kv_disk_gb": opts.get("kv_disk_gb")}
    out = [Plan(f"{n}x{sz['turns']}", n, sz["turns"], tiers) for n in sz["sessions"]]
    sizing = overflow_tiers(overflow_trace, ctx.settings.block_size, per_token)
    out.append(Plan("overflow", sz["overflow_sessions"], sz["turns"],
                    {"num_blocks": sizing["device_blocks"], "kv_cache_gb": None,
                     "kv_disk_gb": sizing["disk_bytes"] / (1 << 30)}, overflow=True, sizing=sizing))
    return out


async def _trace_run(server: live.Server, msgs: list[list[str]], answer: int, log: Any, name: str) -> list[list[dict]]:
    sessions: list[live.ClientSession] = []
    try:
        for _ in msgs:
            sessions.append(await live.connect(server))
        rows = []
        for turn in range(len(msgs[0])):
            rows.append([_record(await s.turn(m[turn], answer, ignore_eos=True)) for s, m in zip(sessions, msgs, strict=True)])
            log(f"  {name} turn {turn + 1}: median TTFT {median([r['ttft_ms'] for r in rows[-1]]):.0f} ms, "
                f"cached {median([r['cached_tokens'] for r in rows[-1]]):.0f} of "
                f"{median([r['prompt_tokens'] for r in rows[-1]]):.0f} (median)")
        return rows
    finally:
        await asyncio.gather(*(s.ws.close() for s in sessions), return_exceptions=True)


async def _hot_run(server: live.Server, msgs: list[list[str]], answer: int) -> list[list[dict[str, Any]]]:
    """Each probe session takes all its turns back to back, alone on the server, then is deleted;
    a turn's `history_tokens` is the previous turn's prompt and answer, what its pin holds."""
    out = []
    for texts in msgs:
        session = await live.connect(server)
        try:
            turns: list[dict[str, Any]] = []
            for text in texts:
                record = _record(await session.turn(text, answer, ignore_eos=True))
                record["history_tokens"] = turns[-1]["prompt_tokens"] + answer if turns else 0
                turns.append(record)
            out.append(turns)
        finally:
            await session.ws.close()
        await asyncio.to_thread(live.delete_session, server, session.session_id)
    return out


def _record(result: live.TurnResult) -> dict[str, Any]:
    u = result.usage
    return {"ttft_ms": result.server_ttft_ms, "prompt_tokens": u["prompt_tokens"], "cached_tokens": u["cached_tokens"],
            "cached_device_tokens": u["cached_device_tokens"], "cached_disk_tokens": u["cached_disk_tokens"],
            "recomputed_tokens": u["recomputed_tokens"]}


def cold_message(template: ChatTemplate, tok: Any, length: int, prefix: str) -> str:
    """A first message whose prompt (default system prompt included) is `length` tokens, or close."""
    size = length - len(template.first_turn(None, prefix))
    for _ in range(6):
        text = text_of_tokens(tok, random.Random(prefix), max(1, size), prefix=prefix)
        got = len(template.first_turn(None, text))
        if got == length:
            break
        size += length - got
    return text


async def _cold_run(server: live.Server, texts: list[str]) -> list[dict[str, Any]]:
    out = []
    for text in texts:
        session = await live.connect(server)
        try:
            out.append(_record(await session.turn(text, 1, ignore_eos=True)))
        finally:
            await session.ws.close()
    return out


def _faster(probes: list[dict[str, Any]]) -> dict[str, Any]:
    """Probes before the trace, then as many after it: both medians, and the faster one."""
    half = len(probes) // 2
    before = median([c["ttft_ms"] for c in probes[:half]])
    after = median([c["ttft_ms"] for c in probes[half:]])
    return {"ttft_ms": min(before, after), "before_ms": before, "after_ms": after, "probes": probes}


def _hot(sessions: list[list[dict[str, Any]]], block_size: int) -> dict[str, Any]:
    """The hot baseline from the probe sessions (before the trace, then after it): their final turns,
    each checked to have been served from the device pool (its pin: the history less at most a
    block, the answer's last token having no KV yet)."""
    finals = [turns[-1] for turns in sessions]
    for f in finals:
        f["served_hot"] = f["cached_disk_tokens"] == 0 and f["cached_device_tokens"] >= f["history_tokens"] - block_size
    return {**_faster(finals), "served_hot": sum(f["served_hot"] for f in finals), "sessions": sessions}


def _summary(rows: list[list[dict]], hot: dict[str, Any], cold: list[dict[str, Any]],
             hf_cold: list[dict[str, Any]]) -> dict[str, Any]:
    """`hot`: the hot baseline (`_hot`); `cold`: the cold probes before the trace, then those after it;
    `hf_cold`: transformers' cold prefill of the same prompts, in the same order. The ratios use the
    faster of each baseline's two medians, so a server slowed by what the trace left behind never
    flatters them."""
    per_turn = []
    for turn, row in enumerate(rows, 1):
        ttft = [r["ttft_ms"] for r in row]
        per_turn.append({"turn": turn, "ttft_median_ms": median(ttft), "ttft_p90_ms": quantile(ttft, 0.9),
                         **{f"mean_{k}": sum(r[k] for r in row) / len(row)
                            for k in ("prompt_tokens", "cached_device_tokens", "cached_disk_tokens", "recomputed_tokens")}})
    final = per_turn[-1]["ttft_median_ms"]
    cold_ms = _faster(cold)["ttft_ms"]
    hf = _faster(hf_cold)
    disk = median([r["ttft_ms"] for r in rows[-1] if r["cached_disk_tokens"] > 0])
    return {"per_turn": per_turn, "hot": hot, "cold": _faster(cold), "hf_cold": hf,
            "final_over_hot": final / hot["ttft_ms"], "final_over_cold": final / cold_ms,
            "final_over_hf_cold": final / hf["ttft_ms"],
            "disk_final": {"turns": sum(r["cached_disk_tokens"] > 0 for r in rows[-1]), "ttft_median_ms": disk,
                           "over_hot": disk / hot["ttft_ms"], "over_cold": disk / cold_ms}}


def run_plan(ctx: Context, plan: Plan, server: live.Server, msgs: list[list[str]], trace: list[Request],
             template: ChatTemplate, user_tokens: int, answer_tokens: int) -> dict[str, Any]:
    info = live.admin_cache(server)
    final = round(median([len(r.prompt) for r in trace if r.turn == plan.turns - 1]))
    hf: list[dict[str, Any]] = []

    hot: list[list[dict[str, Any]]] = []

    def probes(when: str) -> list[dict[str, Any]]:
        texts = [cold_message(template, ctx.tokenizer, final, f"Cold probe {i} {when} run {plan.name}:")
                 for i in range(COLD_PROBES)]
        served = asyncio.run(_cold_run(server, texts))
        for text in texts:  # transformers' cold prefill of the same prompts, right after (the server idles)
            prompt = template.first_turn(None, text)
            hf.append({"prompt_tokens": len(prompt), "ttft_ms": 1e3 * baselines.hf_cold_ttft(ctx.hf_model, prompt)[1]})
        hot.extend(asyncio.run(_hot_run(server, messages(ctx.tokenizer, HOT_PROBES, plan.turns, user_tokens, 0,
                                                         f"Hot probe ({when} run {plan.name})"), answer_tokens)))
        return served

    fresh = probes("before")  # the server as it starts: no trace has touched its memory yet
    rows = asyncio.run(_trace_run(server, msgs, answer_tokens, ctx.log, plan.name))
    bs = ctx.settings.block_size
    disk_tier = (info.get("tiers") or {}).get("disk")
    cold = fresh + probes("after")
    result = {"sessions": plan.sessions, "turns": plan.turns, "server_tiers": info.get("tiers"),
              "device_blocks": info["audit"]["total"], "disk_blocks": disk_tier["tokens"] // bs if disk_tier else 0,
              "settings": plan.tiers, **plan.sizing, **_summary(rows, _hot(hot, bs), cold, hf)}
    blocks = plan.sizing["device_blocks"] + plan.sizing["disk_blocks"] if plan.overflow else result["device_blocks"]
    result["replay"] = replay(trace, blocks, bs, depth_cost(ctx.loaded, bs))
    result["replay"]["prompt_tokens_live"] = sum(r["prompt_tokens"] for row in rows for r in row)
    ctx.log(f"  {plan.name}: final turn {result['per_turn'][-1]['ttft_median_ms']:.0f} ms vs hot "
            f"{result['hot']['ttft_ms']:.0f} ms ({result['final_over_hot']:.2f}x; {result['hot']['served_hot']} of "
            f"{len(result['hot']['probes'])} probes served hot), cold "
            f"{result['cold']['ttft_ms']:.0f} ms ({result['final_over_cold']:.2f}x), transformers cold "
            f"{result['hf_cold']['ttft_ms']:.0f} ms ({result['final_over_hf_cold']:.2f}x); replay hit rates " +
            ", ".join(f"{p} {v['hit_rate']:.1%}" for p, v in result["replay"]["policies"].items()))
    return result


def _vs(r: dict[str, Any], what: str, base: dict[str, Any], system: str) -> str:
    """A target's detail: `what` against the faster of a baseline's medians before and after the trace."""
    tokens = r["per_turn"][-1]["mean_prompt_tokens"]
    return (f"{what} vs {system}, prompts of the final turn's length ({tokens:.0f} tokens), the faster of the "
            f"medians before and after the trace: {base['ttft_ms']:.0f} ms (before {base['before_ms']:.0f}, after "
            f"{base['after_ms']:.0f})")


def _hot_system(r: dict[str, Any]) -> str:
    hot = r["hot"]
    return (f"hot TTFT on the same server (the final turn of {len(hot['probes']) // 2} probe sessions taking all "
            f"{r['turns']} turns back to back, their history pinned in the device pool; {hot['served_hot']} of "
            f"{len(hot['probes'])} served from it)")


def _against_hot(t: dict[str, Any], hot: dict[str, Any]) -> dict[str, Any]:
    """`t` (against hot), inconclusive when a probe's final turn was not served from the device pool:
    then the baseline was not hot."""
    if hot["served_hot"] < len(hot["probes"]) and t["verdict"] != "reported":
        t.update(verdict="inconclusive", met=False,
                 detail=f"{t['detail']}; a hot probe's final turn missed the device pool: not a hot baseline, "
                        "inconclusive")
    return t


def _run_figures(name: str, r: dict[str, Any], label: str, limit: float | None) -> list[dict[str, Any]]:
    """A run's final-turn median TTFT over hot, a target when `limit` is given (its baseline's two
    repeats: the hot probes' medians before and after the trace), and over the server's cold TTFT
    and transformers' cold prefill of the same prompts, reported."""
    what = f"{r['per_turn'][-1]['ttft_median_ms']:.0f} ms"
    hot = r["hot"]
    vs_hot = _vs(r, what, hot, _hot_system(r))
    if limit is None:
        over_hot = reported(f"{label}: final-turn median TTFT / hot", r["final_over_hot"], vs_hot)
    else:
        over_hot = _against_hot(target(f"{label}: final-turn median TTFT <= {limit}x hot", r["final_over_hot"], "<=",
                                       limit, vs_hot, baseline_runs=[hot["before_ms"], hot["after_ms"]]), hot)
    return [over_hot,
            reported(f"{name}: final-turn median TTFT / cold", r["final_over_cold"],
                     _vs(r, what, r["cold"], "cold TTFT on the same server (fresh sessions)")),
            reported(f"{name}: final-turn median TTFT / transformers cold prefill", r["final_over_hf_cold"],
                     _vs(r, what, r["hf_cold"], "transformers' cold prefill (static cache, batch 1) of the server's "
                                                "cold probe prompts"))]


def _targets(runs: dict[str, dict[str, Any]], policy: str) -> list[dict[str, Any]]:
    """The issue's targets; the replay one is for the servers' eviction policy."""
    out = []
    for name, r in runs.items():
        if name != "overflow":
            out += _run_figures(name, r, name, HOT_TARGET)
    o = runs["overflow"]
    hot, disk = o["hot"], o["disk_final"]
    out += _run_figures("overflow", o, f"overflow ({o['working_set_over_tiers']:.2f}x the tiers)", None)
    out.append(_against_hot(target(
        f"overflow: final turns from the disk tier, median TTFT <= {DISK_TARGET}x hot", disk["over_hot"], "<=",
        DISK_TARGET, _vs(o, f"{disk['turns']} of {o['sessions']} final turns had disk hits, median "
                            f"{disk['ttft_median_ms']:.0f} ms", hot, _hot_system(o)),
        baseline_runs=[hot["before_ms"], hot["after_ms"]]), hot))
    policies = o["replay"]["policies"]
    out.append(target(f"overflow replay: {policy} policy hit rate >= {BELADY_TARGET:.0%} of Belady's",
                      policies[policy]["of_belady"], ">=", BELADY_TARGET,
                      f"{policy} {policies[policy]['hit_rate']:.1%} vs Belady's optimum on the same trace and cache: "
                      f"{policies['belady']['hit_rate']:.1%} (lru {policies['lru']['hit_rate']:.1%}, "
                      f"one slot {policies['one_slot']['hit_rate']:.1%}); a deterministic replay (no repeats: there is "
                      "no timing to move)"))
    return out


def run(ctx: Context) -> dict[str, Any]:
    sz = sizes(ctx)
    template = ChatTemplate(ctx.tokenizer, ctx.loaded.stop_token_ids)
    baselines.hf_cold_ttft(ctx.hf_model, template.first_turn(None, "Warm-up."))  # untimed: first-forward costs
    per_token = kv_bytes_per_token(ctx)
    work: dict[int, tuple[list[list[str]], list[Request]]] = {}
    for seed, n in enumerate(sorted({*sz["sessions"], sz["overflow_sessions"]}), 1):
        msgs = messages(ctx.tokenizer, n, sz["turns"], sz["user_tokens"], seed)
        work[n] = msgs, token_trace(template, msgs, sz["answer_tokens"], seed)
    runs: dict[str, dict[str, Any]] = {}
    for plan in plans(ctx, sz, work[sz["overflow_sessions"]][1], per_token):
        root = Path(tempfile.mkdtemp(prefix=f"chatcore-bench-sessions-{plan.name}-"))
        ctx.log(f"  {plan.name}: {plan.sessions} sessions x {plan.turns} turns, tiers {plan.tiers}")
        try:
            server = live.start(ctx, root, **plan.tiers)
            try:
                runs[plan.name] = run_plan(ctx, plan, server, *work[plan.sessions], template, sz["user_tokens"],
                                          sz["answer_tokens"])
            finally:
                server.stop()
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return {"sizes": sz, "kv_bytes_per_token": per_token, "block_size": ctx.settings.block_size, "runs": runs,
            "targets": _targets(runs, ctx.settings.eviction_policy)}
