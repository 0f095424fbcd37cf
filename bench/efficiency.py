"""Issue 36's targets 2 and 3: the engine's decode step and prefill chunk against the GEMM chain
of the same shape, both measured in the same run.

The baseline, `common.GemmChain`: every linear of the loaded model (each decoder layer's q, k, v,
o, gate, up and down projections for SmolLM2, whatever `nn.Linear`s another architecture has) as
one `torch.mm` with its shapes, in the run's dtype, weights distinct per layer and stored [in, out]
contiguous; then the LM head once, at the rows the engine samples. It is measured right after each
repeat (the median of a few passes; this VM's rate drifts by +-20% over minutes) and judged for
moving between repeats like every suite's baseline.

Decode (target 2): 64 chats shaped like the throughput suite's (a shared ~300-token system
prompt, distinct ~100-token user messages), added at once to the throughput suite's engine (warm,
default settings) with prefix sharing on, each generating `new_tokens` greedy tokens with EOS
ignored. The figure is the median time of the steps in which all 64 decode (no prompt in the
step) over the chain at 64 rows (the LM head at 64: every decode row samples): <= 1.25. After the
first such step, `profiled` more run under `torch.profiler` instead (not timed) and split a step
(`step_ops`): linears (the matmul ops), attention (chatcore's paged attention function: K/V
writes, the decode kernel), norms/RoPE/activations (every other op in and around the forward:
RMSNorm, RoPE, SiLU, the residual adds, the embedding, the logits' cast), sampling (the ops under
`StepSampler.sample` and `OutputProcessor.process`), and Python/other (the step's wall time minus
all its ops' self time: the interpreter, scheduling, the dispatcher, the profiler's own cost). Everything but the linears over
the linears: <= 0.25.

Prefill (target 3): prompts of ~1,100 tokens (2.2 chunks), each in a cache scope of its own, added at once with
`max_tokens=1` (so no step decodes): the engine runs them in chunks of `max_batch_tokens` tokens
(512 on the CPU), packed across prompts, each chunk attending over its prompt's earlier chunks. The
figure is a full chunk's tokens over the median time of the full-chunk steps, against the chain's
token rate at 512 rows with the LM head at one row: <= one row of a chunk samples (a prompt's last
token; a chunk in the middle of a prompt samples none), so the chain holds at most that row more
than the engine runs. Target: >= 0.70.
"""

from __future__ import annotations

from typing import Any

from chatcore.bench.common import Context, GemmChain, median, target
from chatcore.bench.engine_runs import chat_prompts, run_batch
from chatcore.bench.workload import chat_workload
from chatcore.engine.core import EngineCore
from chatcore.engine.request import SamplingParams

DECODE_TARGET = 1.25  # decode step / the chain at 64 rows, at most
NON_LINEAR_TARGET = 0.25  # everything but the linears / the linears, in the profiled decode step, at most
PREFILL_TARGET = 0.70  # prefill tok/s / the chain's tok/s at 512 rows, at least
BREAKDOWN = ("linears", "attention", "norms/RoPE/activations", "sampling", "Python/other")


def sizes(ctx: Context) -> dict[str, int]:
    if ctx.tiny:
        return {"requests": 4, "system": 60, "user": 24, "new_tokens": 6, "profiled": 1,
                "prefill_prompts": 1, "prefill_chunks": 1, "chain_reps": 2}
    if ctx.quick:
        return {"requests": 64, "system": 150, "user": 50, "new_tokens": 24, "profiled": 2,
                "prefill_prompts": 2, "prefill_chunks": 2, "chain_reps": 3}
    return {"requests": 64, "system": 300, "user": 100, "new_tokens": 64, "profiled": 3,
            "prefill_prompts": 4, "prefill_chunks": 2, "chain_reps": 5}


def prefill_prompts(ctx: Context, core: EngineCore, count: int, chunks: int) -> list[list[int]]:
    """`count` distinct prompts of about `chunks` chunks and a fifth of one more (~1,100 tokens at
    512; never past the engine's context): a 100-token system prompt and a long user message."""
    chunk = core.scheduler.max_batch_tokens
    length = min(chunks * chunk + chunk // 5, core.scheduler.max_context - 64)
    system, users = chat_workload(ctx.tokenizer, count, 100, length - 120, seed=5)
    return chat_prompts(ctx.tokenizer, system, users)


def breakdown(profiled: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """Milliseconds per step of `BREAKDOWN`'s parts, from `run_batch`'s profiled steps (op split, wall)."""
    ms = dict.fromkeys(BREAKDOWN, 0.0)
    for split, wall in profiled:
        ops = sum(split.values())
        ms["linears"] += split.get("matmul", 0.0)
        ms["attention"] += split.get("attention", 0.0)
        ms["sampling"] += split.get("sampling", 0.0)
        ms["norms/RoPE/activations"] += ops - split.get("matmul", 0.0) - split.get("attention", 0.0) \
            - split.get("sampling", 0.0)
        ms["Python/other"] += max(0.0, wall - ops)
    return {k: 1e3 * v / len(profiled) for k, v in ms.items()}


def run(ctx: Context, core: EngineCore, chain: GemmChain) -> dict[str, Any]:
    """`core`: the throughput suite's engine, warm; each repeat starts in a fresh cache scope.
    `chain`: the loaded model's linears (`GemmChain`)."""
    sz = sizes(ctx)
    n = sz["requests"]
    chunk = core.scheduler.max_batch_tokens
    system, users = chat_workload(ctx.tokenizer, n, sz["system"], sz["user"], seed=3)
    prompts = chat_prompts(ctx.tokenizer, system, users)
    long_prompts = prefill_prompts(ctx, core, sz["prefill_prompts"], sz["prefill_chunks"])
    params = SamplingParams(max_tokens=sz["new_tokens"], ignore_eos=True)
    repeats: list[dict[str, Any]] = []
    for _ in ctx.each_repeat(range(ctx.repeats)):
        batch = run_batch(core, prompts, params, profile_steps=sz["profiled"])
        prefill = run_batch(core, long_prompts, SamplingParams(max_tokens=1, ignore_eos=True), share=False)
        # The baseline, right after: the chain at the decode step's rows, then at a chunk's.
        chain_decode = median(chain.seconds(n, n, sz["chain_reps"]))
        chain_chunk = median(chain.seconds(chunk, 1, sz["chain_reps"]))
        full = [s for d, p, s in batch.steps if d == n and p == 0]
        chunks = [s for d, p, s in prefill.steps if d == 0 and p == chunk]
        if not full or not chunks:
            raise RuntimeError(f"{len(full)} steps with all {n} decoding, {len(chunks)} full {chunk}-token chunks")
        parts = breakdown(batch.profiled)
        profiled_ms = sum(parts.values())
        step_s, chunk_s = median(full), median(chunks)
        repeats.append({
            "decode_steps": len(full), "decode_step_ms": 1e3 * step_s, "chain_decode_ms": 1e3 * chain_decode,
            "decode_ratio": step_s / chain_decode,
            "profiled_steps": len(batch.profiled), "profiled_step_ms": profiled_ms, "breakdown_ms": parts,
            "non_linear_over_linears": (profiled_ms - parts["linears"]) / parts["linears"],
            "linears_over_chain": parts["linears"] / (1e3 * chain_decode),
            "prefill_chunks": len(chunks), "prefill_chunk_ms": 1e3 * chunk_s, "prefill_tok_s": chunk / chunk_s,
            "chain_chunk_ms": 1e3 * chain_chunk,
            "chain_tok_s": chunk / chain_chunk, "prefill_fraction": chain_chunk / chunk_s,
            "cached_tokens": batch.cached_tokens,
        })
        ctx.log(f"  {n} chats decoding: {1e3 * step_s:.1f} ms a step ({len(full)} steps), the chain at {n} rows "
                f"{1e3 * chain_decode:.1f} ms; profiled: " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
                + f" ms; prefill {chunk / chunk_s:.0f} tok/s ({len(chunks)} chunks), the chain at {chunk} rows "
                f"{chunk / chain_chunk:.0f} tok/s")
    return _result(ctx, sz, chunk, chain, repeats) | {"prefill_prompt_tokens": [len(p) for p in long_prompts]}


def _result(ctx: Context, sz: dict[str, int], chunk: int, chain: GemmChain,
            repeats: list[dict[str, Any]]) -> dict[str, Any]:
    n = sz["requests"]

    def runs(key: str) -> list[float]:
        return [r[key] for r in repeats]

    summary: dict[str, Any] = {key: median(runs(key)) for key, value in repeats[0].items()
                               if not isinstance(value, dict)}
    steps = sum(r["profiled_steps"] for r in repeats)  # every profiled step weighs the same
    parts = {k: sum(r["breakdown_ms"][k] * r["profiled_steps"] for r in repeats) / steps for k in BREAKDOWN}
    total = sum(parts.values())
    summary |= {"breakdown_ms": parts, "breakdown_share": {k: v / total for k, v in parts.items()}}
    dtype = str(ctx.dtype).removeprefix("torch.")
    chain_name = f"the GEMM chain ({chain.linears} torch.mm, {dtype}, weights [in, out]"
    shares = ", ".join(f"{k} {v:.0%}" for k, v in summary["breakdown_share"].items())
    return {
        "sizes": sz, "chunk_tokens": chunk, "chain_linears": chain.linears, "repeats": repeats, "summary": summary,
        "targets": [
            target(f"{n} chats decoding: a step <= {DECODE_TARGET}x the same-shape GEMM chain",
                   median(runs("decode_ratio")), "<=", DECODE_TARGET,
                   f"median step {summary['decode_step_ms']:.1f} ms over {summary['decode_steps']:.0f} steps with all "
                   f"{n} decoding vs {chain_name}, {n} rows): {summary['chain_decode_ms']:.1f} ms",
                   runs("decode_ratio"), baseline_runs=runs("chain_decode_ms")),
            target(f"{n} chats decoding: everything but the linears <= {NON_LINEAR_TARGET}x the linears (profile)",
                   median(runs("non_linear_over_linears")), "<=", NON_LINEAR_TARGET,
                   f"{total:.1f} ms per profiled step ({steps} steps): {shares}; linears {parts['linears']:.1f} ms, "
                   f"{summary['linears_over_chain']:.2f}x the chain", runs("non_linear_over_linears")),
            target(f"prefill in {chunk}-token chunks >= {PREFILL_TARGET:.0%} of the {chunk}-row GEMM chain's "
                   f"token rate", median(runs("prefill_fraction")), ">=", PREFILL_TARGET,
                   f"{summary['prefill_tok_s']:.0f} tok/s over {summary['prefill_chunks']:.0f} full chunks vs "
                   f"{chain_name}, {chunk} rows, the LM head at 1): {summary['chain_tok_s']:.0f} tok/s",
                   runs("prefill_fraction"), baseline_runs=runs("chain_tok_s")),
        ],
    }
