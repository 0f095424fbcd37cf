"""The few-row bfloat16 linear in C (kernels/cpu_linear.py): float32 sums of the same products as
`F.linear`, rounded once; independent of the thread count; refused where it does not apply."""

from __future__ import annotations

import pytest
import torch

from chatcore.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no AVX512-BF16 here: oneDNN serves every row")


def _exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize(("out_features", "in_features"), [(8, 32), (13, 64), (576, 576), (49, 1536), (1, 96)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_products_are_float32_sums_rounded_once(out_features: int, in_features: int, rows: int,
                                                with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(out_features * 100 + rows)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    laid_out = cpu_linear.lay_out(weight)
    assert laid_out is not None
    got = cpu_linear.linear(x, laid_out, out_features, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    exact = _exact(x, weight, bias)
    # One rounding to bfloat16 (half a unit in the last of 8 bits) plus float32 summation error.
    scale = (x.double().abs() @ weight.double().abs().T) + (0 if bias is None else bias.double().abs())
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + scale * 2**-20).all()
    reference = torch.nn.functional.linear(x, weight, bias)
    assert (got != reference).float().mean() < 0.05  # oneDNN rounds the same sums: few last-bit differences


def test_batched_shapes_and_a_strided_input() -> None:
    weight = torch.randn(40, 64).bfloat16()
    laid_out = cpu_linear.lay_out(weight)
    assert laid_out is not None
    x = torch.randn(1, 3, 128).bfloat16()[..., ::2]  # [batch, tokens, features], not contiguous
    got = cpu_linear.linear(x, laid_out, 40, None)
    assert got.shape == (1, 3, 40)
    assert torch.equal(got[0], cpu_linear.linear(x[0].contiguous(), laid_out, 40, None))


def test_results_do_not_depend_on_the_thread_count() -> None:
    weight = torch.randn(1000, 576).bfloat16()
    x = torch.randn(4, 576).bfloat16()
    laid_out = cpu_linear.lay_out(weight)
    assert laid_out is not None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_linear.linear(x, laid_out, 1000, None)
        torch.set_num_threads(max(2, threads))
        many = cpu_linear.linear(x, laid_out, 1000, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_nan_and_infinity_propagate() -> None:
    weight = torch.ones(8, 32).bfloat16()
    x = torch.ones(2, 32).bfloat16()
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    laid_out = cpu_linear.lay_out(weight)
    assert laid_out is not None
    got = cpu_linear.linear(x, laid_out, 8, None)
    assert got[0].isnan().all() and got[1].isposinf().all()


def test_what_it_cannot_take_is_refused() -> None:
    assert cpu_linear.lay_out(torch.randn(8, 48).bfloat16()) is None  # 48 columns: not whole groups of 32
    assert cpu_linear.lay_out(torch.randn(8, 64)) is None  # float32 weights: oneDNN or torch serve them
    laid_out = cpu_linear.lay_out(torch.randn(8, 64).bfloat16())
    assert laid_out is not None
    with pytest.raises(ValueError, match="at most 4 rows"):
        cpu_linear.linear(torch.randn(5, 64).bfloat16(), laid_out, 8, None)
    with pytest.raises(ValueError, match="bfloat16 rows of 64 features"):
        cpu_linear.linear(torch.randn(2, 64), laid_out, 8, None)
    with pytest.raises(ValueError, match="bfloat16 rows of 64 features"):
        cpu_linear.linear(torch.randn(2, 32).bfloat16(), laid_out, 8, None)
