"""`python -m chatcore.bench.profile_step`: where an engine step's time goes (issue 14, item 1).

For each count of running sequences (default 16 and 64; the 16-chat workload's prompts, each in
its own cache scope, so no sharing), all requests are added at once and run to the end. Each
step is classed as prefill (a prompt chunk runs) or decode (every sequence decodes one token).
Wall-clock timers around the engine's parts split a step into the model body, the LM head, the
step's metadata (the runner's time outside the model), scheduling, sampling with detokenizing,
and the rest. Every seventh step runs under `torch.profiler` instead (not timed) to split the
forward's own ops into matmuls, attention math, K/V gathers and writes, and other ops
(`bench/step_ops.py`'s groups). The C decode attention (kernels/native.py, the CPU's decode in every
dtype) reads K/V in place: it counts as attention math.
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from chatcore.bench.engine_runs import chat_prompts
from chatcore.bench.step_ops import in_full_decode, op_split
from chatcore.bench.workload import chat_workload
from chatcore.config import Settings
from chatcore.engine import detok
from chatcore.engine.core import EngineCore
from chatcore.engine.request import SamplingParams
from chatcore.models.loader import load_model

PROFILED_EVERY = 7


class Timers:
    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed


def profile_run(loaded: Any, sequences: int, new_tokens: int) -> dict[str, Any]:
    timers = Timers()
    model = loaded.model
    body, head, push = model.model.forward, model.lm_head.forward, detok.IncrementalDetokenizer.push
    model.model.forward = timers.wrap("model body", body)
    model.lm_head.forward = timers.wrap("lm head", head)
    detok.IncrementalDetokenizer.push = timers.wrap("detokenize", push)  # type: ignore[method-assign]
    try:
        core = EngineCore(loaded, Settings(device=str(loaded.device), num_blocks=4096, max_num_seqs=max(64, sequences)))
        core.scheduler.schedule = timers.wrap("schedule", core.scheduler.schedule)  # type: ignore[method-assign]
        core.runner.execute = timers.wrap("runner", core.runner.execute)  # type: ignore[method-assign]
        core.step_sampler.sample = timers.wrap("sample", core.step_sampler.sample)  # type: ignore[method-assign]
        core.update.update_from_output = timers.wrap(  # type: ignore[method-assign]
            "sample", core.update.update_from_output)  # sampling, appending and outputs, timed as one
        core.output_processor.process = timers.wrap(  # type: ignore[method-assign]
            "sample", core.output_processor.process)
        system, users = chat_workload(loaded.tokenizer, sequences, 300, 100, seed=1)
        for i, prompt in enumerate(chat_prompts(loaded.tokenizer, system, users)):
            core.add(core.make_request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                                       scope_key=f"profile-{i}"))
        phases = {kind: {"steps": 0, "wall": 0.0, "parts": collections.Counter(), "ops": collections.Counter(),
                         "profiled": 0} for kind in ("prefill", "decode")}
        step = 0
        while core.has_work:
            phase = phases["decode" if in_full_decode(core) else "prefill"]
            if step % PROFILED_EVERY == PROFILED_EVERY // 2:
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    core.step()
                phase["ops"].update(op_split(prof))
                phase["profiled"] += 1
            else:
                before = timers.seconds.copy()
                start = time.perf_counter()
                core.step()
                phase["wall"] += time.perf_counter() - start
                phase["steps"] += 1
                phase["parts"].update({k: v - before.get(k, 0.0) for k, v in timers.seconds.items()})
            step += 1
        core.audit()
    finally:
        model.model.forward, model.lm_head.forward = body, head
        detok.IncrementalDetokenizer.push = push  # type: ignore[method-assign]
    return {kind: _summary(phase) for kind, phase in phases.items() if phase["steps"]}


def _summary(phase: dict[str, Any]) -> dict[str, Any]:
    steps, wall, parts = phase["steps"], phase["wall"], phase["parts"]
    runner = parts["runner"]
    rows = {
        "model body": parts["model body"],
        "lm head": parts["lm head"],
        "step metadata": runner - parts["model body"] - parts["lm head"],
        "schedule": parts["schedule"],
        "sample and append (with detokenize)": parts["sample"],
        "  of which detokenize": parts["detokenize"],
        "rest (commit, outputs)": wall - runner - parts["schedule"] - parts["sample"],
    }
    ops = phase["ops"]
    total_ops = sum(ops.values()) or 1.0
    return {"steps": steps, "ms_per_step": 1000 * wall / steps,
            "parts_ms": {k: 1000 * v / steps for k, v in rows.items()},
            "forward_ops_share": {k: v / total_ops for k, v in ops.most_common()}, "profiled_steps": phase["profiled"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", default="16,64")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(Settings())
    print(f"{loaded.path.name} on {loaded.device} in {loaded.dtype_name}, {torch.get_num_threads()} threads")
    for count in (int(n) for n in args.sequences.split(",")):
        for kind, row in profile_run(loaded, count, args.new_tokens).items():
            print(f"\n{count} sequences, {kind}: {row['steps']} steps, {row['ms_per_step']:.1f} ms/step")
            for name, ms in row["parts_ms"].items():
                print(f"  {name:38s} {ms:8.2f} ms {ms / row['ms_per_step']:6.1%}")
            print("  forward ops (torch.profiler, %d steps): %s" % (row["profiled_steps"], ", ".join(
                f"{k} {v:.0%}" for k, v in row["forward_ops_share"].items())))


if __name__ == "__main__":
    main()
