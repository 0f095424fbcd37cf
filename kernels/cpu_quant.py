"""Linear layers served from GGUF's own quantized blocks (Q4_0, Q4_1, Q8_0) on the CPU (`kernels/cpu_quant.c`).

The interface the GGUF loader (chatcore/models/gguf_weights.py) uses:
`lay_out` takes a GGUF tensor's bytes as they lie in the file and returns a `QuantWeight` in the
kernel's layout (groups of `ROWS` output rows, each 32-column block's scales, mins and quants side
by side: one sequential stream per thread, exactly the file's bytes); `linear` multiplies by it
and `dequantize` gives the weights it stands for, exactly as GGUF's reference computes them in
float32 (`d * q`, then `+ m`, each rounded once).

`linear` takes float32 or bfloat16 rows and returns the same dtype, accumulating in float32:
- up to `FEW_ROWS` rows (decode), on the best path this CPU has (`isa()`, found at run time), with
  `torch.get_num_threads()` threads; outputs do not depend on the thread count. The integer paths
  (`kernels/cpu_qdot.c`: AVX512-VNNI, else AVX2) quantize each row once to 8-bit blocks of 32 and
  take each block's product in integers; the float paths (`kernels/cpu_quant.c`: AVX512-BF16,
  AVX-512F, AVX2 + FMA) dequantize each block in registers and stay the float32 reference and the
  fallback. `use_isa` (the `quant_isa` setting) forces a lower path;
- more rows (prefill): the C dequantizes the weight once per call into the activations' dtype
  (a bfloat16 weight rounds each float32 weight once), and torch's GEMM (oneDNN; AMX where the
  CPU has it) multiplies every row by it: measured 3-7x faster than a tile at a time written into
  the output's columns (torch.mm into a strided `out` is slow);
- no C path (no compiler, or a CPU with none of these ISAs): `isa()` is "reference", and the
  weights are dequantized in torch and multiplied in float32 (correct, slow).

docs/kernels.md ("GGUF blocks") has the measurements behind these choices, against torch's own
int4 kernel. Every call checks, from metadata alone, everything the C trusts, and raises
ValueError naming what is wrong before any C runs.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chatcore.kernels import cpu_kind, native

PROFILER_NAME = "kernels::quant_linear_c"  # how a call shows in torch.profiler
QTYPES = frozenset({"Q4_0", "Q4_1", "Q8_0"})
BLOCK = 32  # weights per block
ROWS = 8  # output rows per group of the layout (cpu_quant.c's ROWS; checked when the library loads)
FEW_ROWS = 32  # up to this many rows the C kernel multiplies (measured faster at 32); more: dequantize + GEMM
ISAS = ("avx512vnni", "avx2int8", "avx512bf16", "avx512f", "avx2")  # the C paths, best first; or "reference"
INTEGER_ISAS = frozenset({"avx512vnni", "avx2int8"})  # cpu_qdot.c: activations quantized to 8-bit blocks
_ISA_CODES = {"avx2": 1, "avx512f": 2, "avx512bf16": 3, "avx2int8": 4, "avx512vnni": 5}
MIN_KIND = {"avx512vnni": "avx512bf16", "avx2int8": "avx2", "avx512bf16": "avx512bf16", "avx512f": "avx512f",
            "avx2": "avx2"}  # the lowest CPU kind (kernels/cpu_kind.py) each path belongs to
_FLOAT_CHAIN = ("avx512bf16", "avx512f", "avx2")  # each float path's CPU runs the ones after it
_QTYPE_CODES = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}
_SCALE_BYTES = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}  # per block: d (fp16), and m for Q4_1
_QUANT_BYTES = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 32}
_DTYPES = (torch.float32, torch.bfloat16)
_LINEAR_ARGS = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int)
_DEQUANTIZE_ARGS = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                    ctypes.c_int64, ctypes.c_int)


def block_bytes(qtype: str) -> int:
    """Bytes of one GGUF block of `qtype` (32 weights): Q4_0 18, Q4_1 20, Q8_0 34."""
    _check_qtype(qtype)
    return _SCALE_BYTES[qtype] + _QUANT_BYTES[qtype]


@dataclass(frozen=True)
class QuantWeight:
    """One linear's weight [out_features, in_features] in the kernel's layout (`lay_out`): `data` is
    uint8, ceil(out_features / ROWS) groups of in_features / 32 stripes, zero rows padding the last group."""

    qtype: str
    out_features: int
    in_features: int
    data: torch.Tensor

    def nbytes(self) -> int:
        """Bytes a full product reads (the file's bytes, plus the padding rows' zeros)."""
        return self.data.numel()


@dataclass(frozen=True)
class _Kernel:
    linear: Callable[..., int]
    qdot: Callable[..., int]  # cpu_qdot.c's integer products, the same arguments as `linear`
    dequantize: Callable[..., None]
    supported: tuple[str, ...]  # the paths of `ISAS` this CPU runs, best first


def _check_qtype(qtype: str) -> None:
    if qtype not in QTYPES:
        raise ValueError(f"quantization type {qtype!r} is not supported: supported are {', '.join(sorted(QTYPES))}")


def _laid_out_bytes(qtype: str, out_features: int, in_features: int) -> int:
    return -(-out_features // ROWS) * ROWS * (in_features // BLOCK) * block_bytes(qtype)


@functools.cache
def _kernel() -> _Kernel | None:
    """The C functions and the best ISA, or None where the library cannot be built."""
    loaded = native.library()
    if loaded is None:
        return None
    if loaded.chatcore_quant_rows_per_group() != ROWS:
        raise RuntimeError(f"cpu_quant.c groups {loaded.chatcore_quant_rows_per_group()} rows, cpu_quant.py {ROWS}")
    function, qdot, dequantize_function = loaded.chatcore_quant_linear, loaded.chatcore_qdot_linear, \
        loaded.chatcore_quant_dequantize
    function.argtypes, function.restype = _LINEAR_ARGS, ctypes.c_int
    qdot.argtypes, qdot.restype = _LINEAR_ARGS, ctypes.c_int
    dequantize_function.argtypes, dequantize_function.restype = _DEQUANTIZE_ARGS, None
    codes = {code: name for name, code in _ISA_CODES.items()}
    best = codes.get(loaded.chatcore_quant_best_isa())
    floats = _FLOAT_CHAIN[_FLOAT_CHAIN.index(best):] if best is not None else ()
    integers = tuple(name for name in ISAS if name in INTEGER_ISAS and loaded.chatcore_qdot_supported(_ISA_CODES[name]))
    return _Kernel(function, qdot, dequantize_function, (*integers, *floats))


_forced: list[str] = []  # the path `use_isa` chose, when one was forced


def use_isa(name: str) -> None:
    """Serve `linear` on path `name` ("auto": the best this CPU runs; "reference": torch's float32).
    Raises ValueError, changing nothing, for a path this CPU and build do not run."""
    if name not in ("auto", "reference") and name not in supported_isas():
        raise ValueError(f"quant_isa={name}: this CPU and build run {', '.join(supported_isas()) or 'no C path'} "
                         f"(or reference, auto)")
    _forced[:] = [] if name == "auto" else [name]


def isa() -> str:
    """The path `linear` takes here: the one `use_isa` forced, else the best of `supported_isas()`,
    else "reference"."""
    if _forced:
        return _forced[0]
    supported = supported_isas()
    return supported[0] if supported else "reference"


def supported_isas() -> tuple[str, ...]:
    """Every C path of `ISAS` this CPU and build run, best first; empty where none. Under a
    `CHATCORE_CPU_ISA` cap below this CPU (kernels/cpu_kind.py), only the paths of that kind
    (`MIN_KIND`): the AVX-512F kind without VNNI, as the team's machine of that kind."""
    kernel = _kernel()
    if kernel is None:
        return ()
    if cpu_kind.kind() == cpu_kind.detected():
        return kernel.supported
    return tuple(name for name in kernel.supported if cpu_kind.at_least(MIN_KIND[name]))


def lay_out(raw: torch.Tensor, qtype: str, out_features: int, in_features: int) -> QuantWeight:
    """A GGUF tensor's bytes (uint8 [out_features, in_features // 32 * block_bytes(qtype)], row i
    output feature i, as in the file) in the kernel's layout. Raises ValueError naming the problem."""
    _check_qtype(qtype)
    if in_features <= 0 or in_features % BLOCK or out_features <= 0:
        raise ValueError(f"{qtype} weights need in_features a positive multiple of {BLOCK} and out_features > 0, "
                         f"not [{out_features}, {in_features}]")
    row_bytes = in_features // BLOCK * block_bytes(qtype)
    if raw.dtype != torch.uint8 or raw.device.type != "cpu" or raw.numel() != out_features * row_bytes:
        raise ValueError(f"a {qtype} [{out_features}, {in_features}] weight is {out_features * row_bytes} bytes "
                         f"(uint8 on the CPU), not {raw.numel()} {raw.dtype} on {raw.device}")
    groups, blocks, scales = -(-out_features // ROWS), in_features // BLOCK, _SCALE_BYTES[qtype]
    padded = torch.zeros(groups * ROWS, blocks, block_bytes(qtype), dtype=torch.uint8)
    padded[:out_features] = raw.reshape(out_features, blocks, block_bytes(qtype))
    by_block = padded.view(groups, ROWS, blocks, -1).transpose(1, 2)  # [groups, blocks, ROWS, block bytes]
    parts = [by_block[..., :2], by_block[..., 2:scales], by_block[..., scales:]]  # d, m (Q4_1), quants
    stripes = torch.cat([part.reshape(groups, blocks, -1) for part in parts if part.shape[-1]], dim=-1)
    return QuantWeight(qtype, out_features, in_features, stripes.reshape(-1).contiguous())


def _checked(weight: QuantWeight) -> QuantWeight:
    """`weight` when its data is what `lay_out` gives for its type and shape (else ValueError): the C reads it all."""
    _check_qtype(weight.qtype)
    data, expected = weight.data, _laid_out_bytes(weight.qtype, weight.out_features, weight.in_features)
    if weight.out_features <= 0:
        raise ValueError(f"a {weight.qtype} weight needs out_features >= 1, not {weight.out_features}")
    if (weight.in_features <= 0 or weight.in_features % BLOCK or data.dtype != torch.uint8 or not data.is_cpu
            or data.numel() != expected or not data.is_contiguous()):
        raise ValueError(f"a {weight.qtype} [{weight.out_features}, {weight.in_features}] weight must be lay_out's "
                         f"{expected} contiguous uint8 bytes on the CPU, not {data.numel()} {data.dtype} on {data.device}")
    return weight


def _reference_dequantize(weight: QuantWeight) -> torch.Tensor:
    """The weights in float32 from the layout, in torch: d * q, then + m (GGUF's order, each rounded once)."""
    qtype, blocks = weight.qtype, weight.in_features // BLOCK
    stripes = weight.data.view(-1, blocks, ROWS * block_bytes(qtype))
    scales = stripes[..., :ROWS * 2].contiguous().view(torch.float16).float()  # [groups, blocks, ROWS]
    quants = stripes[..., ROWS * _SCALE_BYTES[qtype]:].reshape(*scales.shape, -1)
    if qtype == "Q8_0":
        values = quants.view(torch.int8).float() * scales[..., None]
    else:
        q = torch.cat([quants & 15, quants >> 4], dim=-1).float()
        if qtype == "Q4_0":
            values = (q - 8) * scales[..., None]
        else:
            mins = stripes[..., ROWS * 2:ROWS * 4].contiguous().view(torch.float16).float()
            values = q * scales[..., None] + mins[..., None]
    return values.transpose(1, 2).reshape(-1, weight.in_features)[:weight.out_features]


def dequantize(weight: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weights [out_features, in_features] as GGUF's reference dequantizes them (exact in
    float32; bfloat16 rounds each float32 weight once, to nearest even)."""
    _checked(weight)
    if dtype not in _DTYPES:
        raise ValueError(f"dequantize gives float32 or bfloat16, not {dtype}")
    kernel = _kernel()
    if kernel is None:
        return _reference_dequantize(weight).to(dtype)
    out = torch.empty(weight.out_features, weight.in_features, dtype=dtype)
    _dequantize_rows(kernel, weight, out, 0)
    return out


def _dequantize_rows(kernel: _Kernel, weight: QuantWeight, out: torch.Tensor, first: int) -> None:
    """Rows [first, first + len(out)) of the weight into `out` (contiguous, float32 or bfloat16), in C."""
    kernel.dequantize(weight.data.data_ptr(), out.data_ptr(), int(out.dtype is torch.bfloat16),
                      _QTYPE_CODES[weight.qtype], first, out.shape[0], weight.in_features, torch.get_num_threads())


def _checked_rows(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None) -> None:
    """ValueError for activations or a bias the products cannot take (metadata only)."""
    shape = x.shape
    if x.dtype not in _DTYPES or not x.is_cpu or not shape or shape[-1] != weight.in_features:
        raise ValueError(f"the quantized linear takes float32 or bfloat16 rows of {weight.in_features} features on "
                         f"the CPU, not {tuple(shape)} {x.dtype} on {x.device}")
    if x.numel() == 0:
        raise ValueError(f"the quantized linear takes at least one row, not {tuple(shape)}")
    if bias is not None and (tuple(bias.shape) != (weight.out_features,) or not bias.is_cpu):
        raise ValueError(f"the bias must be [{weight.out_features}] on the CPU, not {tuple(bias.shape)} on {bias.device}")


def linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` for x [..., in_features] float32 or bfloat16 on the CPU, in x's dtype,
    accumulated in float32, on the path `isa()` names (module docstring)."""
    return _linear(x, weight, bias, isa())


def _linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None, path: str) -> torch.Tensor:
    """`linear` on a named path: one of `supported_isas()`, or "reference" (the tests run each)."""
    _checked(weight)
    _checked_rows(x, weight, bias)
    if path != "reference" and path not in supported_isas():
        raise ValueError(f"this CPU and build do not run the {path!r} path: they run {supported_isas() or 'none'}")
    rows = x.numel() // weight.in_features
    if path == "reference":
        out = (x.reshape(rows, -1).float() @ _reference_dequantize(weight).T).to(x.dtype)
    elif rows <= FEW_ROWS:
        out = _few_rows(x.reshape(rows, -1).contiguous(), weight, path)
    else:
        out = _many_rows(x.reshape(rows, -1), weight)
    if bias is not None:
        out = out.add_(bias.to(out.dtype))
    return out.view(*x.shape[:-1], weight.out_features)


def _few_rows(x: torch.Tensor, weight: QuantWeight, path: str) -> torch.Tensor:
    kernel = _kernel()
    assert kernel is not None  # a supported path implies a loaded library
    rows = x.shape[0]
    out = torch.empty(rows, weight.out_features, dtype=x.dtype)
    function = kernel.qdot if path in INTEGER_ISAS else kernel.linear
    with native.traced(PROFILER_NAME):
        failed = function(x.data_ptr(), weight.data.data_ptr(), out.data_ptr(), int(x.dtype is torch.bfloat16),
                               _QTYPE_CODES[weight.qtype], _ISA_CODES[path], rows, weight.out_features,
                               weight.in_features, torch.get_num_threads())
    if failed:
        raise MemoryError(f"the quantized linear could not allocate {rows} rows of {weight.in_features} floats")
    return out


def _many_rows(x: torch.Tensor, weight: QuantWeight) -> torch.Tensor:
    """The whole weight dequantized once (C) into x's dtype, then one torch GEMM over every row of x.
    Measured faster than a tile at a time into the output's columns (docs/kernels.md, "GGUF blocks")."""
    kernel = _kernel()
    assert kernel is not None
    tile = torch.empty(weight.out_features, weight.in_features, dtype=x.dtype)
    _dequantize_rows(kernel, weight, tile, 0)
    return F.linear(x, tile)
