"""A decoder layer's bfloat16 pointwise steps in C (`kernels/cpu_pointwise.c`).

At a decode step's few rows each of these is a few microseconds of arithmetic behind a handful of
torch ops (RMSNorm alone is seven), each a dispatch of several microseconds, and at many rows
torch runs each op as a pass over memory: one C call, one pass, replaces them.
The results are transformers' Llama modules' in bfloat16, rounded where torch rounds; the order
of RMSNorm's sum and the last bit of `expf` may differ from torch's, so an output may differ in
its last bit (chatcore/models/fused_layer.py checks them against the modules at load).
The tensors are checked for what the C code reads (dtype, device, contiguity, shapes): it trusts
its arguments.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from chatcore.kernels import native

PROFILER_NAMES = {  # how each call shows in torch.profiler (bench/step_ops.py)
    "chatcore_rms_norm_bf16": "kernels::rms_norm_bf16_c",
    "chatcore_rope_bf16": "kernels::rope_bf16_c",
    "chatcore_silu_mul_bf16": "kernels::silu_mul_bf16_c",
}
MAX_HEAD_DIM = 1024  # kernels/cpu_pointwise.c's RoPE buffers
_INT = ctypes.c_int64
_PTR = ctypes.c_void_p
_SIGNATURES = {
    "chatcore_rms_norm_bf16": (_PTR, _PTR, _PTR, _INT, _INT, ctypes.c_float, ctypes.c_int),
    "chatcore_rope_bf16": (_PTR, _PTR, _PTR, _INT, _INT, _INT, _INT, ctypes.c_int),
    "chatcore_silu_mul_bf16": (_PTR, _PTR, _INT, _INT, ctypes.c_int),
}


@functools.cache
def _functions() -> dict[str, ctypes._CFuncPtr] | None:
    loaded = native.library()
    if loaded is None:
        return None
    functions = {}
    for name, argtypes in _SIGNATURES.items():
        function = getattr(loaded, name)
        function.argtypes = argtypes
        function.restype = None
        functions[name] = function
    return functions


def available() -> bool:
    """Whether the C library (built on the first call) is here."""
    return _functions() is not None


def _check(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.bfloat16 or tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor, not {tensor.dtype} on {tensor.device}"
                         f"{'' if tensor.is_contiguous() else ', strided'}")


def _call(name: str, *args: object) -> None:
    functions = _functions()
    if functions is None:
        raise RuntimeError("the C kernels are not built here (kernels/native.py logged why)")
    with native.traced(PROFILER_NAMES[name]):
        functions[name](*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of each row of `x` [..., dim]: `weight * bf16(x * rsqrt(mean(x^2) + eps))`."""
    _check("x", x)
    _check("weight", weight)
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match rows of {dim}")
    out = torch.empty_like(x)
    _call("chatcore_rms_norm_bf16", x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(dim, 1),
          dim, eps, torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """RoPE in place on the first `heads` heads of each row of `x` [rows, width] (the rest untouched):
    `v * cos + rotate_half(v) * sin`, with `cos` and `sin` [rows, head_dim]. Returns `x`."""
    _check("x", x)
    _check("cos", cos)
    _check("sin", sin)
    rows, width = x.shape
    if head_dim % 2 or not 0 < head_dim <= MAX_HEAD_DIM or heads * head_dim > width \
            or cos.shape != (rows, head_dim) or sin.shape != (rows, head_dim):
        raise ValueError(f"RoPE of {heads} heads of {head_dim} over rows {tuple(x.shape)} with cos "
                         f"{tuple(cos.shape)} and sin {tuple(sin.shape)}")
    _call("chatcore_rope_bf16", x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, width, heads, head_dim,
          torch.get_num_threads())
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`bf16(silu(gate)) * up` for rows of `gate_up` [rows, 2 * inter] holding [gate | up]."""
    _check("gate_up", gate_up)
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up rows hold gate and up side by side: an even width, not {width}")
    out = torch.empty(rows, width // 2, dtype=torch.bfloat16)
    _call("chatcore_silu_mul_bf16", gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out
