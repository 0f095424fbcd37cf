"""Suite 2, multi-turn: TTFT of turns 1..10 of one conversation whose history grows to ~2,000 tokens.

The conversation: a ~100-token system prompt, then per turn a ~120-token user message and a
64-token greedy answer (EOS ignored; --quick: a ~60-token system prompt, 60-token messages and
8-token answers, the baselines at turns 1 and 10 only). The history is the canonical token
chain: prompt, generated ids, then `<|im_end|>\\n`, so each turn's prompt extends the previous one.

Three ways to answer each turn's prompt, all on the same token ids:
* chatcore: one engine, prefix cache on. The previous turn's full blocks (prompt and answer)
  are cached-free in the pool, so only the new user message (and the partial last block) is
  computed. Each repeat uses a fresh cache scope, so repeats do not hit each other's blocks.
* chatcore, prefix cache off: every request gets its own fresh cache scope (a salt no other
  request shares), so nothing is ever found and the whole prompt is prefilled; max_tokens=1.
* transformers `generate` on the full prompt (SDPA, its own dynamic cache), max_new_tokens=1.

TTFT is from the request's arrival to its first token (chatcore's own `timings.ttft_ms`,
a stopping-criterion clock for transformers). The target compares the last turn with the faster
of the two cold answers, and the results show both.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

from chatcore.bench import baselines
from chatcore.bench.common import Context, median, target
from chatcore.bench.engine_runs import fresh_core, run_batch
from chatcore.bench.workload import text_of_tokens
from chatcore.engine.core import EngineCore
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.request import SamplingParams

IM_END, NEWLINE = 2, 198


def sizes(ctx: Context) -> dict[str, Any]:
    if ctx.tiny:
        return {"turns": 3, "system": 40, "user": 24, "answer": 4, "baseline_turns": [1, 3]}
    if ctx.quick:
        return {"turns": 10, "system": 60, "user": 60, "answer": 8, "baseline_turns": [1, 10]}
    return {"turns": 10, "system": 100, "user": 120, "answer": 64, "baseline_turns": list(range(1, 11))}


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def run(ctx: Context) -> dict[str, Any]:
    sz = sizes(ctx)
    tok = ctx.tokenizer
    rng = random.Random(7)
    system = "You are a patient tutor. " + text_of_tokens(tok, rng, sz["system"] - 12)
    users = [text_of_tokens(tok, rng, sz["user"] - 10, prefix=f"Turn {i + 1}.") for i in range(sz["turns"])]
    params = SamplingParams(max_tokens=sz["answer"], ignore_eos=True)
    first = SamplingParams(max_tokens=1, ignore_eos=True)

    core = fresh_core(ctx)
    off_core = fresh_core(ctx)  # its own pool: the cache-off runs never evict the conversation's blocks
    model = ctx.hf_model
    for c in (core, off_core):  # warm-up
        run_batch(c, [_ids(tok, f"<|im_start|>user\n{users[0]}<|im_end|>\n")], first)
    baselines.hf_one(model, _ids(tok, users[0]), 1)
    reps = ctx.repeats
    measured = [t for t in sz["baseline_turns"] if t <= sz["turns"]]
    prompts: list[list[int]] = []
    on: list[list[float]] = [[] for _ in range(sz["turns"])]
    cached: list[int] = [0] * sz["turns"]
    off: dict[int, list[float]] = {t: [] for t in measured}
    hf: dict[int, list[float]] = {t: [] for t in measured}
    for rep in ctx.each_repeat(range(reps)):
        scope = f"multiturn-{rep}-{uuid.uuid4().hex}"
        history = _ids(tok, f"<|im_start|>system\n{system}<|im_end|>\n")
        for turn in range(sz["turns"]):
            prompt = history + _ids(tok, f"<|im_start|>user\n{users[turn]}<|im_end|>\n<|im_start|>assistant\n")
            if rep == 0:
                prompts.append(prompt)
            elif prompt != prompts[turn]:
                raise RuntimeError("greedy answers differ between repeats: the history is not reproducible")
            final = _one_turn(core, prompt, params, scope)
            on[turn].append(final.timings.ttft_ms)
            cached[turn] = final.usage.cached_tokens
            history = prompt + final.outputs[0].token_ids + [IM_END, NEWLINE]
            # The baselines on the same prompt, right after (interleaved: load drifts hit all three).
            if turn + 1 in measured:
                off_ms, hf_ms = _cold_answers(off_core, model, prompt, first)
                off[turn + 1].append(off_ms)
                hf[turn + 1].append(hf_ms)
        last = measured[-1]
        ctx.log(f"  repeat {rep + 1}: turn {sz['turns']} TTFT {on[-1][-1]:.0f} ms ({cached[-1]} of "
                f"{len(prompts[-1])} prompt tokens cached); turn {last} without the prefix cache "
                f"{off[last][-1]:.0f} ms, transformers {hf[last][-1]:.0f} ms")
    turns = [{"turn": i + 1, "prompt_tokens": len(prompt), "cached_tokens": cached[i],
              "chatcore_ttft_ms": median(on[i]),
              "chatcore_no_cache_ttft_ms": median(off[i + 1]) if i + 1 in off else None,
              "hf_generate_ttft_ms": median(hf[i + 1]) if i + 1 in hf else None}
             for i, prompt in enumerate(prompts)]
    return _result(sz, reps, turns, off, hf)


def _one_turn(core: EngineCore, prompt: list[int], params: SamplingParams, scope: str) -> RequestOutput:
    """The turn's request stepped to its end on `core`: its final output."""
    core.add(core.make_request(prompt, params, scope_key=scope))
    final = None
    while core.has_work:
        for out in core.step():
            if out.finished:
                final = out
    assert final is not None and final.error is None, final and final.error
    return final


def _cold_answers(off_core: EngineCore, model: Any, prompt: list[int], first: SamplingParams) -> tuple[float, float]:
    """TTFT (ms) of `prompt` with the prefix cache off (a fresh scope), and of transformers' `generate`."""
    run = run_batch(off_core, [prompt], first, scope_key=f"off-{uuid.uuid4().hex}")
    if run.cached_tokens:
        raise RuntimeError("the prefix-cache-off run found cached tokens")
    return run.ttft_s[0] * 1e3, baselines.hf_one(model, prompt, 1)[1] * 1e3


def _result(sz: dict[str, Any], reps: int, turns: list[dict[str, Any]], off: dict[int, list[float]],
            hf: dict[int, list[float]]) -> dict[str, Any]:
    """The suite's result: the last turn's TTFT against the faster cold answer, judged by its target."""
    last = turns[-1]
    # The faster cold answer is the baseline; its per-repeat values judge whether it moved.
    cold_name, cold, cold_runs = min(
        ("chatcore with the prefix cache off", last["chatcore_no_cache_ttft_ms"], off[last["turn"]]),
        ("transformers generate", last["hf_generate_ttft_ms"], hf[last["turn"]]), key=lambda c: c[1])
    ratio = last["chatcore_ttft_ms"] / cold
    return {
        "sizes": sz, "repeats": reps, "turns": turns,
        "prefix_cache_off": "a fresh cache scope (salt) per request: no block is ever found",
        "ratio_last_turn_vs_no_cache": ratio,
        "ratio_last_turn_vs_hf": last["chatcore_ttft_ms"] / last["hf_generate_ttft_ms"],
        "targets": [target(f"TTFT at turn {last['turn']} <= 0.1x the faster cold answer (prefix cache off, "
                           "transformers)", ratio, "<=", 0.1,
                           f"{last['chatcore_ttft_ms']:.0f} ms vs the faster cold answer at {last['prompt_tokens']} "
                           f"prompt tokens, {cold_name}: {cold:.0f} ms (cache off "
                           f"{last['chatcore_no_cache_ttft_ms']:.0f} ms, transformers "
                           f"{last['hf_generate_ttft_ms']:.0f} ms)", baseline_runs=cold_runs)],
    }
