"""What the pointwise kernels in C (kernels/cpu_pointwise.py) cannot take is refused before the C
runs: dtype, device, layout, shapes, and an odd address for its uint16_t reads. These kernels have
no instruction-set variant (only the few-row linear needs AVX512-BF16), so their refusals are
tested wherever the library builds; their results are tested in tests/test_fused_layer.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from chatcore.kernels import cpu_pointwise

pytestmark = pytest.mark.skipif(not cpu_pointwise.available(), reason="the C kernels could not be built here")


def _random(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


def _odd_address(values: torch.Tensor) -> torch.Tensor:
    """`values` copied to a buffer one byte past an aligned start (as torch.frombuffer may give)."""
    shifted = torch.frombuffer(bytearray(values.numel() * 2 + 1), dtype=values.dtype, offset=1,
                               count=values.numel()).view(values.shape)
    assert shifted.data_ptr() % 2 == 1
    return shifted.copy_(values)


_COS = _random(2, 16)
_WEIGHT = torch.ones(64, dtype=torch.bfloat16)
WRONG: dict[str, tuple[Callable[[], object], str]] = {
    "float32 rows": (lambda: cpu_pointwise.rms_norm(torch.randn(2, 64), _WEIGHT, 1e-5), "bfloat16"),
    "a weight of another size": (lambda: cpu_pointwise.rms_norm(_random(2, 64), _WEIGHT[:32], 1e-5), "weight"),
    "a 0-d x": (lambda: cpu_pointwise.rms_norm(_random(1)[0], _WEIGHT[:1], 1e-5), "weight"),
    "rows at an odd address": (lambda: cpu_pointwise.rms_norm(_odd_address(_random(2, 64)), _WEIGHT, 1e-5),
                               "2-byte boundary"),
    "rows off the CPU": (lambda: cpu_pointwise.rms_norm(torch.empty(2, 64, dtype=torch.bfloat16, device="meta"),
                                                        _WEIGHT, 1e-5), "CPU"),
    "strided gate_up": (lambda: cpu_pointwise.silu_mul(_random(64, 4).t()), "strided"),
    "an odd gate_up width": (lambda: cpu_pointwise.silu_mul(_random(2, 7)), "even width"),
    "a 3-d gate_up": (lambda: cpu_pointwise.silu_mul(_random(1, 2, 8)), "rows, 2 \\* inter"),
    "three heads in 32 values": (lambda: cpu_pointwise.rope_(_random(2, 32), _COS, _COS, 3, 16), "RoPE"),
    "cos for two rows of three": (lambda: cpu_pointwise.rope_(_random(3, 64), _COS, _COS, 2, 16), "RoPE"),
    "negative heads": (lambda: cpu_pointwise.rope_(_random(2, 64), _COS, _COS, -1, 16), "RoPE"),
    "a 3-d x for RoPE": (lambda: cpu_pointwise.rope_(_random(2, 1, 64), _COS, _COS, 2, 16), "RoPE"),
    "sin at an odd address": (lambda: cpu_pointwise.rope_(_random(2, 64), _COS, _odd_address(_COS), 2, 16),
                              "2-byte boundary"),
}


@pytest.mark.parametrize("case", WRONG)
def test_what_the_pointwise_kernels_cannot_take_is_refused(case: str) -> None:
    call, message = WRONG[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_rope_leaves_x_untouched_when_it_refuses() -> None:
    x = _random(2, 64)
    before = x.clone()
    with pytest.raises(ValueError, match="2-byte boundary"):
        cpu_pointwise.rope_(x, _COS, _odd_address(_COS), 2, 16)
    assert torch.equal(x, before)
