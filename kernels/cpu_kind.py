"""The CPU's kind, which picks the C kernels' instruction paths and `dtype=auto`, and the cap that
makes this CPU take a lower kind's paths, so that one machine runs every kind's code.

The kinds, lowest first (each has everything the one before it has):
- "generic": none of the below (an x86-64 without AVX2 + FMA + F16C, or another architecture);
- "avx2": AVX2, FMA and F16C (x86-64-v3);
- "avx512f": AVX-512 F, BW, DQ, VL and CD (x86-64-v4), without bfloat16;
- "avx512bf16": AVX512_BF16 besides (AMD Zen 4, Intel Cooper Lake);
- "amx": AMX-BF16 besides (Intel Sapphire Rapids and later).

`CHATCORE_CPU_ISA` (`auto` by default) caps the kind: `CHATCORE_CPU_ISA=avx2` on an AMX Xeon makes
chatcore behave as on an AVX2 laptop. A kind above the CPU's is refused (ValueError), as is an
unknown name. The cap moves:
- the C library's build (kernels/native.py): `-march=native` at the CPU's own kind, else the
  kind's baseline (`MARCH`), so the compiler emits that kind's instructions and no others (the
  few-row bfloat16 linear, kernels/cpu_linear.c, exists only from avx512bf16 up);
- the paths chosen at run time (kernels/cpu_quant.py's `isa()`): the best at or below the kind;
- `dtype=auto` on the CPU: bfloat16 from avx512bf16 up, float32 below (models/device.py);
- torch's own kernels, when the variable is set before torch is imported: `forward_to_torch`
  (called by chatcore/__init__.py) sets ATen's and oneDNN's caps to the kind's (`TORCH_CAPS`),
  unless the caller set them.
This module reads /proc/cpuinfo and the environment only: it imports no torch.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

KINDS = ("generic", "avx2", "avx512f", "avx512bf16", "amx")
ENV = "CHATCORE_CPU_ISA"
# The /proc/cpuinfo flags each kind needs beyond the one before it.
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512f": ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"),
    "avx512bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_tile"),
}
# The compiler's flags for a kind below the CPU's own (at its own kind: -march=native).
MARCH: dict[str, tuple[str, ...]] = {
    "generic": ("-march=x86-64",),
    "avx2": ("-march=x86-64-v3",),
    "avx512f": ("-march=x86-64-v4",),
    "avx512bf16": ("-march=x86-64-v4", "-mavx512bf16"),
    "amx": ("-march=sapphirerapids",),
}
# ATen's dispatch (ATEN_CPU_CAPABILITY) and oneDNN's (ONEDNN_MAX_CPU_ISA) for each kind.
TORCH_CAPS = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "avx512f": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "avx512bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "amx": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},
}


def kind_of(flags: frozenset[str]) -> str:
    """The highest kind whose flags (and every lower kind's) are all in `flags`."""
    found = "generic"
    for kind in KINDS[1:]:
        if not set(_NEEDS[kind]) <= flags:
            break
        found = kind
    return found


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first `flags` line of /proc/cpuinfo, word by word; empty where there is none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def detected() -> str:
    """This CPU's own kind."""
    return kind_of(cpu_flags())


def capped(requested: str, own: str) -> str:
    """The kind a CPU of kind `own` runs as under the cap `requested` ("auto", "" or a kind)."""
    if requested in ("", "auto"):
        return own
    if requested not in KINDS:
        raise ValueError(f"{ENV}={requested!r} is not a CPU kind: use auto or one of {', '.join(KINDS)}")
    if KINDS.index(requested) > KINDS.index(own):
        raise ValueError(f"{ENV}={requested} is above this CPU, which is {own}: it runs "
                         f"{', '.join(KINDS[:KINDS.index(own) + 1])}")
    return requested


def kind() -> str:
    """The kind chatcore runs as here: this CPU's, capped by `CHATCORE_CPU_ISA`."""
    return capped(os.environ.get(ENV, "").strip().lower(), detected())


def at_least(minimum: str) -> bool:
    """Whether the kind chatcore runs as has everything `minimum` has."""
    return KINDS.index(kind()) >= KINDS.index(minimum)


def executable() -> tuple[str, ...]:
    """Every kind this CPU runs, lowest first: its own and each below it."""
    return KINDS[:KINDS.index(detected()) + 1]


def march() -> tuple[str, ...]:
    """The compiler's target flags for the kind chatcore runs as."""
    current = kind()
    return ("-march=native",) if current == detected() else MARCH[current]


def forward_to_torch() -> None:
    """Under a cap below this CPU, cap torch's own dispatch the same way (`TORCH_CAPS`), where the
    caller did not set it; this takes effect only before torch's first kernel runs. A cap that is
    refused sets nothing here: `kind()` refuses it where it is used (the CLI: one line)."""
    try:
        current = kind()
    except ValueError:
        return
    if current != detected():
        for name, value in TORCH_CAPS[current].items():
            os.environ.setdefault(name, value)
