"""An engine step's ops under `torch.profiler`, classed into groups: shared by `profile_step`
(its forward-op shares) and `efficiency` (the decode step's breakdown, issue 36's target 2).

`OP_GROUPS` names the ops of each group (an aten op of none is an "other op": norms, RoPE, SiLU,
the residual adds...; the C calls in `OP_GROUPS` show as `native.traced` ranges). `labelled(core)`
puts two parts of a step into `torch.profiler` ranges: chatcore's paged attention of a layer, all
of it (the K/V writes, the decode kernel, the prefill attention, the reshapes around them:
`RANGES[0]`), and the engine's sampling with its outputs (`StepSampler.sample`, `StepUpdate.update_from_output` and
`OutputProcessor.process`: `RANGES[1]`). `op_split` counts an op inside one of those ranges under
the range's name, any other under its group. Times are each op's self time, so nested ops count once; what a step spends
outside every op (Python, the dispatcher, the profiler itself) is its wall time minus their sum.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

from torch.profiler import record_function

from chatcore.engine.core import EngineCore
from chatcore.kernels import cpu_linear, cpu_pointwise, cpu_store, native
from chatcore.models import paged_attention

OTHER = "other ops"
OP_GROUPS = {
    "matmul": {"aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", cpu_linear.PROFILER_NAME},
    "attention math": {"aten::_softmax", "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::masked_fill_",
                       "aten::exp", "aten::amax", "aten::sub", "aten::div_", "aten::baddbmm", native.PROFILER_NAME},
    "K/V gather and write": {"aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::index_select",
                             "aten::copy_", "aten::cat", cpu_store.PROFILER_NAME},
    OTHER: set(cpu_pointwise.PROFILER_NAMES.values()),  # the fused layer's RMSNorm, RoPE and SiLU * up in C
}
RANGES = ("attention", "sampling")  # what `labelled` wraps, in ranges of these names


def in_full_decode(core: EngineCore) -> bool:
    """Every request runs and has its whole prompt computed: the next step only decodes."""
    running = core.scheduler.running
    return bool(running) and not core.scheduler.waiting and all(
        s.num_computed >= len(s.tokens) - 1 for r in running for s in r.live_seqs)


@contextlib.contextmanager
def labelled(core: EngineCore) -> Iterator[None]:
    """Within it, the model's paged attention and `core`'s sampling run inside `RANGES`' ranges."""
    attention, sampling = RANGES
    attend = paged_attention.attend

    def labelled_attention(*args: Any, **kwargs: Any) -> Any:
        with record_function(attention):
            return attend(*args, **kwargs)

    paged_attention.attend = labelled_attention  # both the modules' attention and fused_layer.py call it
    try:
        with _in_range(core.step_sampler, "sample", sampling), _in_range(core.update, "update_from_output", sampling), \
                _in_range(core.output_processor, "process", sampling):
            yield
    finally:
        paged_attention.attend = attend


@contextlib.contextmanager
def _in_range(owner: Any, method: str, name: str) -> Iterator[None]:
    """Within it, `owner.method` runs inside a profiler range called `name`."""
    real, wrapped = getattr(owner, method), method in vars(owner)  # a wrapper already on the instance stays

    def in_range(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return real(*args, **kwargs)

    setattr(owner, method, in_range)
    try:
        yield
    finally:
        if wrapped:
            setattr(owner, method, real)
        else:
            delattr(owner, method)  # the method shows through again


def _range_of(event: Any) -> str | None:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in RANGES:
            return parent.name
        parent = parent.cpu_parent
    return None


def op_split(prof: Any) -> collections.Counter[str]:
    """Self CPU seconds of a profile's ops (aten ops and those `OP_GROUPS` names), by group: an op
    inside a `labelled` range counts under the range's name, any other under its `OP_GROUPS`
    group, or `OTHER`."""
    named = set().union(*OP_GROUPS.values())
    group_of = {name: group for group, names in OP_GROUPS.items() for name in names}
    split: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.name.startswith("aten::") or event.name in named:
            split[_range_of(event) or group_of.get(event.name, OTHER)] += event.self_cpu_time_total / 1e6
    return split
