"""The device setting: what `auto` picks, and a clear exit when a named device is missing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from chatcore.config import Settings
from chatcore.kernels import cpu_kind
from chatcore.models.device import DeviceUnavailable, resolve_device, resolve_dtype

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def test_auto_picks_cuda_only_where_torch_sees_it() -> None:
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_the_setting_takes_only_known_devices() -> None:
    for good in ("auto", "cpu", "cuda", "cuda:1"):
        assert Settings(device=good).device == good
    for bad in ("gpu", "cuda:", "mps", "cuda:x"):
        with pytest.raises(ValueError):
            Settings(device=bad)


def test_auto_dtype_on_the_cpu_follows_its_bf16_support() -> None:
    native = cpu_kind.kind() in ("avx512bf16", "amx")  # under any CHATCORE_CPU_ISA cap
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("float16", "cpu") == torch.float16


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_a_missing_cuda_device_is_named(name: str) -> None:
    with pytest.raises(DeviceUnavailable, match=f"device {name} is not available"):
        resolve_device(name)


@no_cuda
@pytest.mark.parametrize("argv, env", [
    (["generate", "--device", "cuda", "--prompt", "Hi"], {}),
    (["serve"], {"CHATCORE_DEVICE": "cuda:0"}),
    (["bench", "--suite", "throughput", "--quick", "--device", "cuda"], {}),
])
def test_the_cli_exits_2_with_one_line_naming_the_device(tmp_path, argv: list[str], env: dict[str, str]) -> None:
    inherited = {k: v for k, v in os.environ.items() if k != "CHATCORE_DEVICE"}  # conftest sets cpu
    environ = {**inherited, "CHATCORE_DATA_DIR": str(tmp_path), **env}
    done = subprocess.run([sys.executable, "-m", "chatcore.cli", *argv], env=environ, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "cuda" in lines[0] and "not available" in lines[0]
    assert done.stdout == ""


@no_cuda
def test_gpu_check_says_in_one_line_that_there_is_no_gpu(tmp_path) -> None:
    report = tmp_path / "gpu-check.json"
    done = subprocess.run([sys.executable, "-m", "chatcore.bench.gpu_check", "--out", str(report)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done
    assert done.stdout.strip().splitlines() == [f"gpu-check: skipped, no CUDA device (torch {torch.__version__} sees none)"]
    assert not report.exists()
