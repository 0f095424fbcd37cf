"""Prefill attention over paged blocks: every path (a chunk that starts its sequence, one that
continues cached tokens, through the CPU's cascade or with a shifted mask, several chunks
packed in one step) equals one masked attention over the sequence's gathered blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatcore.kernels import prefill
from chatcore.kernels.prefill import prefill_attention
from chatcore.models.paged_attention import PrefillMeta

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
    return q, key_cache, value_cache, table, PrefillMeta(table, (start,), (tokens,))


def _masked(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor, start: int,
            scale: float) -> torch.Tensor:
    """The oracle: one masked attention over the gathered blocks (float32 math on what is stored)."""
    tokens, heads, _ = q.shape
    length = start + tokens
    keys = key_cache[table].flatten(0, 1)[:length].float()
    values = value_cache[table].flatten(0, 1)[:length].float()
    mask = torch.arange(length).view(1, -1) <= (start + torch.arange(tokens)).view(-1, 1)
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=mask, scale=scale, enable_gqa=heads != key_cache.shape[2])
    return out.transpose(0, 1)


@pytest.mark.parametrize("start, tokens", [(16, 1), (37, 5), (64, 64), (250, 122), (1, 30)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_continuation_equals_one_masked_attention(start: int, tokens: int, heads: int, kv_heads: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    q, kc, vc, table, meta = _case(start, tokens, heads, kv_heads, torch.float32)
    scale = 64 ** -0.5
    expected = _masked(q, kc, vc, table[0], start, scale)
    for path, min_work in (("cascade", 0), ("shifted mask", 1 << 62)):
        monkeypatch.setattr(prefill, "CASCADE_MIN_WORK", min_work)
        got = prefill_attention(q, kc, vc, meta, scale)
        assert got.shape == expected.shape == (tokens, heads, 64), path
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=path)


def test_chunks_packed_in_one_step_each_attend_over_their_own_blocks() -> None:
    """Three chunks of different lengths, two starting their sequence and one continuing 40
    cached tokens, in one packed row: each equals its own masked attention."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, pool = 9, 3, 64, 40
    key_cache = torch.randn(pool, BLOCK, kv_heads, dim, generator=gen)
    value_cache = torch.randn(pool, BLOCK, kv_heads, dim, generator=gen)
    starts, lens = (0, 40, 0), (70, 25, 9)
    width = max(-(-(s + n) // BLOCK) for s, n in zip(starts, lens, strict=True))
    tables = torch.randperm(pool, generator=gen)[: 3 * width].to(torch.int32).view(3, width)
    q = torch.randn(sum(lens), heads, dim, generator=gen)
    got = prefill_attention(q, key_cache, value_cache, PrefillMeta(tables, starts, lens), 0.125)
    rows = torch.split(q, list(lens))
    expected = torch.cat([_masked(r, key_cache, value_cache, tables[i], starts[i], 0.125) for i, r in enumerate(rows)])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("start", [200, 2600])  # under and past CASCADE_MIN_WORK with 40 tokens
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gemms", [True, False], ids=["continuation GEMMs", "masked SDPA"])
def test_continuation_in_half_precision(dtype: torch.dtype, start: int, gemms: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Either path a CPU takes for half precision (by whether it has AMX tiles)."""
    monkeypatch.setattr(prefill, "HALF_CONTINUATION_GEMMS", gemms)
    q, kc, vc, table, meta = _case(start, 40, 9, 3, dtype, seed=1)
    scale = 64 ** -0.5
    expected = _masked(q, kc, vc, table[0], start, scale)
    got = prefill_attention(q, kc, vc, meta, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_a_result_never_aliases_the_reused_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 continuations without AMX take `_continuation_attention`, which reuses its score buffers."""
    monkeypatch.setattr(prefill, "HALF_CONTINUATION_GEMMS", True)
    q, kc, vc, _, meta = _case(48, 8, 9, 3, torch.bfloat16)
    first = prefill_attention(q, kc, vc, meta, 0.125)
    kept = first.clone()
    q2, kc2, vc2, _, meta2 = _case(48, 8, 9, 3, torch.bfloat16, seed=5)
    prefill_attention(q2, kc2, vc2, meta2, 0.125)
    assert torch.equal(first, kept)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_a_narrower_cache_is_read_in_the_query_dtype(kv_dtype: torch.dtype) -> None:
    """kv_dtype: both prefill paths equal the fp32 computation over the stored (rounded) values."""
    q, kc, vc, table, _ = _case(200, 40, 9, 3, torch.float32, seed=2)
    narrow_k, narrow_v = kc.to(kv_dtype), vc.to(kv_dtype)
    for start, tokens in ((200, 40), (0, 240)):
        meta = PrefillMeta(table, (start,), (tokens,))
        rows = q[:tokens] if tokens <= q.shape[0] else torch.cat([q] * 6)[:tokens]
        got = prefill_attention(rows, narrow_k, narrow_v, meta, 0.125)
        assert got.dtype == torch.float32
        assert torch.equal(got, prefill_attention(rows, narrow_k.float(), narrow_v.float(), meta, 0.125))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_step_builds_each_shifted_mask_once_and_it_is_what_sdpa_makes_of_a_boolean_one(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill, "HALF_CONTINUATION_GEMMS", False)
    monkeypatch.setattr(prefill, "CASCADE_MIN_WORK", 1 << 62)
    start, tokens = 250, 122
    q, kc, vc, table, meta = _case(start, tokens, 9, 3, dtype, seed=3)
    first = prefill_attention(q, kc, vc, meta, 0.125)
    assert list(meta.masks) == [(start, tokens, dtype)]
    mask = meta.masks[start, tokens, dtype]
    assert torch.equal(prefill_attention(q, kc, vc, meta, 0.125), first)  # the next layer: the same mask
    assert meta.masks[start, tokens, dtype] is mask and len(meta.masks) == 1
    length = start + tokens
    keys = kc[table[0].long()].flatten(0, 1)[:length]
    values = vc[table[0].long()].flatten(0, 1)[:length]
    allowed = (torch.arange(length).view(1, -1) <= (start + torch.arange(tokens)).view(-1, 1)).view(1, 1, tokens, length)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                              values.transpose(0, 1).unsqueeze(0), attn_mask=allowed, scale=0.125,
                                              enable_gqa=True)[0].transpose(0, 1)
    assert torch.equal(first, expected)  # bit for bit
