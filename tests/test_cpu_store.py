"""The KV store's C copy (kernels/cpu_store.py): the reference's writes, bit for bit, from rows of
any token stride; negative slots skipped; a slot past the cache refused with nothing written; every
argument the C trusts checked on every call, also where a step's route calls it directly. The C
copy has no instruction-set variant: these run wherever the library builds."""

from __future__ import annotations

import pytest
import torch

from chatcore.kernels import cpu_store, native, reference
from chatcore.kernels import dispatch as kernels

pytestmark = pytest.mark.skipif(native.library() is None, reason="the C kernels could not be built here")


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


def _unaligned(values: torch.Tensor, offset: int) -> torch.Tensor:
    """`values` copied to a buffer `offset` bytes past an aligned start (as torch.frombuffer may give)."""
    size = values.element_size()
    shifted = torch.frombuffer(bytearray(values.numel() * size + offset), dtype=values.dtype, offset=offset,
                               count=values.numel()).view(values.shape)
    assert shifted.data_ptr() % size == offset % size
    return shifted.copy_(values)


def _wrong(case: str) -> tuple[torch.Tensor, ...]:
    """Arguments for one token with the one thing named wrong; float32 caches [6, 4, 3, 8]."""
    key, value, slots = torch.randn(1, 3, 8), torch.randn(1, 3, 8), torch.tensor([23])  # the last slot
    key_cache, value_cache = _caches(torch.float32)
    if case == "float64 key":  # 2x the cache's row: wrote past the last slot's row
        key = key.double()
    elif case == "bfloat16 value":
        value = value.bfloat16()
    elif case == "float16 value cache":
        value_cache = value_cache.half()
    elif case == "int32 slots":  # read as int64: two slots from one, the second past the tensor
        slots = slots.int()
    elif case == "more tokens than slots":
        key, value = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    elif case == "2-d slots":
        slots = slots.view(1, 1)
    elif case == "more heads than the cache":
        key, value = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    elif case == "a longer head_dim":
        key, value = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
    elif case == "value of another shape":
        value = torch.randn(1, 3, 8)[:, :2]
    elif case == "value cache of another shape":
        value_cache = torch.zeros(3, 4, 3, 8)
    elif case == "2-d key":
        key, value = key.view(1, 24), value.view(1, 24)
    elif case == "strided cache":
        key_cache = torch.zeros(6, 3, 4, 8).transpose(1, 2)
    elif case == "strided slots":
        key, value, slots = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.tensor([3, 0, 4, 0])[::2]
    elif case == "strided heads":
        key = torch.randn(1, 8, 3).transpose(1, 2)
    elif case == "slots at an odd address":
        slots = _unaligned(slots, 4)
    elif case == "a key off the CPU":
        key = torch.empty(1, 3, 8, device="meta")
    return key, value, key_cache, value_cache, slots


WRONG = {"float64 key": "cache's dtype", "bfloat16 value": "cache's dtype", "float16 value cache": "cache's dtype",
         "int32 slots": "int64", "more tokens than slots": "slot_mapping", "2-d slots": "slot_mapping",
         "more heads than the cache": "kv_heads", "a longer head_dim": "head_dim",
         "value of another shape": r"value \(1, 2, 8\)", "value cache of another shape": "caches",
         "2-d key": "tokens, kv_heads, head_dim", "strided cache": "contiguous caches", "strided slots": "contiguous",
         "strided heads": "contiguous", "slots at an odd address": "8-byte boundary", "a key off the CPU": "CPU"}


@pytest.mark.parametrize("case", WRONG)
def test_what_the_c_copy_cannot_take_is_refused_and_nothing_is_written(case: str) -> None:
    key, value, key_cache, value_cache, slots = _wrong(case)
    assert not cpu_store.accepts(key, value, key_cache, value_cache, slots)
    with pytest.raises(ValueError, match=WRONG[case]):
        cpu_store.store_kv(key, value, key_cache, value_cache, slots)
    assert not key_cache.any() and not value_cache.any()


def test_a_later_layer_of_a_routed_step_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dispatch.route` checks a step's first layer and then calls the C copy for every layer: a
    later layer's float64 key or int32 slots are refused there, not written past the cache."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    key, slots = torch.randn(1, 3, 8), torch.tensor([23])  # the last slot: a float64 row would overrun the cache
    route = kernels.route(key[:0], key, key, *_caches(torch.float32), slots, None, None, None)
    assert route.store is cpu_store.store_kv
    caches = _caches(torch.float32)
    with pytest.raises(ValueError, match="cache's dtype"):
        route.store(key.double(), key.double(), *caches, slots)
    with pytest.raises(ValueError, match="int64"):
        route.store(key, key, *caches, slots.int())
    assert not caches[0].any() and not caches[1].any()
    route.store(key, key, *caches, slots)
    assert torch.equal(caches[0][5, 3], key[0]) and torch.equal(caches[1][5, 3], key[0])
