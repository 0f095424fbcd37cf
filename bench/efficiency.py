"""Issue 14's efficiency targets: the engine's model FLOP rate with 64 concurrent chats, as a
share of this CPU's GEMM rate in the run's dtype, both measured in the same run.

Workload: 64 chats shaped like the throughput suite's (a shared ~300-token system prompt,
distinct ~100-token user messages), added at once to the throughput suite's engine (warm, one
pool for both) with prefix sharing on (as a server holds them), each generating `new_tokens`
greedy tokens with EOS ignored.

Model FLOPs count what the run computed, never what it read from the prefix cache:
2 x the decoder's parameters (every weight but the input embedding and the LM head) for each
prompt token computed and each generated token fed back, and 2 x the LM head's parameters for
each token sampled (one row per request per step; earlier rows of a prefill chunk skip the
head). Attention's own FLOPs are not counted. In the decode phase (steps where all the requests
decode and no prompt runs) every token does both, so a token counts 2 x all parameters.

The ceiling is the best of a few 2048^3 GEMMs in the run's dtype, measured right after each
repeat (this VM's rate drifts by +-20% over minutes); each repeat's fraction uses its own.
"""

from __future__ import annotations

from typing import Any

from chatcore.bench.common import Context, gemm_flops, median, num_params, target
from chatcore.bench.engine_runs import chat_prompts, run_batch
from chatcore.bench.workload import chat_workload
from chatcore.engine.core import EngineCore
from chatcore.engine.request import SamplingParams

WHOLE_RUN_TARGET = 0.65
DECODE_TARGET = 0.50


def sizes(ctx: Context) -> dict[str, int]:
    if ctx.tiny:
        return {"requests": 4, "system": 60, "user": 24, "new_tokens": 4, "gemm": 256}
    if ctx.quick:
        return {"requests": 16, "system": 150, "user": 50, "new_tokens": 12, "gemm": 2048}
    return {"requests": 64, "system": 300, "user": 100, "new_tokens": 64, "gemm": 2048}


def flop_weights(model: Any) -> tuple[int, int]:
    """(parameters every computed token multiplies, LM-head parameters every sampled token multiplies)."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == embed.data_ptr()
    return num_params(model) - embed.numel() - (0 if tied else head.numel()), head.numel()


def run(ctx: Context, core: EngineCore) -> dict[str, Any]:
    """`core`: the throughput suite's engine, warm; each repeat starts in a fresh cache scope."""
    sz = sizes(ctx)
    system, users = chat_workload(ctx.tokenizer, sz["requests"], sz["system"], sz["user"], seed=3)
    prompts = chat_prompts(ctx.tokenizer, system, users)
    params = SamplingParams(max_tokens=sz["new_tokens"], ignore_eos=True)
    body, head = flop_weights(ctx.loaded.model)
    repeats: list[dict[str, float]] = []
    for _ in ctx.each_repeat(range(ctx.repeats)):
        batch = run_batch(core, prompts, params)
        ceiling = gemm_flops(ctx.dtype, sz["gemm"], sz["gemm"], sz["gemm"], reps=3 if ctx.quick or ctx.tiny else 5,
                             device=ctx.loaded.device)
        computed = sum(map(len, prompts)) - batch.cached_tokens + batch.output_tokens - len(prompts)
        flops = 2 * body * computed + 2 * head * batch.output_tokens
        decode_rate = batch.full_decode_tokens / batch.full_decode_s if batch.full_decode_s else float("nan")
        repeats.append({
            "wall_s": batch.wall_s, "output_tokens": batch.output_tokens, "cached_tokens": batch.cached_tokens,
            "computed_tokens": computed, "model_flops": flops, "ceiling_flops": ceiling,
            "whole_run_fraction": flops / batch.wall_s / ceiling,
            "full_decode_tokens": batch.full_decode_tokens, "full_decode_tok_s": decode_rate,
            "decode_fraction": 2 * (body + head) * decode_rate / ceiling,
            "ttft_mean_s": sum(batch.ttft_s) / len(batch.ttft_s),
        })
        ctx.log(f"  {len(prompts)} chats: {flops / batch.wall_s / 1e9:.1f} GFLOP/s over the run "
                f"({computed} tokens computed, {batch.cached_tokens} from the cache), decode with all running "
                f"{decode_rate:.1f} tok/s; GEMM ceiling {ceiling / 1e9:.1f} GFLOP/s")
    whole = [r["whole_run_fraction"] for r in repeats]
    decode = [r["decode_fraction"] for r in repeats]
    summary = {key: median([r[key] for r in repeats]) for key in repeats[0]}
    ceilings = [r["ceiling_flops"] / 1e9 for r in repeats]  # the baseline, GFLOP/s, measured after each repeat
    ceiling_name = f"the GEMM ceiling ({sz['gemm']}^3 torch.mm, {str(ctx.dtype).removeprefix('torch.')})"
    return {
        "sizes": sz, "repeats": repeats, "summary": summary,
        "flop_weights": {"decoder": body, "lm_head": head},
        "targets": [
            target(f"{len(prompts)} concurrent chats: model FLOP rate >= {WHOLE_RUN_TARGET:.0%} of the GEMM ceiling",
                   median(whole), ">=", WHOLE_RUN_TARGET,
                   f"{summary['model_flops'] / summary['wall_s'] / 1e9:.1f} GFLOP/s vs {ceiling_name}: "
                   f"{summary['ceiling_flops'] / 1e9:.1f} GFLOP/s; {summary['computed_tokens']:.0f} tokens computed",
                   whole, baseline_runs=ceilings),
            target(f"decode with all {len(prompts)} running: output tokens x 2 x parameters >= "
                   f"{DECODE_TARGET:.0%} of the GEMM ceiling", median(decode), ">=", DECODE_TARGET,
                   f"{summary['full_decode_tok_s']:.1f} tok/s = "
                   f"{2 * (body + head) * summary['full_decode_tok_s'] / 1e9:.1f} GFLOP/s vs {ceiling_name}: "
                   f"{summary['ceiling_flops'] / 1e9:.1f} GFLOP/s", decode, baseline_runs=ceilings),
        ],
    }
