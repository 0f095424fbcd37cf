"""The few-row bfloat16 linear in C (`kernels/cpu_linear.c`): a decode step's matrix-vector products.

A decode step of one to `MAX_ROWS` sequences multiplies every weight of the model by that many
rows. oneDNN's packed bfloat16 GEMM, which serves every other row count, reads the weights of
such a product at well under the memory's bandwidth; this kernel streams them. Measured on the
2-core AMX Xeon (2 threads, bfloat16), the 211 linears of SmolLM2-135M (269 MB; a 512 MiB copy
moves 25-28 GB/s, about 10 ms for these bytes), called through their modules: at one row 22.0 ms
against oneDNN's 30.0, at 4 rows 26.8 against 30.3 (the bare C calls: 15-18 ms at one row; the
rest is each call's Python). From about 8 rows oneDNN (AMX) is as fast, hence `MAX_ROWS`.

The kernel needs AVX512-BF16 (`available()` says whether the build has it) and its own copy of
each weight, laid out by `lay_out`: groups of output rows interleaved 32 columns at a time, so
a thread reads one sequential stream. The products are float32 sums rounded to bfloat16, as
oneDNN's are, but summed in another order: the last bit of an output may differ from oneDNN's.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from chatcore.kernels import native

PROFILER_NAME = "kernels::linear_bf16_c"  # how a call shows in torch.profiler (bench/step_ops.py)
MAX_ROWS = 4
COLUMNS = 32  # the columns one `vdpbf16ps` takes: a weight's input size must be a multiple
_BF16 = torch.bfloat16
_ARGTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
             ctypes.c_int64, ctypes.c_int64, ctypes.c_int)


@functools.cache
def _kernel() -> tuple[Callable[..., None], int] | None:
    """The C function and its rows per group, or None where the library lacks it (no AVX512-BF16)."""
    loaded = native.library()
    if loaded is None:
        return None
    rows = loaded.chatcore_linear_rows_per_group()
    if rows == 0:
        return None
    function = loaded.chatcore_linear_bf16
    function.argtypes = _ARGTYPES
    function.restype = None
    return function, rows


def available() -> bool:
    """Whether this CPU and build run the few-row linear (builds the C library on the first call)."""
    return _kernel() is not None


def lay_out(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` ([out, in], bfloat16, on the CPU) in the kernel's layout, padded with zero rows to
    whole groups; None when the kernel cannot take it (not available, or `in` not a positive multiple of 32)."""
    kernel = _kernel()
    out_features, in_features = weight.shape
    if (kernel is None or in_features % COLUMNS or not in_features or weight.dtype != torch.bfloat16
            or weight.device.type != "cpu"):
        return None
    rows = kernel[1]
    groups = -(-out_features // rows)
    padded = torch.zeros(groups * rows, in_features, dtype=weight.dtype)
    padded[:out_features] = weight.detach()
    return padded.view(groups, rows, in_features // COLUMNS, COLUMNS).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, laid_out: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bfloat16 `x` of at most `MAX_ROWS` rows, `laid_out` from `lay_out(weight)`;
    with `residual` (bfloat16, the output's shape), `residual + F.linear(...)`, each rounded as torch rounds.

    Raises ValueError for what the C trusts and these do not give (checked from metadata alone,
    before anything runs): a `laid_out` not in `lay_out`'s layout, an `out_features` its groups do
    not hold, a `bias` not [out_features], `x` rows not bfloat16 of the weight's input size, more
    than `MAX_ROWS` rows, a `residual` not of the output's shape; all on the CPU, the bias and the
    residual at even addresses (read as uint16_t; `x` and the weight with unaligned vector loads).
    RuntimeError where the kernel is not available."""
    rows, in_features, group_rows, out_shape = _checked_shapes(x, laid_out, out_features, bias, residual)
    bias_at = residual_at = 0  # NULL: none
    if bias is not None:
        bias = bias.detach().to(_BF16).contiguous()
        bias_at = bias.data_ptr()
    if residual is not None:
        residual = residual.contiguous()
        residual_at = residual.data_ptr()
    if (bias_at | residual_at) & 1:
        raise ValueError("the bias and the residual must start at 2-byte boundaries (the C reads uint16_t)")
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the C few-row linear is not available here (it needs AVX512-BF16)")
    if group_rows != kernel[1]:
        raise ValueError(f"laid_out has groups of {group_rows} rows, the C linear reads groups of {kernel[1]}")
    x = x.contiguous()
    out = torch.empty(out_shape, dtype=_BF16)
    with native.traced(PROFILER_NAME):
        kernel[0](x.data_ptr(), laid_out.data_ptr(), bias_at or None, residual_at or None, out.data_ptr(), rows,
                  out_features, in_features, torch.get_num_threads())
    return out


def _checked_shapes(x: torch.Tensor, laid_out: torch.Tensor, out_features: int, bias: torch.Tensor | None,
                    residual: torch.Tensor | None) -> tuple[int, int, int, tuple[int, ...]]:
    """`linear`'s metadata checks, in its order: (rows, in_features, rows per group, the output's shape)."""
    weight_shape = laid_out.shape
    if (len(weight_shape) != 4 or weight_shape[3] != COLUMNS or not weight_shape[1] or laid_out.dtype is not _BF16
            or not laid_out.is_cpu or not laid_out.is_contiguous()):
        raise ValueError(f"laid_out must be lay_out's contiguous bfloat16 [groups, in / {COLUMNS}, rows, {COLUMNS}] "
                         f"on the CPU, not {laid_out.dtype} {tuple(weight_shape)} on {laid_out.device}")
    groups, steps, group_rows, _ = weight_shape
    if not (groups - 1) * group_rows < out_features <= groups * group_rows:
        raise ValueError(f"out_features {out_features} does not match the laid-out weight's {groups} groups of "
                         f"{group_rows} rows")
    in_features, x_shape = steps * COLUMNS, x.shape
    if not x_shape or x_shape[-1] != in_features or x.dtype is not _BF16 or not x.is_cpu:
        raise ValueError(f"the C linear takes bfloat16 rows of {in_features} features on the CPU, not "
                         f"{tuple(x_shape)} {x.dtype} on {x.device}")
    rows = x.numel() // in_features
    if rows > MAX_ROWS:
        raise ValueError(f"the C linear takes at most {MAX_ROWS} rows, not {rows}")
    if bias is not None and (bias.shape != (out_features,) or not bias.is_cpu):
        raise ValueError(f"the bias must be [{out_features}] on the CPU, not {tuple(bias.shape)} on {bias.device}")
    out_shape = (*x_shape[:-1], out_features)
    if residual is not None and (residual.shape != out_shape or residual.dtype is not _BF16 or not residual.is_cpu):
        raise ValueError(f"the residual must be bfloat16 {out_shape} on the CPU, not {residual.dtype} "
                         f"{tuple(residual.shape)} on {residual.device}")
    return rows, in_features, group_rows, out_shape
