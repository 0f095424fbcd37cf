"""Grammar masks under one tenant's costly schemas (issue 47, item 3): another tenant's inter-token latency.

The review's load: tenant mallory runs 4 requests of n=8 (32 rows), EOS ignored, whose schema
`{"type":"string","pattern":".{1,500}"}` costs 13-35 ms of mask a row a step. Once all of them
decode, tenant alice starts one greedy chat, and her median inter-token latency is measured until
her answer ends. The baseline is the same load without the schema, run in the same repeat: the
target is alice's latency under the schemas within 1.5x of it. Repeats alternate the two loads.
"""

from __future__ import annotations

from typing import Any

from chatcore.bench.common import median, reported, target
from chatcore.bench.engine_runs import chat_prompts, fresh_core
from chatcore.engine.core import EngineCore
from chatcore.engine.grammar import ResponseFormat
from chatcore.engine.request import SamplingParams

COSTLY_SCHEMA = '{"pattern": ".{1,500}", "type": "string"}'
TARGET_RATIO = 1.5


def _sizes(ctx: Any) -> dict[str, int]:
    if ctx.tiny:
        return {"requests": 2, "n": 2, "load_tokens": 24, "victim_tokens": 6}
    return {"requests": 4, "n": 8, "load_tokens": 120, "victim_tokens": 24 if ctx.quick else 32}


def _alice_itl_ms(core: EngineCore, schema: bool, sizes: dict[str, int]) -> tuple[float, int, int]:
    """Alice's median inter-token ms beside mallory's load, how many of mallory's rows waited a step, and how many
    tokens mallory's rows made meanwhile."""
    tokenizer = core.tokenizer
    fmt = ResponseFormat("json_schema", COSTLY_SCHEMA, core.grammar_compiler.compile(
        ResponseFormat("json_schema", COSTLY_SCHEMA))) if schema else None
    load = [core.make_request(prompt, SamplingParams(max_tokens=sizes["load_tokens"], n=sizes["n"], temperature=1.0,
                                                     ignore_eos=True, response_format=fmt), tenant="mallory")
            for prompt in chat_prompts(tokenizer, None, [f"Write a long story, number {i}." for i in range(sizes["requests"])])]
    for req in load:
        core.add(req)
    while any(len(req.seqs) < sizes["n"] or req.seqs[0].num_generated < 2 for req in load):
        core.step()
    held_before = core.mask_budget.held_rows
    made_before = sum(seq.num_generated for req in load for seq in req.seqs)
    (prompt,) = chat_prompts(tokenizer, None, ["Name three colors."])
    alice = core.make_request(prompt, SamplingParams(max_tokens=sizes["victim_tokens"], ignore_eos=True), tenant="alice")
    core.add(alice)
    final = None
    while final is None:
        final = next((out for out in core.step() if out.request_id == alice.request_id and out.finished), None)
    if final.error or any(req.finished for req in load):
        raise RuntimeError(f"the run ended early: {final.error or 'the load finished before alice did'}")
    held = core.mask_budget.held_rows - held_before
    made = sum(seq.num_generated for req in load for seq in req.seqs) - made_before
    for req in load:
        core.abort(req.request_id)
    return median(final.timings.inter_token_ms), held, made


def run(ctx: Any) -> dict[str, Any]:
    sizes = _sizes(ctx)
    core = fresh_core(ctx)
    plain, constrained, held, made = [], [], [], {"schema": [], "no_schema": []}
    for _ in ctx.each_repeat(range(ctx.repeats)):
        itl, _, tokens = _alice_itl_ms(core, False, sizes)
        plain.append(itl)
        made["no_schema"].append(tokens)
        itl, rows, tokens = _alice_itl_ms(core, True, sizes)
        constrained.append(itl)
        held.append(rows)
        made["schema"].append(tokens)
    core.audit()
    ratios = [c / p for c, p in zip(constrained, plain, strict=True)]
    ratio = median(ratios)
    detail = (f"alice's median inter-token ms beside {sizes['requests']} x n={sizes['n']} rows of `.{{1,500}}` vs "
              f"beside the same rows without a schema: {median(constrained):.1f} vs {median(plain):.1f}")
    return {
        "sizes": sizes, "alice_itl_ms": {"schema": constrained, "no_schema": plain}, "held_rows": held,
        "mallory_tokens_meanwhile": made,
        "targets": [
            target("another tenant's ITL under costly grammars / without", ratio, "<=", TARGET_RATIO, detail,
                   runs=ratios, baseline_runs=plain),
            reported("mallory's rows held out of a step while alice ran", float(median(held)),
                     "each a row whose tenant's masks were past its share that step"),
            reported("mallory's tokens while alice ran, with the schema / without", float(
                median([s / max(1, p) for s, p in zip(made["schema"], made["no_schema"], strict=True)])),
                f"{median(made['schema']):.0f} against {median(made['no_schema']):.0f}: the costly tenant pays"),
        ],
    }
