"""Prefill attention over paged blocks: the CPU path for a chunk that continues cached tokens
equals one masked attention over the gathered blocks."""

from __future__ import annotations

import pytest
import torch

from chatcore.models.paged_attention import PrefillMeta, _prefill_attention

BLOCK = 16


def _case(start: int, tokens: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dim = 64
    length = start + tokens
    num_blocks = -(-length // BLOCK)
    pool = num_blocks * 3
    key_cache = torch.randn(pool, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    value_cache = torch.randn(pool, BLOCK, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(pool, generator=gen)[:num_blocks].to(torch.int32).unsqueeze(0)  # scattered blocks
    q = torch.randn(heads, tokens, dim, generator=gen).to(dtype).transpose(0, 1)  # [T, heads, D], strided
    positions = start + torch.arange(tokens)
    mask = (torch.arange(length).view(1, -1) <= positions.view(-1, 1)).view(1, 1, tokens, length)
    masked = PrefillMeta(table, mask, None, 1, tokens, length)
    continuation = PrefillMeta(table, mask, None, 1, tokens, length, start=start)
    return q, key_cache, value_cache, masked, continuation


@pytest.mark.parametrize("start, tokens", [(16, 1), (37, 5), (64, 64), (250, 122), (1, 30)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_continuation_equals_one_masked_attention(start: int, tokens: int, heads: int, kv_heads: int) -> None:
    q, kc, vc, masked, continuation = _case(start, tokens, heads, kv_heads, torch.float32)
    scale = 64 ** -0.5
    expected = _prefill_attention(q, kc, vc, masked, scale)
    for _ in range(2):  # the second call reuses the score buffers
        got = _prefill_attention(q, kc, vc, continuation, scale)
        assert got.shape == expected.shape == (tokens, heads, 64)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_continuation_in_half_precision(dtype: torch.dtype) -> None:
    q, kc, vc, masked, continuation = _case(200, 40, 9, 3, dtype, seed=1)
    scale = 64 ** -0.5
    expected = _prefill_attention(q.float(), kc.float(), vc.float(), masked, scale)
    got = _prefill_attention(q, kc, vc, continuation, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_result_never_aliases_the_reused_buffers() -> None:
    q, kc, vc, _, continuation = _case(48, 8, 9, 3, torch.float32)
    first = _prefill_attention(q, kc, vc, continuation, 0.125)
    kept = first.clone()
    q2, kc2, vc2, _, continuation2 = _case(48, 8, 9, 3, torch.float32, seed=5)
    _prefill_attention(q2, kc2, vc2, continuation2, 0.125)
    assert torch.equal(first, kept)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_a_narrower_cache_is_read_in_the_query_dtype(kv_dtype: torch.dtype) -> None:
    """kv_dtype: both prefill paths equal the fp32 computation over the stored (rounded) values."""
    q, kc, vc, masked, continuation = _case(200, 40, 9, 3, torch.float32, seed=2)
    narrow_k, narrow_v = kc.to(kv_dtype), vc.to(kv_dtype)
    for meta in (masked, continuation):
        got = _prefill_attention(q, narrow_k, narrow_v, meta, 0.125)
        assert got.dtype == torch.float32
        assert torch.equal(got, _prefill_attention(q, narrow_k.float(), narrow_v.float(), meta, 0.125))
