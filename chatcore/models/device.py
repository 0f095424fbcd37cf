"""Which torch device the engine runs on, and the dtype `auto` means there.

`device` is `auto` (CUDA when torch sees a GPU, else the CPU), `cpu`, `cuda` or `cuda:N`. A
device that is asked for by name but is not there is a `DeviceUnavailable`, which the command
line turns into one line and exit code 2 before any model is loaded.
"""

from __future__ import annotations


import torch

from chatcore.kernels import cpu_kind
from chatcore.kv.tensors import DTYPES


class DeviceUnavailable(RuntimeError):
    pass


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise DeviceUnavailable(f"device {name}: only cpu and cuda[:N] are supported")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"device {name} is not available: this torch ({torch.__version__}) sees no CUDA device")
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceUnavailable(f"device {name} is not available: there {'is' if count == 1 else 'are'} "
                                f"{count} CUDA device{'' if count == 1 else 's'}")
    return torch.device("cuda", index)


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """`auto`: on CUDA, bfloat16 where the GPU supports it, else float16; on the CPU, bfloat16
    where it has native bf16 matmuls (measured faster), else float32."""
    if name != "auto":
        return DTYPES[name]
    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_kind.at_least("avx512bf16") else torch.float32
