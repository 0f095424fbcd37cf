"""The few-row bfloat16 linear in C (kernels/cpu_linear.py): float32 sums of the same products as
`F.linear`, rounded once; independent of the thread count; refused where it does not apply.

The kernel exists only where the CPU has AVX512-BF16; its refusals come before it is looked up,
so they are tested on every CPU, and again as on a CPU without it (`_kernel` gives None)."""

from __future__ import annotations

import pytest
import torch

from chatcore.kernels import cpu_linear

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason="no AVX512-BF16 here: oneDNN serves every row")
GROUP_ROWS = 8  # kernels/cpu_linear.c's ROWS: lay_out's groups


def _exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@needs_kernel
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


@needs_kernel
def test_batched_shapes_and_a_strided_input() -> None:
    weight = torch.randn(40, 64).bfloat16()
    laid_out = cpu_linear.lay_out(weight)
    assert laid_out is not None
    x = torch.randn(1, 3, 128).bfloat16()[..., ::2]  # [batch, tokens, features], not contiguous
    got = cpu_linear.linear(x, laid_out, 40, None)
    assert got.shape == (1, 3, 40)
    assert torch.equal(got[0], cpu_linear.linear(x[0].contiguous(), laid_out, 40, None))


@needs_kernel
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


@needs_kernel
def test_nan_and_infinity_propagate() -> None:
    weight = torch.ones(8, 32).bfloat16()
    x = torch.ones(2, 32).bfloat16()
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    laid_out = cpu_linear.lay_out(weight)
    assert laid_out is not None
    got = cpu_linear.linear(x, laid_out, 8, None)
    assert got[0].isnan().all() and got[1].isposinf().all()


@needs_kernel
def test_what_it_cannot_take_is_not_laid_out() -> None:
    assert cpu_linear.lay_out(torch.randn(8, 48).bfloat16()) is None  # 48 columns: not whole groups of 32
    assert cpu_linear.lay_out(torch.randn(8, 0).bfloat16()) is None  # no columns: no product to stream
    assert cpu_linear.lay_out(torch.randn(8, 64)) is None  # float32 weights: oneDNN or torch serve them


def _laid_out(out_features: int, in_features: int) -> torch.Tensor:
    """A weight in `lay_out`'s layout, built by hand: on a CPU without the kernel `lay_out` gives None."""
    weight = torch.randn(-(-out_features // GROUP_ROWS) * GROUP_ROWS, in_features).bfloat16()
    weight[out_features:] = 0
    laid_out = weight.view(-1, GROUP_ROWS, in_features // 32, 32).transpose(1, 2).contiguous()
    if cpu_linear.available():
        made = cpu_linear.lay_out(weight[:out_features])
        assert made is not None and torch.equal(made, laid_out)
    return laid_out


def _odd_address(values: torch.Tensor) -> torch.Tensor:
    """`values` copied to a buffer one byte past an aligned start (as torch.frombuffer may give)."""
    shifted = torch.frombuffer(bytearray(values.numel() * 2 + 1), dtype=values.dtype, offset=1,
                               count=values.numel()).view(values.shape)
    assert shifted.data_ptr() % 2 == 1
    return shifted.copy_(values)


def _wrong(case: str) -> tuple[tuple[object, ...], dict[str, object]]:
    """`linear`'s arguments with the one thing named wrong: 3 rows of 64 features into 13 outputs
    (two groups of 8 rows, the second padded)."""
    x, laid_out, out_features = torch.randn(3, 64).bfloat16(), _laid_out(13, 64), 13
    bias, residual = torch.randn(13).bfloat16(), torch.randn(3, 13).bfloat16()
    if case == "out_features past the groups":  # read a third group past the weight
        out_features = 17
    elif case == "out_features short of the groups":
        out_features = 8
    elif case == "a bias one short":  # read one past the bias
        bias = bias[:12]
    elif case == "a bias one long":
        bias = torch.randn(14).bfloat16()
    elif case == "a 2-d bias":
        bias = bias.view(1, 13)
    elif case == "a residual of another shape":
        residual = torch.randn(2, 13).bfloat16()
    elif case == "a float32 residual":
        residual = residual.float()
    elif case == "float32 rows":
        x = x.float()
    elif case == "rows of another size":
        x = torch.randn(3, 32).bfloat16()
    elif case == "five rows":
        x = torch.randn(5, 64).bfloat16()
    elif case == "a float32 weight":
        laid_out = laid_out.float()
    elif case == "a strided weight":
        laid_out = laid_out.transpose(0, 1).contiguous().transpose(0, 1)
    elif case == "a weight not laid out":
        laid_out = torch.randn(13, 64).bfloat16()
    elif case == "a bias at an odd address":
        bias = _odd_address(bias)
    elif case == "a residual at an odd address":
        residual = _odd_address(residual)
    elif case == "rows off the CPU":
        x = torch.empty(3, 64, dtype=torch.bfloat16, device="meta")
    return (x, laid_out, out_features, bias), {"residual": residual}


WRONG = {"out_features past the groups": "out_features 17", "out_features short of the groups": "out_features 8",
         "a bias one short": r"bias must be \[13\]", "a bias one long": r"bias must be \[13\]",
         "a 2-d bias": r"bias must be \[13\]", "a residual of another shape": "residual",
         "a float32 residual": "residual", "float32 rows": "bfloat16 rows of 64 features",
         "rows of another size": "bfloat16 rows of 64 features", "five rows": "at most 4 rows",
         "a float32 weight": "laid_out", "a strided weight": "laid_out", "a weight not laid out": "laid_out",
         "a bias at an odd address": "2-byte", "a residual at an odd address": "2-byte", "rows off the CPU": "CPU"}


@pytest.mark.parametrize("kernel", ["this CPU's", "none (no AVX512-BF16)"])
@pytest.mark.parametrize("case", WRONG)
def test_what_the_c_cannot_take_is_refused_on_every_cpu(case: str, kernel: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel.startswith("none"):
        monkeypatch.setattr(cpu_linear, "_kernel", lambda: None)
    args, keywords = _wrong(case)
    with pytest.raises(ValueError, match=WRONG[case]):
        cpu_linear.linear(*args, **keywords)


def test_without_the_kernel_valid_arguments_say_it_is_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_linear, "_kernel", lambda: None)
    assert not cpu_linear.available() and cpu_linear.lay_out(torch.randn(8, 64).bfloat16()) is None
    with pytest.raises(RuntimeError, match="not available"):
        cpu_linear.linear(torch.randn(2, 64).bfloat16(), _laid_out(8, 64), 8, None)


@needs_kernel
def test_the_edges_of_what_it_takes_compute_the_product() -> None:
    """The last output of a padded group, a bias and a residual of exactly the output's size."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(13, 64, generator=generator).bfloat16()
    x, bias = torch.randn(3, 64, generator=generator).bfloat16(), torch.randn(13, generator=generator).bfloat16()
    residual = torch.randn(3, 13, generator=generator).bfloat16()
    laid_out = cpu_linear.lay_out(weight)
    assert laid_out is not None and laid_out.shape == (2, 2, GROUP_ROWS, 32)
    product = cpu_linear.linear(x, laid_out, 13, bias)
    exact = _exact(x, weight, bias)
    assert ((product.double() - exact).abs() <= exact.abs() * 2**-8 + 2**-12).all()
    assert torch.equal(cpu_linear.linear(x, laid_out, 13, bias, residual=residual), residual + product)


@needs_kernel
def test_a_weight_laid_out_for_other_groups_is_refused() -> None:
    laid_out = torch.zeros(2, 2, 4, 32, dtype=torch.bfloat16)  # groups of 4 rows: this kernel reads 8
    with pytest.raises(ValueError, match="groups of 4 rows"):
        cpu_linear.linear(torch.randn(1, 64).bfloat16(), laid_out, 8, None)
