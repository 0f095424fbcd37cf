"""The torch reference (the engine's CPU path) against slow, obvious per-sequence oracles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from chatcore.kernels import reference


def dense_attention(query, key_cache, value_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """fp32 SDPA of each sequence over its keys and values, gathered one sequence at a time."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(num_seqs, num_heads, head_dim)
    for i in range(num_seqs):
        n = int(context_lens[i])
        if n == 0:
            continue
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float().transpose(0, 1)
        v = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float().transpose(0, 1)
        group = num_heads // num_kv_heads
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out[i] = F.scaled_dot_product_attention(query[i].float()[:, None], k, v, scale=scale)[:, 0]
    return out


def make_case(lens, *, num_kv_heads, group, head_dim, block_size, dtype, seed=0):
    """Random caches and a shuffled block table whose padding is out-of-range garbage."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in lens]
    width = max(used + [1]) + 2
    num_blocks = sum(used) + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(-(2**31), 2**31 - 1, (len(lens), width), generator=gen, dtype=torch.int64)
    start = 0
    for i, n in enumerate(used):
        table[i, :n] = ids[start : start + n]
        start += n
    return query, key_cache, value_cache, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def case_strategies(max_seqs: int = 6, head_dims: tuple[int, ...] = (16, 64, 80, 96)) -> dict[str, st.SearchStrategy]:
    """What a decode test draws for `make_case`: ragged lengths, GQA, head dims, block sizes, a seed."""
    return {"lens": st.lists(st.integers(0, 90), min_size=1, max_size=max_seqs), "num_kv_heads": st.integers(1, 3),
            "group": st.sampled_from([1, 3, 4]), "head_dim": st.sampled_from(head_dims),
            "block_size": st.sampled_from([8, 16, 32, 64]), "seed": st.integers(0, 2**16)}


@settings(max_examples=40, deadline=None)
@given(**case_strategies())
def test_decode_matches_dense_fp32(lens, num_kv_heads, group, head_dim, block_size, seed):
    case = make_case(lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                     block_size=block_size, dtype=torch.float32, seed=seed)
    scale = head_dim**-0.5
    got = reference.paged_decode_attention(*case, scale)
    assert got.shape == case[0].shape and got.dtype == torch.float32
    torch.testing.assert_close(got, dense_attention(*case, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype):
    case = make_case([1, 16, 45, 64], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=dtype)
    got = reference.paged_decode_attention(*case, 0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), dense_attention(*case, 0.125), atol=2e-2, rtol=2e-2)


def test_decode_context_zero_gives_zeros():
    case = make_case([0, 5, 0], num_kv_heads=1, group=2, head_dim=16, block_size=8, dtype=torch.float32)
    got = reference.paged_decode_attention(*case, 0.25)
    assert torch.equal(got[[0, 2]], torch.zeros(2, 2, 16))
    assert got[1].abs().sum() > 0
    empty = reference.paged_decode_attention(*make_case([0, 0], num_kv_heads=1, group=1, head_dim=16,
                                                        block_size=8, dtype=torch.float32), 0.25)
    assert torch.equal(empty, torch.zeros(2, 1, 16))


def test_results_do_not_alias_the_reused_gather_buffers():
    small = make_case([5, 30], num_kv_heads=1, group=3, head_dim=16, block_size=8, dtype=torch.float32, seed=1)
    large = make_case([90, 64, 3], num_kv_heads=1, group=3, head_dim=16, block_size=8, dtype=torch.float32, seed=2)
    first = reference.paged_decode_attention(*small, 0.25)
    snapshot = first.clone()
    reference.paged_decode_attention(*large, 0.25)
    reference.paged_decode_attention(*small, 0.25)
    assert torch.equal(first, snapshot)


def test_gradients_survive_a_later_call():
    """With autograd on, the gathered K/V saved for backward must not be reused buffers."""
    query, *rest = make_case([7, 40], num_kv_heads=2, group=2, head_dim=16, block_size=8, dtype=torch.float32)
    query.requires_grad_(True)
    weights = torch.randn(query.shape, generator=torch.Generator().manual_seed(5))
    (reference.paged_decode_attention(query, *rest, 0.3) * weights).sum().backward()
    expected = query.grad.clone()
    query.grad = None
    loss = (reference.paged_decode_attention(query, *rest, 0.3) * weights).sum()
    # Same shapes: a reused gather buffer would be overwritten before backward reads it.
    other = make_case([40, 7], num_kv_heads=2, group=2, head_dim=16, block_size=8, dtype=torch.float32, seed=9)
    reference.paged_decode_attention(*other, 0.3)
    loss.backward()
    torch.testing.assert_close(query.grad, expected, atol=0, rtol=0)
    dense_query = query.detach().clone().requires_grad_(True)
    (dense_attention(dense_query, *rest, 0.3) * weights).sum().backward()
    torch.testing.assert_close(query.grad, dense_query.grad, atol=1e-5, rtol=1e-5)


def test_store_kv_writes_slots_and_skips_negative():
    key_cache = torch.zeros(4, 8, 2, 16)
    value_cache = torch.zeros(4, 8, 2, 16)
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slots = torch.tensor([3 * 8 + 7, -1, 0, 1 * 8 + 2, -5])
    reference.store_kv(key, value, key_cache, value_cache, slots)
    expected_k, expected_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // 8, slot % 8] = key[i]
            expected_v[slot // 8, slot % 8] = value[i]
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


def test_store_kv_non_contiguous_cache_and_cast():
    pool = torch.zeros(3, 2, 8, 1, 16, dtype=torch.bfloat16)  # [blocks, k/v, slots, heads, dim]
    key_cache, value_cache = pool[:, 0], pool[:, 1]
    key, value = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    reference.store_kv(key, value, key_cache, value_cache, torch.tensor([2 * 8 + 1, 5]))
    assert torch.equal(key_cache[2, 1], key[0].to(torch.bfloat16))
    assert torch.equal(value_cache[0, 5], value[1].to(torch.bfloat16))
    assert pool.count_nonzero() == 4 * 16


def test_copy_blocks_copies_whole_blocks():
    key_cache, value_cache = torch.randn(6, 8, 2, 16), torch.randn(6, 8, 2, 16)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    reference.copy_blocks(key_cache, value_cache, torch.tensor([0, 4]), torch.tensor([5, 1]))
    expected_k, expected_v = before_k.clone(), before_v.clone()
    expected_k[5], expected_k[1] = before_k[0], before_k[4]
    expected_v[5], expected_v[1] = before_v[0], before_v[4]
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
