"""Driving chatcore's `EngineCore` directly (in-process, no server), timed like the baselines."""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from torch.profiler import ProfilerActivity, profile

from chatcore.bench import step_ops
from chatcore.bench.baselines import BatchRun
from chatcore.engine.core import EngineCore
from chatcore.engine.request import SamplingParams
from chatcore.engine.step_types import StepPlan


def chat_prompts(tokenizer: Any, system: str | None, users: list[str]) -> list[list[int]]:
    out = []
    for user in users:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    return out


def run_batch(core: EngineCore, prompts: list[list[int]], params: SamplingParams,
              scope_key: str | None = None, share: bool = True, profile_steps: int = 0) -> BatchRun:
    """Add every prompt at t=0, step until done. A fresh `scope_key` means a cold prefix cache;
    `share=False` gives each request a cache scope of its own, so none reuses another's blocks.

    `profile_steps`: after the first step in which every request decodes, that many more such
    steps run under `torch.profiler` with the attention and sampling labelled (`step_ops`); they
    are left out of every timing, and `BatchRun.profiled` holds each one's op split and wall time."""
    scope = scope_key or f"bench-{uuid.uuid4().hex}"
    plans: list[StepPlan] = []
    hook = plans.append
    core.on_step.append(hook)
    profiles: list[tuple[Any, float]] = []
    tally = _Tally()
    try:
        requests = [core.make_request(p, params, scope_key=scope if share else f"{scope}/{i}")
                    for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        for req in requests:
            req.arrival = time.monotonic()
            core.add(req)
        finals = {}
        while core.has_work:
            before = len(plans)
            profiled = (tally.full_tokens > 0 and len(profiles) < profile_steps and step_ops.in_full_decode(core)
                        and len(core.scheduler.running) == len(requests))
            outputs, dt, prof = _step(core, profiled)
            for out in outputs:
                if out.finished:
                    finals[out.request_id] = out
            if profiled:
                profiles.append((prof, dt))
            elif len(plans) > before:
                tally.add(plans[-1], dt, len(requests))
        wall = time.perf_counter() - t0
    finally:
        core.on_step.remove(hook)
    errors = [o.error for o in finals.values() if o.error]
    if errors or len(finals) != len(prompts):
        raise RuntimeError(f"chatcore run failed: {errors[:2]} ({len(finals)} of {len(prompts)} finished)")
    if len(profiles) < profile_steps:
        raise RuntimeError(f"{len(profiles)} of {profile_steps} steps profiled: give the requests more tokens")
    tokens = sum(o.usage.completion_tokens for o in finals.values())
    ttft = [o.timings.ttft_ms / 1e3 for o in finals.values()]
    cached = sum(o.usage.cached_tokens for o in finals.values())
    return BatchRun(wall, tokens, ttft,
                    decode_tok_s=tally.decode_tokens / tally.decode_time if tally.decode_time else None,
                    cached_tokens=cached, full_decode_tokens=tally.full_tokens, full_decode_s=tally.full_time,
                    steps=tally.steps, profiled=[(dict(step_ops.op_split(prof)), dt) for prof, dt in profiles])


def _step(core: EngineCore, profiled: bool) -> tuple[list[Any], float, Any]:
    """One step, timed: (its outputs, seconds, the profiler when `profiled`, its ops labelled)."""
    with step_ops.labelled(core) if profiled else contextlib.nullcontext(), \
            profile(activities=[ProfilerActivity.CPU]) if profiled else contextlib.nullcontext() as prof:
        s0 = time.perf_counter()
        outputs = core.step()
        dt = time.perf_counter() - s0
    return outputs, dt, prof


@dataclass
class _Tally:
    """Each unprofiled step's (decode rows, prefill tokens, seconds); the decode-only steps' tokens and
    time, and those of the steps in which all `batch` requests decode (`full_*`)."""

    steps: list[tuple[int, int, float]] = field(default_factory=list)
    decode_tokens: int = 0
    decode_time: float = 0.0
    full_tokens: int = 0
    full_time: float = 0.0

    def add(self, plan: StepPlan, dt: float, batch: int) -> None:
        self.steps.append((len(plan.decode), sum(e.num_tokens for e in plan.prefill), dt))
        if not plan.prefill and plan.decode:
            self.decode_tokens += len(plan.decode)
            self.decode_time += dt
            if len(plan.decode) == batch:
                self.full_tokens += batch
                self.full_time += dt


def fresh_core(ctx: Any, **overrides: Any) -> EngineCore:
    return EngineCore(ctx.loaded, ctx.engine_settings(**overrides))
