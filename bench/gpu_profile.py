"""Where a decode step's time goes on the GPU: `torch.profiler` over full decode steps.

Two figures, both per decode step with every chat decoding (no prompt in the step):
- `gpu_busy_share`: the device's kernel time (the sum of the CUDA kernels' own time) over the step's wall
  time, timed without the profiler; a step bound by the host (Python, launches) has a small share;
- `launches_per_decode_step`: what the host launches a step, counted at the CUDA runtime and driver
  calls (`LAUNCH_CALLS`: kernels, graph replays, asynchronous copies and sets): a replayed graph is one;
- `launches_per_prefill_step`: the same count over the steps before every chat decodes (the workload's
  prompts, with the decode rows of the chats already past theirs), profiled as they run;
- `kernels_per_decode_step` (beside the summary): the CUDA kernels the device runs a step, a graph's
  included (events of device type CUDA).
On the CPU there are no device kernels: all are None and `note` says so (the rehearsal runs the code).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from chatcore.bench.step_ops import in_full_decode
from chatcore.engine.core import EngineCore


LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                          "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync"})


def _is_device_event(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _launches(prof: Any) -> int:
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCH_CALLS)


def decode_profile(core: EngineCore, device: torch.device, warm_steps: int, steps: int) -> dict[str, Any]:
    """Profile `core`, whose requests were all added: step through the prefill, then `warm_steps` decode steps,
    then `steps` timed without the profiler and `steps` under it. Every request must outlast all of them."""
    sync = _sync(device)
    prefill_steps = 0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prefill_prof:
        while core.has_work and not in_full_decode(core):
            core.step()
            prefill_steps += 1
        sync()
    for _ in range(warm_steps):
        core.step()
    chats = len(core.scheduler.running)
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        core.step()
    sync()
    step_ms = (time.perf_counter() - started) * 1e3 / steps
    with profile(activities=activities) as prof:
        for _ in range(steps):
            core.step()
        sync()
    if len(core.scheduler.running) != chats or not in_full_decode(core):
        raise RuntimeError("a request finished while steps were measured: give the requests more tokens")
    kernels = [e for e in prof.key_averages() if _is_device_event(e)]
    result: dict[str, Any] = {"chats": chats, "prefill_steps": prefill_steps, "step_ms": step_ms, "steps": steps}
    if device.type != "cuda":
        return result | {"gpu_busy_share": None, "launches_per_decode_step": None, "kernels_per_decode_step": None,
                         "launches_per_prefill_step": None, "note": "no CUDA kernels on the CPU: the step time only"}
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]
    return result | {
        "gpu_busy_ms": busy_ms, "gpu_busy_share": busy_ms / step_ms,
        "launches_per_decode_step": _launches(prof) / steps,
        "launches_per_prefill_step": _launches(prefill_prof) / max(1, prefill_steps),
        "kernels_per_decode_step": sum(e.count for e in kernels) / steps,
        "top_kernels": [{"name": e.key[:80], "per_step": e.count / steps,
                         "us_per_step": e.self_device_time_total / steps} for e in top]}
