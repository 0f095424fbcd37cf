"""The KV store's C copy (kernels/cpu_store.py): the reference's writes, bit for bit, from rows of
any token stride; negative slots skipped; a slot past the cache refused with nothing written."""

from __future__ import annotations

import pytest
import torch

from chatcore.kernels import cpu_store, reference
from chatcore.kernels import dispatch as kernels

pytestmark = pytest.mark.skipif(not cpu_store.accepts(*(torch.zeros(1, 1, 2),) * 4, torch.zeros(1, dtype=torch.long)),
                                reason="the C kernels could not be built here")


def _caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(6, 4, 3, 8, dtype=dtype), torch.zeros(6, 4, 3, 8, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_c_copy_writes_what_the_reference_writes(dtype: torch.dtype) -> None:
    fused = torch.randn(5, 4 * 24).to(dtype)  # rows [q | k | v | spare]: k and v are strided views
    key, value = fused[:, 24:48].view(5, 3, 8), fused[:, 48:72].view(5, 3, 8)
    slots = torch.tensor([0, 23, -1, 7, 4 * 6 - 2])
    assert cpu_store.accepts(key, value, *_caches(dtype), slots)
    ours, theirs = _caches(dtype), _caches(dtype)
    cpu_store.store_kv(key, value, *ours, slots)
    reference.store_kv(key, value, *theirs, slots)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert int((ours[0] != 0).view(24, -1).any(1).sum()) == 4  # the skipped token wrote nothing


def test_a_slot_past_the_cache_writes_nothing() -> None:
    key = torch.randn(2, 3, 8)
    caches = _caches(torch.float32)
    with pytest.raises(ValueError, match="outside the cache"):
        cpu_store.store_kv(key, key, *caches, torch.tensor([1, 6 * 4]))
    assert not caches[0].any() and not caches[1].any()


def test_the_entry_point_takes_the_c_copy_only_where_it_applies() -> None:
    key = torch.randn(2, 3, 8)
    caches = _caches(torch.bfloat16)
    assert not cpu_store.accepts(key, key, *caches, torch.tensor([0, 1]))  # a cast: the reference's
    kernels.store_kv(key, key, *caches, torch.tensor([0, 5]))
    assert torch.equal(caches[0][1, 1], key[1].bfloat16()) and torch.equal(caches[1][0, 0], key[0].bfloat16())
    strided_heads = torch.randn(2, 8, 3).transpose(1, 2)
    assert not cpu_store.accepts(strided_heads, strided_heads, *_caches(torch.float32), torch.tensor([0, 1]))
