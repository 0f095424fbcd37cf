"""kernels/cpu_quant: linears and dequantization on GGUF's own Q4_0 / Q4_1 / Q8_0 blocks.

Every float C path this CPU runs (AVX512-BF16, AVX-512F, AVX2) and the torch reference, for every type,
at few and many rows, in float32 and bfloat16, against `dequantize` + a float32 matmul; `dequantize`
against the gguf package's own; outputs independent of the thread count; refusals; the run-time
choice against /proc/cpuinfo; and the file built for an AVX2-only target, whose AVX2 path runs here.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from chatcore.kernels import cpu_kind, cpu_quant, native

QTYPES = ("Q4_0", "Q4_1", "Q8_0")
PATHS = (*cpu_quant._FLOAT_CHAIN, "reference")  # the float paths; the integer ones: tests/test_cpu_qdot.py
OUT, IN = 37, 160  # 37: a last group of 5 live rows and 3 padding rows; 160: five blocks


def raw_blocks(qtype: str, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """GGUF bytes of random blocks: any quants, finite fp16 scales (and mins) of both signs."""
    generator = torch.Generator().manual_seed(seed)
    blocks = out_features * in_features // 32
    raw = torch.randint(0, 256, (blocks, cpu_quant.block_bytes(qtype)), dtype=torch.uint8, generator=generator)
    scales = (torch.randn(blocks, 2, generator=generator) * 0.05).half().view(torch.uint8)
    width = 4 if qtype == "Q4_1" else 2
    raw[:, :width] = scales[:, :width]
    return raw.view(out_features, -1)


def weight(qtype: str, out_features: int = OUT, in_features: int = IN, seed: int = 0) -> cpu_quant.QuantWeight:
    return cpu_quant.lay_out(raw_blocks(qtype, out_features, in_features, seed), qtype, out_features, in_features)


def skip_unless_runs(path: str) -> None:
    if path != "reference" and path not in cpu_quant.supported_isas():
        pytest.skip(f"this CPU/build does not run the {path} path (it runs {cpu_quant.supported_isas() or 'none'})")


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_gguf_bit_for_bit(qtype: str) -> None:
    raw = raw_blocks(qtype, OUT, IN, seed=1)
    expected = torch.from_numpy(gguf_dequantize(raw.numpy(), gguf.GGMLQuantizationType[qtype]))
    laid_out = cpu_quant.lay_out(raw, qtype, OUT, IN)
    assert laid_out.nbytes() == 40 * IN // 32 * cpu_quant.block_bytes(qtype)  # 37 rows padded to 40
    assert torch.equal(cpu_quant.dequantize(laid_out), expected)
    assert torch.equal(cpu_quant._reference_dequantize(laid_out), expected)
    assert torch.equal(cpu_quant.dequantize(laid_out, torch.bfloat16), expected.bfloat16())


def test_block_bytes_are_ggufs() -> None:
    sizes = {name: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] for name in QTYPES}
    assert {name: (cpu_quant.BLOCK, cpu_quant.block_bytes(name)) for name in QTYPES} == sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 3, 4, 17, 512])
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("path", PATHS)
def test_linear_matches_dequantize_and_float32_matmul(path: str, qtype: str, rows: int, dtype: torch.dtype) -> None:
    skip_unless_runs(path)
    laid_out = weight(qtype, seed=rows)
    x = torch.randn(rows, IN, generator=torch.Generator().manual_seed(rows)).to(dtype)
    w = cpu_quant.dequantize(laid_out)
    expected = x.float() @ w.T
    magnitude = x.float().abs() @ w.abs().T  # bounds every partial sum
    y = cpu_quant._linear(x, laid_out, None, path)
    assert y.dtype == dtype and y.shape == (rows, OUT)
    if dtype is torch.float32:
        bound = 1e-6 * magnitude
    else:  # the output's rounding; many rows also round each weight to bfloat16 once
        weights_rounded = rows > cpu_quant.FEW_ROWS and path != "reference"
        bound = 2**-8 * expected.abs() + (2**-8 if weights_rounded else 1e-6) * magnitude
    assert ((y.float() - expected).abs() <= bound).all()


@pytest.mark.parametrize("path", cpu_quant.ISAS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_outputs_do_not_depend_on_the_thread_count(path: str, qtype: str) -> None:
    skip_unless_runs(path)
    laid_out = weight(qtype, out_features=203, in_features=576)
    x = torch.randn(3, 576).bfloat16()
    saved = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(cpu_quant._linear(x, laid_out, None, path))
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_linear_keeps_leading_dims_and_adds_the_bias() -> None:
    laid_out = weight("Q4_1")
    x, bias = torch.randn(2, 3, IN), torch.randn(OUT)
    y = cpu_quant.linear(x, laid_out, bias)
    assert y.shape == (2, 3, OUT)
    flat = cpu_quant._linear(x.reshape(6, IN), laid_out, None, cpu_quant.isa())  # rows are independent
    torch.testing.assert_close(y, flat.view(2, 3, OUT) + bias, rtol=1e-6, atol=1e-6)


def test_isa_is_the_best_of_the_cpu_kind_chatcore_runs_as() -> None:
    """The CPU's kind (kernels/cpu_kind.py, under any CHATCORE_CPU_ISA cap) names the path."""
    if native.library() is None:
        assert cpu_quant.isa() == "reference"
        return
    flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split(":", 1)[1].split())
    avx2 = {"avx2", "fma", "f16c"} <= flags
    expected = []
    if avx2 and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        expected.append("avx512vnni")
    if avx2:
        expected.append("avx2int8")
    if {"avx512_bf16", "avx512f", "avx512bw"} <= flags:
        expected += ["avx512bf16", "avx512f", "avx2"]
    elif {"avx512f", "avx512bw"} <= flags:
        expected += ["avx512f", "avx2"]
    elif avx2:
        expected.append("avx2")
    if cpu_kind.kind() != cpu_kind.detected():  # a cap: that kind's paths alone, VNNI from avx512bf16 up
        lowest = {"avx512vnni": "avx512bf16", "avx2int8": "avx2", "avx512bf16": "avx512bf16", "avx512f": "avx512f",
                  "avx2": "avx2"}
        expected = [path for path in expected if cpu_kind.at_least(lowest[path])]
    assert cpu_quant.supported_isas() == tuple(expected)
    assert cpu_quant.isa() == (expected[0] if expected else "reference")


@pytest.mark.parametrize("qtype, raw, shape, message", [
    ("Q5_K", torch.zeros(4, 20, dtype=torch.uint8), (4, 32), "'Q5_K' is not supported: supported are Q4_0, Q4_1, Q8_0"),
    ("Q4_1", torch.zeros(4, 20, dtype=torch.uint8), (4, 40), "multiple of 32"),
    ("Q4_1", torch.zeros(4, 19, dtype=torch.uint8), (4, 32), "is 80 bytes"),
    ("Q4_1", torch.zeros(4, 20, dtype=torch.int8), (4, 32), "torch.int8"),
])
def test_lay_out_refuses(qtype: str, raw: torch.Tensor, shape: tuple[int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cpu_quant.lay_out(raw, qtype, *shape)


@pytest.mark.parametrize("x, bias, message", [
    (torch.randn(2, IN, dtype=torch.float64), None, "torch.float64"),
    (torch.randn(2, IN - 32), None, r"rows of 160 features.*\(2, 128\)"),
    (torch.randn(2, IN, device="meta"), None, "on meta"),
    (torch.randn(2, IN), torch.randn(OUT + 1), r"bias must be \[37\]"),
    (torch.randn(0, IN), None, r"at least one row, not \(0, 160\)"),
    (torch.randn(3, 0, IN), None, r"at least one row, not \(3, 0, 160\)"),
])
def test_linear_refuses_bad_rows_and_bias(x: torch.Tensor, bias: torch.Tensor | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cpu_quant.linear(x, weight("Q4_0"), bias)


def test_a_weight_not_laid_out_is_refused_before_any_c_runs() -> None:
    good = weight("Q8_0")
    for bad in (cpu_quant.QuantWeight("Q8_0", OUT + 8, IN, good.data),  # claims more rows than its bytes hold
                cpu_quant.QuantWeight("Q8_0", OUT, IN, good.data[:-1]),
                cpu_quant.QuantWeight("Q8_0", OUT, IN, good.data.view(torch.int8)),
                cpu_quant.QuantWeight("Q4_2", OUT, IN, good.data)):
        with pytest.raises(ValueError):
            cpu_quant.linear(torch.randn(1, IN), bad)
        with pytest.raises(ValueError):
            cpu_quant.dequantize(bad)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("out_features", [0, -8])
def test_a_weight_without_output_rows_is_refused_on_every_path(path: str, out_features: int) -> None:
    empty = cpu_quant.QuantWeight("Q8_0", out_features, IN, torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match=f"out_features >= 1, not {out_features}"):
        cpu_quant._linear(torch.randn(1, IN), empty, None, path)
    with pytest.raises(ValueError, match="out_features >= 1"):
        cpu_quant.dequantize(empty)


def test_a_path_this_cpu_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="do not run the 'avx9' path"):
        cpu_quant._linear(torch.randn(1, IN), weight("Q4_0"), None, "avx9")


def _build(tmp_path: Path, march: str, source_name: str = "cpu_quant.c") -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    library = tmp_path / f"{source_name}-{march}.so"
    source = Path(cpu_quant.__file__).with_name(source_name)
    subprocess.run([compiler, "-O3", f"-march={march}", "-fopenmp", "-fPIC", "-shared", "-Werror", "-Wall", "-o",
                    str(library), str(source)], check=True, capture_output=True, timeout=120)
    return library


def built_path_equals_native(function: Callable[..., int], path: str, qtype: str) -> bool:
    """Whether `function` (a linear of a separately built library) on `path` gives the native build's bits."""
    laid_out, x = weight(qtype, out_features=45, in_features=576), torch.randn(3, 576)
    out = torch.empty(3, 45)
    failed = function(
        ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(laid_out.data.data_ptr()), ctypes.c_void_p(out.data_ptr()),
        0, cpu_quant._QTYPE_CODES[qtype], cpu_quant._ISA_CODES[path], ctypes.c_int64(3), ctypes.c_int64(45),
        ctypes.c_int64(576), 2)
    return failed == 0 and torch.equal(out, cpu_quant._linear(x, laid_out, None, path))


def test_the_file_builds_for_a_cpu_without_avx(tmp_path: Path) -> None:
    library = ctypes.CDLL(str(_build(tmp_path, "x86-64")))
    assert library.chatcore_quant_rows_per_group() == cpu_quant.ROWS


@pytest.mark.parametrize("qtype", QTYPES)
def test_an_avx2_only_build_runs_the_avx2_path_as_the_native_one(tmp_path: Path, qtype: str) -> None:
    """Built for x86-64-v3 (AVX2, no AVX-512 anywhere in the code), the AVX2 path gives the native
    build's bits: what an AVX2 laptop runs is what the tests above check here."""
    skip_unless_runs("avx2")
    library = ctypes.CDLL(str(_build(tmp_path, "x86-64-v3")))
    assert built_path_equals_native(library.chatcore_quant_linear, "avx2", qtype)
