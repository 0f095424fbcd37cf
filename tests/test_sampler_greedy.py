"""`sampler.greedy`: argmax's token for every row, the first of tied maxima, a NaN as the largest."""

from __future__ import annotations

import pytest
import torch

from chatcore.engine.sampler import greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax_ties_and_nans_included(dtype: torch.dtype) -> None:
    logits = torch.randint(0, 3, (8, 4096), generator=torch.Generator().manual_seed(0)).to(dtype)  # ties everywhere
    logits[3, 100] = float("nan")
    logits[4] = float("-inf")
    logits[5, 7] = logits[5, 9] = float("inf")
    logits[6, 4000:] = float("nan")
    expected = torch.tensor([int(torch.nonzero(row == row.max())[0]) for row in logits[:3]])
    chosen = greedy(logits)
    assert torch.equal(chosen, logits.argmax(dim=-1))
    assert torch.equal(chosen[:3], expected) and chosen[3:7].tolist() == [100, 0, 7, 4000]
