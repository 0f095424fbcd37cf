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
    whole groups; None when the kernel cannot take it (not available, or `in` not a multiple of 32)."""
    kernel = _kernel()
    out_features, in_features = weight.shape
    if kernel is None or in_features % COLUMNS or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return None
    rows = kernel[1]
    groups = -(-out_features // rows)
    padded = torch.zeros(groups * rows, in_features, dtype=weight.dtype)
    padded[:out_features] = weight.detach()
    return padded.view(groups, rows, in_features // COLUMNS, COLUMNS).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, laid_out: torch.Tensor, out_features: int, bias: torch.Tensor | None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bfloat16 `x` of at most `MAX_ROWS` rows, `laid_out` from `lay_out(weight)`;
    with `residual` (bfloat16, the output's shape), `residual + F.linear(...)`, each rounded as torch rounds."""
    kernel = _kernel()
    in_features = laid_out.shape[1] * COLUMNS
    if kernel is None or x.shape[-1] != in_features or x.dtype != torch.bfloat16:
        raise ValueError(f"the C linear takes bfloat16 rows of {in_features} features, not {tuple(x.shape)} {x.dtype}")
    rows = x.numel() // in_features
    if rows > MAX_ROWS:
        raise ValueError(f"the C linear takes at most {MAX_ROWS} rows, not {rows}")
    x = x.contiguous()
    bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()
    out = torch.empty(*x.shape[:-1], out_features, dtype=torch.bfloat16)
    if residual is not None:
        if residual.shape != out.shape or residual.dtype != torch.bfloat16 or residual.device.type != "cpu":
            raise ValueError(f"the residual must be bfloat16 {tuple(out.shape)}, not {residual.dtype} "
                             f"{tuple(residual.shape)}")
        residual = residual.contiguous()
    with native.traced(PROFILER_NAME):
        kernel[0](x.data_ptr(), laid_out.data_ptr(), None if bias is None else bias.data_ptr(),
                  None if residual is None else residual.data_ptr(), out.data_ptr(), rows, out_features, in_features,
                  torch.get_num_threads())
    return out
