"""A decoder layer's bfloat16 pointwise steps in C (`kernels/cpu_pointwise.c`).

At a decode step's few rows each of these is a few microseconds of arithmetic behind a handful of
torch ops (RMSNorm alone is seven), each a dispatch of several microseconds, and at many rows
torch runs each op as a pass over memory: one C call, one pass, replaces them.
The results are transformers' Llama modules' in bfloat16, rounded where torch rounds; the order
of RMSNorm's sum and the last bit of `expf` may differ from torch's, so an output may differ in
its last bit (chatcore/models/fused_layer.py checks them against the modules at load).
The tensors are checked for what the C code reads (dtype, device, contiguity, shapes, an even
address for its uint16_t reads) on every call, from metadata alone: it trusts its arguments.
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


def _address(name: str, tensor: torch.Tensor) -> int:
    """The data's address of a tensor the C may read as uint16_t rows: contiguous bfloat16 on the
    CPU, at an even address; ValueError otherwise."""
    if tensor.dtype is not torch.bfloat16 or not tensor.is_cpu or not tensor.is_contiguous():
        raise ValueError(f"{name} must be a contiguous bfloat16 CPU tensor, not {tensor.dtype} on {tensor.device}"
                         f"{'' if tensor.is_contiguous() else ', strided'}")
    address = tensor.data_ptr()
    if address & 1:
        raise ValueError(f"{name} must start at a 2-byte boundary (the C reads uint16_t)")
    return address


def _call(name: str, *args: object) -> None:
    functions = _functions()
    if functions is None:
        raise RuntimeError("the C kernels are not built here (kernels/native.py logged why)")
    with native.traced(PROFILER_NAMES[name]):
        functions[name](*args)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of each row of `x` [..., dim]: `weight * bf16(x * rsqrt(mean(x^2) + eps))`."""
    x_at, weight_at = _address("x", x), _address("weight", weight)
    shape = x.shape
    if not shape or weight.shape != shape[-1:]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match rows of x {tuple(shape)}")
    dim = shape[-1]
    out = torch.empty_like(x)
    _call("chatcore_rms_norm_bf16", x_at, weight_at, out.data_ptr(), x.numel() // max(dim, 1), dim, eps,
          torch.get_num_threads())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """RoPE in place on the first `heads` heads of each row of `x` [rows, width] (the rest untouched):
    `v * cos + rotate_half(v) * sin`, with `cos` and `sin` [rows, head_dim]. Returns `x`."""
    x_at, cos_at, sin_at = _address("x", x), _address("cos", cos), _address("sin", sin)
    shape = x.shape
    if len(shape) != 2 or head_dim % 2 or not 0 < head_dim <= MAX_HEAD_DIM or not 0 <= heads * head_dim <= shape[1] \
            or cos.shape != (shape[0], head_dim) or sin.shape != (shape[0], head_dim):
        raise ValueError(f"RoPE of {heads} heads of {head_dim} over rows {tuple(shape)} with cos "
                         f"{tuple(cos.shape)} and sin {tuple(sin.shape)}")
    rows, width = shape
    _call("chatcore_rope_bf16", x_at, cos_at, sin_at, rows, width, heads, head_dim, torch.get_num_threads())
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`bf16(silu(gate)) * up` for rows of `gate_up` [rows, 2 * inter] holding [gate | up]."""
    gate_up_at = _address("gate_up", gate_up)
    shape = gate_up.shape
    if len(shape) != 2 or shape[1] % 2:
        raise ValueError(f"gate_up must be [rows, 2 * inter] holding gate and up side by side: an even width, "
                         f"not {tuple(shape)}")
    rows, width = shape
    out = torch.empty(rows, width // 2, dtype=torch.bfloat16)
    _call("chatcore_silu_mul_bf16", gate_up_at, out.data_ptr(), rows, width // 2, torch.get_num_threads())
    return out
