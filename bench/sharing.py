"""Suite 5, sharing: peak KV blocks of n=4 sampling and of beam width 4 on the real engine,
against the same work without sharing (4 independent requests, each with its own cache scope,
so neither the prompt nor anything generated is shared).

Lengths come from the trace: the median prompt of all turns (a conversation's history plus the
new message) and the median answer. The prompt is natural text of that many tokens. EOS is
ignored so every sequence generates the same number of tokens. The peak is the most blocks in
use (ref > 0) after any engine step, read from the pool; the audit must be clean at the end.
"""

from __future__ import annotations

import random
import statistics
import uuid
from typing import Any

from chatcore.bench.common import Context, target
from chatcore.bench.engine_runs import chat_prompts, fresh_core
from chatcore.bench.workload import TraceConfig, generate, text_of_tokens
from chatcore.cache import audit
from chatcore.engine.core import EngineCore
from chatcore.engine.request import SamplingParams

COUNTED = "peak block counts of one run (no repeats: counts, not timings)"


def peak_blocks(core: EngineCore, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    peak = 0

    def hook(_plan: Any) -> None:
        nonlocal peak
        peak = max(peak, core.pool.num_used)

    core.on_step.append(hook)
    try:
        scope = uuid.uuid4().hex
        reqs = [core.make_request(p, params, scope_key=f"{scope}-{i}") for i, (p, params) in enumerate(requests)]
        for req in reqs:
            core.add(req)
        outputs = 0
        errors = []
        while core.has_work:
            for out in core.step():
                if out.finished:
                    outputs += len(out.outputs)
                    if out.error:
                        errors.append(out.error)
    finally:
        core.on_step.remove(hook)
    report = audit(core.pool)
    if errors or not report.ok or report.used:
        raise RuntimeError(f"sharing run failed: errors {errors[:2]}, audit ok {report.ok}, used {report.used}")
    return {"peak_blocks": peak, "sequences": outputs}


def run(ctx: Context) -> dict[str, Any]:
    trace = generate(TraceConfig())
    prompts = [len(trace.prompt(e.session, e.turn)) for e in trace.events()]
    answers = [len(t.answer) for s in trace.sessions for t in s.turns]
    prompt_len = int(statistics.median(prompts))
    answer_len = int(statistics.median(answers)) - 2  # the trace's answers include <|im_end|>\n
    if ctx.tiny:
        prompt_len, answer_len = 80, 6
    elif ctx.quick:
        prompt_len, answer_len = min(prompt_len, 300), min(answer_len, 16)
    tok = ctx.tokenizer
    user = text_of_tokens(tok, random.Random(3), prompt_len - 30, prefix="Here is our conversation so far.")
    prompt = chat_prompts(tok, "You are a helpful assistant.", [user])[0]
    bs = ctx.settings.block_size
    blocks = 4 * (-(-(len(prompt) + answer_len) // bs) + 2)
    num_blocks = int(blocks / 0.8) + 8  # room for the low watermark
    cases: dict[str, Any] = {}
    core = fresh_core(ctx, num_blocks=num_blocks)
    n4 = peak_blocks(core, [(prompt, SamplingParams(max_tokens=answer_len, temperature=1.0, seed=5, n=4,
                                                    ignore_eos=True))])
    n4_solo = peak_blocks(core, [(prompt, SamplingParams(max_tokens=answer_len, temperature=1.0, seed=5 + i,
                                                         ignore_eos=True)) for i in range(4)])
    cases["n=4 sampling"] = {"shared_peak_blocks": n4["peak_blocks"], "unshared_peak_blocks": n4_solo["peak_blocks"]}
    beam = peak_blocks(core, [(prompt, SamplingParams(max_tokens=answer_len, beam_width=4, ignore_eos=True))])
    beam_solo = peak_blocks(core, [(prompt, SamplingParams(max_tokens=answer_len, ignore_eos=True)) for _ in range(4)])
    cases["beam width 4"] = {"shared_peak_blocks": beam["peak_blocks"], "unshared_peak_blocks": beam_solo["peak_blocks"]}
    for case in cases.values():
        case["saving"] = 1 - case["shared_peak_blocks"] / case["unshared_peak_blocks"]
    ctx.log(f"  prompt {len(prompt)} tokens, answers {answer_len}: " + "; ".join(
        f"{k}: {v['shared_peak_blocks']} vs {v['unshared_peak_blocks']} blocks ({v['saving']:.0%} saved)"
        for k, v in cases.items()))
    n, b = cases["n=4 sampling"], cases["beam width 4"]
    return {
        "prompt_tokens": len(prompt), "answer_tokens": answer_len, "block_size": bs, "pool_blocks": num_blocks,
        "trace_median_prompt": prompt_len, "cases": cases,
        "targets": [
            target("sharing saves >= 30% for n=4", n["saving"], ">=", 0.30,
                   f"{n['shared_peak_blocks']} peak blocks vs 4 independent requests, each in its own cache scope: "
                   f"{n['unshared_peak_blocks']}; {COUNTED}"),
            target("sharing saves >= 55% for beam width 4", b["saving"], ">=", 0.55,
                   f"{b['shared_peak_blocks']} peak blocks vs 4 independent greedy requests, each in its own cache "
                   f"scope: {b['unshared_peak_blocks']}; {COUNTED}"),
        ],
    }
