"""Every CPU kind's paths run on this machine (issue 52, item 2; kernels/cpu_kind.py).

- Everywhere: the kind of each real CPU's flags (an AMX Xeon, an AMD Zen 4, an AVX-512F Xeon
  without bf16, an AVX2 laptop, an old x86-64), the cap's refusals, each kind's compiler target.
- Each kind at or below this CPU's: a fresh process under `CHATCORE_CPU_ISA=KIND` runs as that
  kind would (`dtype=auto`, the few-row bf16 linear, GGUF blocks' path, torch's own dispatch), then
  the C kernels' test files run there, on a library compiled for that kind's instructions only.
  The session's summary names the CPU's kind and the kinds exercised (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chatcore.kernels import cpu_kind

ROOT = Path(__file__).resolve().parent.parent
XEON_AMX = ("fpu sse2 avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 "
            "amx_bf16 amx_tile amx_int8")
ZEN4 = "fpu sse2 avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16"
SKYLAKE_X = "fpu sse2 avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl"
HASWELL = "fpu sse2 avx f16c fma avx2 bmi2"
OLD = "fpu sse2 sse4_2 avx"
# What each kind implies: dtype=auto, the few-row bf16 linear, the GGUF blocks' C path, ATen's dispatch.
# (The GGUF blocks take integer products from avx2 up: VNNI's with AVX512-BF16, as every such CPU has it.)
EXPECTED = {
    "generic": ("float32", False, "reference", "DEFAULT"),
    "avx2": ("float32", False, "avx2int8", "AVX2"),
    "avx512f": ("float32", False, "avx2int8", "AVX512"),
    "avx512bf16": ("bfloat16", True, "avx512vnni", "AVX512"),
    "amx": ("bfloat16", True, "avx512vnni", "AVX512"),
}
# The C kernels' own tests, rerun under each lower kind (each path's reference and refusals included).
KERNEL_TESTS = ("tests/test_cpu_quant.py", "tests/test_cpu_linear.py", "tests/test_cpu_pointwise.py",
                "tests/test_cpu_store.py", "tests/test_cpu_qdot.py", "tests/test_device.py")
PROBE = """
import json, torch, chatcore
from chatcore.kernels import cpu_kind, cpu_linear, cpu_quant, native
from chatcore.models.device import resolve_dtype
print(json.dumps([cpu_kind.kind(), str(resolve_dtype("auto", "cpu")).removeprefix("torch."), cpu_linear.available(),
                  cpu_quant.isa(), torch.backends.cpu.get_cpu_capability(), native.available()]))
"""


@pytest.mark.parametrize(("flags", "kind"), [(XEON_AMX, "amx"), (ZEN4, "avx512bf16"), (SKYLAKE_X, "avx512f"),
                                             (HASWELL, "avx2"), (OLD, "generic"), ("", "generic"),
                                             (ZEN4.replace(" avx512bw", ""), "avx2")])
def test_each_cpus_flags_name_its_kind(flags: str, kind: str) -> None:
    assert cpu_kind.kind_of(frozenset(flags.split())) == kind


def test_the_cap_runs_this_cpu_as_a_lower_kind_and_refuses_a_higher_one() -> None:
    assert cpu_kind.capped("", "avx512bf16") == cpu_kind.capped("auto", "avx512bf16") == "avx512bf16"
    assert cpu_kind.capped("avx2", "amx") == "avx2"
    with pytest.raises(ValueError, match="CHATCORE_CPU_ISA=amx is above this CPU, which is avx2: it runs generic, avx2"):
        cpu_kind.capped("amx", "avx2")
    with pytest.raises(ValueError, match="'sse9' is not a CPU kind: use auto or one of generic, avx2"):
        cpu_kind.capped("sse9", "amx")


def test_each_kind_below_the_cpu_compiles_for_its_own_instructions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_kind.ENV, raising=False)
    assert cpu_kind.march() == ("-march=native",) and cpu_kind.kind() == cpu_kind.detected()
    for kind in cpu_kind.executable()[:-1]:
        monkeypatch.setenv(cpu_kind.ENV, kind)
        assert cpu_kind.march() == cpu_kind.MARCH[kind]
    assert set(cpu_kind.MARCH) == set(cpu_kind.KINDS) == set(cpu_kind.TORCH_CAPS) == set(EXPECTED)


def test_a_cap_above_this_cpu_is_one_line_from_the_cli() -> None:
    above = next(iter(cpu_kind.KINDS[cpu_kind.KINDS.index(cpu_kind.detected()) + 1:]), "no-such-kind")
    done = subprocess.run([sys.executable, "-m", "chatcore.cli", "config", "show"], capture_output=True, text=True,
                          env={**os.environ, cpu_kind.ENV: above}, timeout=120, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and cpu_kind.ENV in done.stderr
    assert "Traceback" not in done.stderr


def _capped_env(kind: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")}
    return {**env, cpu_kind.ENV: kind, "PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("kind", cpu_kind.executable())
def test_this_cpu_runs_as_each_kind_it_can_execute(kind: str, record_cpu_kind) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=_capped_env(kind),
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    ran_as, dtype, few_row_linear, quant_path, aten, native_built = json.loads(done.stdout.splitlines()[-1])
    assert native_built, "the C kernels did not build for this kind"
    assert (ran_as, dtype, few_row_linear, quant_path) == (kind, *EXPECTED[kind][:3])
    if kind != cpu_kind.detected():  # at the CPU's own kind, torch's dispatch is torch's own choice
        assert aten == EXPECTED[kind][3]
    record_cpu_kind(kind)


@pytest.mark.parametrize("kind", cpu_kind.executable()[:-1])
def test_the_kernels_tests_pass_as_each_lower_kind(kind: str, record_cpu_kind) -> None:
    """This CPU's own kind runs these files in the suite itself; each lower kind runs them here."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           *KERNEL_TESTS], cwd=ROOT, capture_output=True, text=True, env=_capped_env(kind),
                          timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:]
    record_cpu_kind(kind)
