"""Suite 1, throughput: 16 concurrent chat requests, chatcore against three transformers baselines.

Workload: a shared ~300-token system prompt, distinct ~100-token user messages (about 410
prompt tokens each), 64 greedy tokens each with EOS ignored. Every system gets one untimed
warm-up run, then `repeats` timed runs (medians reported). chatcore starts each run with a cold
prefix cache (a fresh cache scope), so any sharing it gets happens inside the batch, as for
transformers' continuous batching.

Baselines (same model, dtype and threads):
* `generate` one request at a time (in arrival order; TTFT from arrival includes the wait);
* static batched `generate`, left-padded, with transformers' static cache (preallocated, written
  in place; every request's first token comes after the whole batch's prefill);
* transformers' continuous batching `generate_batch`, page 32, block sharing on.

chatcore runs twice per repeat: with prefix sharing (the requests share one cache scope, so the
system prompt is computed once), and without (each request in a scope of its own: every system
computes the same tokens, so only the engine's own efficiency counts). The result records the
workload's shared fraction: the prompts' common prefix over their mean length.

Decode efficiency: chatcore's full-batch decode rate against one step's matmuls with the model's
weight shapes (`common.GemmChain`: every linear of the loaded model, distinct per layer, so the
weights stream from memory as in the model; the best of a few passes: the bound that matters for
a batch of 16), and, second, against a cached-weights GEMM of the decode step's shape (requests x
hidden x intermediate, from the loaded model's config).

Then 64 chats decoding and prefill in 512-token chunks are measured against the same chain at
their row counts (`bench/efficiency.py`, issue 36's targets 2 and 3); their targets are this
suite's too.
"""

from __future__ import annotations

from typing import Any

from chatcore.bench import baselines, efficiency, peers
from chatcore.bench.common import Context, GemmChain, gemm_flops, median, num_params, target
from chatcore.bench.engine_runs import chat_prompts, fresh_core, run_batch
from chatcore.bench.workload import chat_workload
from chatcore.engine.core import EngineCore
from chatcore.engine.request import SamplingParams


def sizes(ctx: Context) -> dict[str, int]:
    if ctx.tiny:
        return {"requests": 4, "system": 60, "user": 24, "new_tokens": 4, "sequential_requests": 2}
    if ctx.quick:
        return {"requests": 8, "system": 150, "user": 50, "new_tokens": 12, "sequential_requests": 2}
    return {"requests": 16, "system": 300, "user": 100, "new_tokens": 64, "sequential_requests": 16}


def summarize(runs: list[baselines.BatchRun]) -> dict[str, Any]:
    decode = [r.decode_tok_s for r in runs if r.decode_tok_s]
    return {
        "tok_s": median([r.tok_s for r in runs]),
        "tok_s_runs": [r.tok_s for r in runs],
        "wall_s": median([r.wall_s for r in runs]),
        "output_tokens": runs[0].output_tokens,
        "ttft_mean_s": median([sum(r.ttft_s) / len(r.ttft_s) for r in runs]),
        "ttft_median_s": median([median(r.ttft_s) for r in runs]),
        "ttft_max_s": median([max(r.ttft_s) for r in runs]),
        "own_ttft_mean_s": median([sum(r.own_ttft_s) / len(r.own_ttft_s) for r in runs]) if runs[0].own_ttft_s else None,
        "decode_tok_s": median(decode) if decode else None,
        "cached_tokens": runs[0].cached_tokens,
        "note": runs[0].note,
    }


def run(ctx: Context) -> dict[str, Any]:
    sz = sizes(ctx)
    tok = ctx.tokenizer
    system, users = chat_workload(tok, sz["requests"], sz["system"], sz["user"], seed=1)
    prompts = chat_prompts(tok, system, users)
    reps = ctx.repeats
    result: dict[str, Any] = {"sizes": sz, "prompt_tokens": [len(p) for p in prompts], "repeats": reps}
    core = fresh_core(ctx)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    cb_error = _warm_up(ctx, core, prompts[:2], pad)
    config = ctx.hf_model.config
    gemm_shape = [sz["requests"], config.hidden_size, config.intermediate_size]
    chain = GemmChain(ctx.loaded.model, ctx.dtype, ctx.loaded.device)  # every linear's shape, as one torch.mm each
    runs, gemms, steps = _measure(ctx, sz, core, prompts, pad, chain, gemm_shape, run_cb=cb_error is None)
    systems = _systems(runs, min(len(prompts), sz["sequential_requests"]), cb_error)
    result["systems"] = systems
    result["limit"] = _limit(ctx, sz, runs, systems, gemms, steps, gemm_shape)
    shared = len(_common_prefix(prompts))
    result["shared_fraction"] = shared / (sum(map(len, prompts)) / len(prompts))
    result["shared_prefix_tokens"] = shared
    ratio_runs = _ratio_runs(runs)
    result["ratio_runs"] = ratio_runs
    result["ratios"] = {k: median(v) if v else float("nan") for k, v in ratio_runs.items()}
    result["targets"] = _targets(runs, systems, result, len(prompts))
    result["efficiency"] = efficiency.run(ctx, core, chain)
    result["targets"] += result["efficiency"].pop("targets")
    return result


def _warm_up(ctx: Context, core: EngineCore, warm: list[list[int]], pad: int) -> str | None:
    """One short untimed run of each system (first-call costs: allocations, kernel choices); the error of
    transformers' continuous batching, if it failed (an API change must not sink the whole suite)."""
    model = ctx.hf_model
    run_batch(core, warm, SamplingParams(max_tokens=4, ignore_eos=True))
    baselines.hf_one(model, warm[0], 2)
    baselines.hf_static(model, warm, 2, pad, config=baselines.static_cache_config(model, 2, pad))
    try:
        baselines.hf_continuous(model, warm, 2)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _measure(ctx: Context, sz: dict[str, Any], core: EngineCore, prompts: list[list[int]], pad: int,
             chain: GemmChain, gemm_shape: list[int], *,
             run_cb: bool) -> tuple[dict[str, list[baselines.BatchRun]], list[float], list[float]]:
    """Every repeat of every system, interleaved so a load change on this shared machine hits all of them,
    and the ceilings right after chatcore's run: (runs per system, GEMM FLOP/s, streaming step seconds)."""
    model, new, reps = ctx.hf_model, sz["new_tokens"], ctx.repeats
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    seq_prompts = prompts[: sz["sequential_requests"]]
    runs: dict[str, list[baselines.BatchRun]] = {"chatcore": [], "chatcore_no_sharing": [], "hf_sequential": [],
                                                 "hf_static": [], "hf_generate_batch": []}
    gemms: list[float] = []
    steps: list[float] = []
    for rep in ctx.each_repeat(range(reps)):
        ctx.log(f"  repeat {rep + 1}/{reps}: chatcore, transformers generate x{len(seq_prompts)} one at a time, "
                f"static batch, generate_batch ({len(prompts)} requests x {new} tokens)")
        runs["chatcore"].append(run_batch(core, prompts, params))
        runs["chatcore_no_sharing"].append(run_batch(core, prompts, params, share=False))
        # The ceilings, right after chatcore's run: this VM's GEMM rate drifts by +-25% over minutes.
        gemms.append(gemm_flops(ctx.dtype, *gemm_shape, reps=5 if ctx.quick or ctx.tiny else 30,
                                device=ctx.loaded.device))
        steps.append(min(chain.seconds(sz["requests"], sz["requests"], reps=2 if ctx.quick or ctx.tiny else 5)))
        runs["hf_sequential"].append(baselines.hf_sequential(model, seq_prompts, new))
        runs["hf_static"].append(baselines.hf_static(model, prompts, new, pad,
                                                     config=baselines.static_cache_config(model, new, pad)))
        if run_cb:
            runs["hf_generate_batch"].append(baselines.hf_continuous(model, prompts, new))
        ctx.log("    tok/s: " + ", ".join(f"{k} {v[-1].tok_s:.1f}" for k, v in runs.items() if v))
    return runs, gemms, steps


def _systems(runs: dict[str, list[baselines.BatchRun]], sequential: int, cb_error: str | None) -> dict[str, Any]:
    """Each system's medians; `sequential`: the requests the one-at-a-time baseline ran."""
    systems: dict[str, Any] = {name: summarize(r) for name, r in runs.items() if r}
    systems["hf_sequential"]["requests"] = sequential
    if cb_error is not None:
        systems["hf_generate_batch"] = {"error": cb_error, "tok_s": float("nan")}
    systems["llama_cpp"] = {"skipped": peers.missing() or "this suite does not run llama.cpp: the single suite does "
                                                        "(one chat, on the same GGUF and threads)"}
    return systems


def _limit(ctx: Context, sz: dict[str, Any], runs: dict[str, list[baselines.BatchRun]], systems: dict[str, Any],
           gemms: list[float], steps: list[float], gemm_shape: list[int]) -> dict[str, Any]:
    """The physical limit, per repeat (decode rate / the ceilings measured right after it), then medians."""
    params_count = num_params(ctx.hf_model)
    decodes = [r.decode_tok_s or float("nan") for r in runs["chatcore"]]
    gemm = median(gemms)
    step_s = median(steps)
    decode = systems["chatcore"]["decode_tok_s"] or float("nan")
    limit = {
        "params": params_count,
        "gemm_shape": gemm_shape,
        "gemm_flops": gemm,
        "gemm_flops_runs": gemms,
        "chatcore_decode_flops": 2 * params_count * decode,
        "chatcore_decode_fraction": median([2 * params_count * d / g for d, g in zip(decodes, gemms, strict=True)]),
        "decode_ceiling_tok_s": gemm / (2 * params_count),
        # A second, physical ceiling for batched decode: all of one step's matmuls with the model's
        # weight shapes, distinct per layer, so the ~270 MB of weights stream from memory.
        "streaming_gemm_step_ms": step_s * 1e3,
        "streaming_gemm_step_ms_runs": [x * 1e3 for x in steps],
        "streaming_gemm_ceiling_tok_s": sz["requests"] / step_s,
        "chatcore_decode_fraction_of_streaming": median([d * x / sz["requests"] for d, x in zip(decodes, steps, strict=True)]),
    }
    for name in ("hf_static", "hf_generate_batch", "hf_sequential"):
        d = systems[name].get("decode_tok_s")
        if d:
            limit[f"{name}_decode_fraction"] = 2 * params_count * d / gemm
    return limit


def _ratio_runs(runs: dict[str, list[baselines.BatchRun]]) -> dict[str, list[float]]:
    """chatcore / each baseline within each repeat (throughput, and mean TTFT against static batching)."""

    def per_repeat(ours_runs: list[baselines.BatchRun], key: str) -> list[float]:
        """(chatcore / baseline) within each repeat."""
        return [a.tok_s / b.tok_s for a, b in zip(ours_runs, runs[key], strict=False)]

    ratio_runs = {f"vs_{k}": per_repeat(runs["chatcore"], k) for k in ("hf_sequential", "hf_static", "hf_generate_batch")}
    ratio_runs["no_sharing_vs_hf_static"] = per_repeat(runs["chatcore_no_sharing"], "hf_static")
    ratio_runs["ttft_vs_hf_static"] = [
        (sum(a.ttft_s) / len(a.ttft_s)) / (sum(b.ttft_s) / len(b.ttft_s))
        for a, b in zip(runs["chatcore"], runs["hf_static"], strict=True)]
    return ratio_runs


def _targets(runs: dict[str, list[baselines.BatchRun]], systems: dict[str, Any], result: dict[str, Any],
             n: int) -> list[dict[str, Any]]:
    """The suite's targets, judged on the per-repeat ratios in `result`."""
    ours = systems["chatcore"]["tok_s"]
    alone = systems["chatcore_no_sharing"]["tok_s"]
    static = systems["hf_static"]
    ratio_runs = result["ratio_runs"]
    seq_n = systems["hf_sequential"]["requests"]

    def tok_s(key: str) -> list[float]:
        return [r.tok_s for r in runs[key]]

    static_name = f"transformers static-cache batched generate, {n} chats"
    mean_ttft = [sum(r.ttft_s) / len(r.ttft_s) for r in runs["hf_static"]]
    return [
        target("throughput without sharing >= 1.3x static batched generate", result["ratios"]["no_sharing_vs_hf_static"],
               ">=", 1.3, f"chatcore without sharing {alone:.1f} tok/s vs {static_name}: {static['tok_s']:.1f} tok/s, "
               "the same tokens computed", ratio_runs["no_sharing_vs_hf_static"], baseline_runs=tok_s("hf_static")),
        target("throughput with sharing >= 2.5x static batched generate", result["ratios"]["vs_hf_static"], ">=", 2.5,
               f"chatcore {ours:.1f} tok/s vs {static_name}: {static['tok_s']:.1f} tok/s; "
               f"{result['shared_fraction']:.0%} of each prompt is shared", ratio_runs["vs_hf_static"],
               baseline_runs=tok_s("hf_static")),
        target("mean TTFT from arrival <= 0.3x static batching's", result["ratios"]["ttft_vs_hf_static"], "<=", 0.3,
               f"chatcore {systems['chatcore']['ttft_mean_s']:.2f} s vs {static_name}: {static['ttft_mean_s']:.2f} s",
               ratio_runs["ttft_vs_hf_static"], baseline_runs=mean_ttft),
        target("throughput >= 6x sequential generate", result["ratios"]["vs_hf_sequential"], ">=", 6.0,
               f"chatcore {ours:.1f} tok/s vs transformers generate one at a time, {seq_n} of the {n} chats: "
               f"{systems['hf_sequential']['tok_s']:.1f} tok/s", ratio_runs["vs_hf_sequential"],
               baseline_runs=tok_s("hf_sequential")),
        target("throughput >= 1.5x transformers generate_batch", result["ratios"]["vs_hf_generate_batch"],
               ">=", 1.5, f"chatcore {ours:.1f} tok/s vs transformers generate_batch (continuous batching, sharing), "
               f"{n} chats: {systems['hf_generate_batch'].get('tok_s', float('nan')):.1f} tok/s",
               ratio_runs["vs_hf_generate_batch"], baseline_runs=tok_s("hf_generate_batch")),
    ]


def _common_prefix(prompts: list[list[int]]) -> list[int]:
    first = prompts[0]
    length = min(len(p) for p in prompts)
    for other in prompts[1:]:
        length = next((i for i in range(length) if other[i] != first[i]), length)
    return first[:length]
