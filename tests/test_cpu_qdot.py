"""kernels/cpu_qdot: few-row products on GGUF blocks with the activations quantized to 8-bit blocks.

The bound every product is held to, against the float32 reference (`dequantize` + a float64 matmul):
a row of x is quantized per block of 32 as d = max|x| / 127, q = round(x / d), so
|x_j - d q_j| <= d / 2 (0.51 d here, for the rounding of x * (1 / d)); an output's error from that is
at most sum_b 0.51 d_b sum_j |w_bj|. The float32 arithmetic after the integer products (scales
multiplied, ~in_features / 32 block terms and the min terms summed) adds at most 1e-5 of the sum of
the terms' magnitudes, sum_j (|d_w q_wj| + |m_w|) (|x_j| + d_b). bfloat16 outputs add their own
rounding, 2^-8 of the output. Each integer path this CPU runs is held to it, for every type, in
float32 and bfloat16; the C quantization equals torch's bit for bit; the AVX2 and VNNI paths give
the same bits (their integer sums are exact), also from a build for an AVX2-only CPU; the run-time
choice and `use_isa`'s forcing and refusal run on every CPU.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from chatcore.kernels import cpu_quant, native
from tests.test_cpu_quant import _build, built_path_equals_native, raw_blocks

QTYPES = ("Q4_0", "Q4_1", "Q8_0")
INTEGER_PATHS = ("avx512vnni", "avx2int8")
OUT, IN = 37, 160


def skip_unless_runs(path: str) -> None:
    if path not in cpu_quant.supported_isas():
        pytest.skip(f"this CPU/build does not run the {path} path (it runs {cpu_quant.supported_isas() or 'none'})")


def reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' 8-bit blocks as cpu_qdot.c computes them: quants [rows, k], scales and d * sum(q) [rows, k / 32]."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse[..., None])  # half to even, as the C's rounding mode
    return q.to(torch.int8).reshape(x.shape), scale, scale * q.sum(-1)


def weight_parts(raw: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """From GGUF's bytes: each weight's d * q' (q' = q - 8 for Q4_0) and its offset m (Q4_1), float64."""
    out_features = raw.shape[0]
    blocks = raw.reshape(out_features, -1, cpu_quant.block_bytes(qtype))
    d = blocks[..., :2].contiguous().view(torch.float16).double()
    if qtype == "Q8_0":
        q, m = blocks[..., 2:].view(torch.int8).double(), torch.zeros_like(d)
    else:
        quants = blocks[..., 4 if qtype == "Q4_1" else 2:]
        q = torch.cat([quants & 15, quants >> 4], dim=-1).double() - (8 if qtype == "Q4_0" else 0)
        m = blocks[..., 2:4].contiguous().view(torch.float16).double() if qtype == "Q4_1" else torch.zeros_like(d)
    return (d * q).reshape(out_features, -1), m.expand(*q.shape[:-1], 32).reshape(out_features, -1)


def bound(x: torch.Tensor, raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """The module docstring's bound for every output of x @ W^T."""
    scaled, offsets = weight_parts(raw, qtype)
    _, scale, _ = reference_quantize(x)
    step = scale.double().repeat_interleave(32, dim=-1)  # each element's d_b
    weights = scaled + offsets
    quantization = (0.51 * step) @ weights.abs().T
    arithmetic = 1e-5 * ((x.double().abs() + step) @ (scaled.abs() + offsets.abs()).T)
    return quantization + arithmetic


def test_the_c_quantization_equals_torchs_bit_for_bit() -> None:
    skip_unless_runs("avx2int8")
    x = torch.randn(3, IN) * torch.logspace(-3, 3, IN)
    x[1, :32] = 0  # an all-zero block: scale 0, quants 0
    x[2, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.0] * 26)  # ties: scale 1, half to even
    q, d, s = torch.empty(3, IN, dtype=torch.int8), torch.empty(3, IN // 32), torch.empty(3, IN // 32)
    native.library().chatcore_qdot_quantize(
        ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(3), ctypes.c_int64(IN), ctypes.c_void_p(q.data_ptr()),
        ctypes.c_void_p(d.data_ptr()), ctypes.c_void_p(s.data_ptr()))
    expected = reference_quantize(x)
    assert torch.equal(q, expected[0]) and torch.equal(d, expected[1]) and torch.equal(s, expected[2])
    assert q[2, :6].tolist() == [127, 0, 2, 2, 0, -2] and d[1, 0] == 0 and not q[1, :32].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 2, 5, 32])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", INTEGER_PATHS)
def test_integer_products_stay_within_the_8_bit_bound(path: str, qtype: str, rows: int, dtype: torch.dtype) -> None:
    skip_unless_runs(path)
    raw = raw_blocks(qtype, OUT, IN, seed=rows)
    laid_out = cpu_quant.lay_out(raw, qtype, OUT, IN)
    x = (torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    expected = x.double() @ cpu_quant.dequantize(laid_out).double().T
    y = cpu_quant._linear(x, laid_out, None, path)
    assert y.dtype == dtype and y.shape == (rows, OUT)
    limit = bound(x, raw, qtype)
    if dtype is torch.bfloat16:
        limit = limit + 2**-8 * (expected.abs() + limit)
    error = (y.double() - expected).abs()
    assert (error <= limit).all()
    assert error.max() > 0  # the activations were quantized: this is not the float path


@pytest.mark.parametrize("qtype", QTYPES)
def test_vnni_and_avx2_give_the_same_bits(qtype: str) -> None:
    skip_unless_runs("avx512vnni")
    laid_out = cpu_quant.lay_out(raw_blocks(qtype, 203, 576, seed=4), qtype, 203, 576)
    x = torch.randn(7, 576)
    assert torch.equal(cpu_quant._linear(x, laid_out, None, "avx512vnni"),
                       cpu_quant._linear(x, laid_out, None, "avx2int8"))


def test_q8_0_extremes_do_not_saturate() -> None:
    """Every weight -128 and every activation at +-127 after quantization: each pair of products is
    2 * 128 * 127 = 32,512, just inside maddubs' int16; the result is exact but for the float scale."""
    skip_unless_runs("avx2int8")
    raw = torch.zeros(8, 34, dtype=torch.uint8)
    raw[:, :2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    raw[:, 2:] = 0x80  # -128
    laid_out = cpu_quant.lay_out(raw, "Q8_0", 8, 32)
    x = torch.full((1, 32), -1.0)
    for path in [name for name in INTEGER_PATHS if name in cpu_quant.supported_isas()]:
        assert torch.equal(cpu_quant._linear(x, laid_out, None, path), torch.full((1, 8), 4096.0))


def test_use_isa_forces_each_path_this_cpu_runs_and_refuses_others() -> None:
    x, laid_out = torch.randn(2, IN), cpu_quant.lay_out(raw_blocks("Q4_1", OUT, IN), "Q4_1", OUT, IN)
    try:
        for path in (*cpu_quant.supported_isas(), "reference"):
            cpu_quant.use_isa(path)
            assert cpu_quant.isa() == path
            assert torch.equal(cpu_quant.linear(x, laid_out), cpu_quant._linear(x, laid_out, None, path))
        lacking = [path for path in cpu_quant.ISAS if path not in cpu_quant.supported_isas()] + ["avx9"]
        for path in lacking:
            with pytest.raises(ValueError, match=f"quant_isa={path}: this CPU and build run"):
                cpu_quant.use_isa(path)
            assert cpu_quant.isa() == "reference"  # a refusal changes nothing
    finally:
        cpu_quant.use_isa("auto")
    supported = cpu_quant.supported_isas()
    assert cpu_quant.isa() == (supported[0] if supported else "reference")


def test_the_best_path_is_an_integer_one_wherever_avx2_runs() -> None:
    if native.library() is None or "avx2int8" not in cpu_quant.supported_isas():
        assert cpu_quant.isa() in (*cpu_quant.supported_isas(), "reference")
        return
    assert cpu_quant.isa() in cpu_quant.INTEGER_ISAS


@pytest.mark.parametrize("qtype", QTYPES)
def test_an_avx2_only_build_gives_the_native_bits(tmp_path: Path, qtype: str) -> None:
    """Built for x86-64-v3 (no AVX-512 anywhere), the AVX2 integer path gives what the native build's
    integer paths give: what an AVX2 laptop runs is what the tests above check here."""
    skip_unless_runs("avx2int8")
    library = ctypes.CDLL(str(_build(tmp_path, "x86-64-v3", "cpu_qdot.c")))
    assert library.chatcore_qdot_supported(cpu_quant._ISA_CODES["avx2int8"]) == 1
    assert built_path_equals_native(library.chatcore_qdot_linear, "avx2int8", qtype)


def test_the_file_builds_for_a_cpu_without_avx(tmp_path: Path) -> None:
    library = ctypes.CDLL(str(_build(tmp_path, "x86-64", "cpu_qdot.c")))
    assert library.chatcore_qdot_supported(cpu_quant._ISA_CODES["avx2int8"]) in (0, 1)
    assert library.chatcore_qdot_supported(cpu_quant._ISA_CODES["avx2"]) == 0  # not an integer path
