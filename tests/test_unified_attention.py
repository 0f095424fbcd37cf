"""The step's one attention launch (kernels/unified_attention.py) in Triton's interpreter against torch.

Each case packs sequences of any query length (1 is a decode row) after cached prefixes into one launch
and compares every row with a dense fp32 SDPA over that sequence's gathered keys, causal over its own
rows. Small heads and dims: the interpreter runs every program in Python.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatcore.config import Settings
from chatcore.kernels import dispatch as kernels
from chatcore.kernels.unified_attention import check_supported

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2}


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def dense(query, key_cache, value_cache, tables, q_lens, seq_lens, scale) -> torch.Tensor:
    """fp32 SDPA of each sequence's rows over its gathered context, causal within its own rows."""
    heads, dim = query.shape[1:]
    block_size, kv_heads = key_cache.shape[1:3]
    out, first = torch.zeros(query.shape), 0
    for table, q_len, length in zip(tables, q_lens, seq_lens, strict=True):
        blocks = table[: -(-length // block_size)].long()
        k = key_cache[blocks].reshape(-1, kv_heads, dim)[:length].float().transpose(0, 1)
        v = value_cache[blocks].reshape(-1, kv_heads, dim)[:length].float().transpose(0, 1)
        q = query[first: first + q_len].float().transpose(0, 1)
        allowed = torch.arange(length)[None, :] <= torch.arange(length - q_len, length)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=heads != kv_heads)
        out[first: first + q_len] = o.transpose(0, 1)
        first += q_len
    return out


def build(q_lens: list[int], prefixes: list[int], heads: int, kv_heads: int, dim: int, block_size: int,
          dtype: torch.dtype, kv_dtype: torch.dtype, pad_blocks: int = 2, seed: int = 0):
    """A pool whose sequences own shuffled blocks; each table padded past its blocks with out-of-range ids, and
    the slots after each context filled with NaN (never to be read)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [p + q for p, q in zip(prefixes, q_lens, strict=True)]
    needs = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needs) + 1
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(kv_dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=g).to(kv_dtype)
    ids = torch.randperm(num_blocks, generator=g).tolist()
    width = max(needs) + pad_blocks
    tables = torch.full((len(q_lens), width), 10**6, dtype=torch.int32)
    for i, (need, length) in enumerate(zip(needs, seq_lens, strict=True)):
        own = [ids.pop() for _ in range(need)]
        tables[i, :need] = torch.tensor(own, dtype=torch.int32)
        tail = length % block_size
        if tail:
            key_cache[own[-1], tail:] = float("nan")
            value_cache[own[-1], tail:] = float("nan")
    query = torch.randn(sum(q_lens), heads, dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return query, key_cache, value_cache, tables, cu, torch.tensor(seq_lens, dtype=torch.int32)


def check(q_lens, prefixes, *, heads=3, kv_heads=1, dim=16, block_size=8, dtype=torch.float32, kv_dtype=None) -> None:
    """Both tile heights: a GPU's 16 rows and the interpreter's default 64."""
    query, kc, vc, tables, cu, seq_lens = build(q_lens, prefixes, heads, kv_heads, dim, block_size, dtype,
                                                kv_dtype or dtype)
    want = dense(query, kc, vc, tables, q_lens, seq_lens.tolist(), 0.3)
    for rows in (16, None):
        got = kernels.unified_attention(query, kc, vc, tables, cu, seq_lens, 0.3, tile_rows=rows)
        assert got.dtype == dtype and got.shape == query.shape
        torch.testing.assert_close(got.float(), want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q_len", [1, 2, 15, 16, 17, 300])
def test_a_chunk_of_any_length_from_the_start_and_after_a_cached_prefix(q_len: int, dtype: torch.dtype) -> None:
    check([q_len, q_len], [0, 21], dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunks_continuing_prefixes_and_decode_rows_in_one_launch(dtype: torch.dtype) -> None:
    q_lens = [1, 1, 17, 1, 2, 15, 1, 16, 40]
    prefixes = [0, 30, 9, 63, 64, 0, 5, 47, 100]
    check(q_lens, prefixes, dtype=dtype, block_size=16)


@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (6, 2), (8, 1)])
def test_gqa_ratios_1_3_and_8(heads: int, kv_heads: int) -> None:
    check([1, 5, 17, 1], [12, 0, 33, 70], heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, torch.bfloat16), (torch.float16, torch.float32)])
def test_a_cache_stored_in_another_dtype_than_the_query(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    check([1, 9, 3], [40, 7, 0], dtype=dtype, kv_dtype=kv_dtype)


@pytest.mark.parametrize("block_size", [16, 64, 128])
def test_block_sizes_and_head_dims_padded_to_a_tile(block_size: int) -> None:
    check([3, 1, 20], [block_size - 3, 2 * block_size, 1], dim=24, block_size=block_size)


def test_the_output_lands_in_a_strided_out() -> None:
    query, kc, vc, tables, cu, seq_lens = build([4, 1], [3, 9], 3, 1, 16, 8, torch.float32, torch.float32)
    wide = torch.zeros(5, 3, 32)
    out = wide[:, :, :16]
    kernels.unified_attention(query, kc, vc, tables, cu, seq_lens, 0.3, out=out)
    torch.testing.assert_close(out, dense(query, kc, vc, tables, [4, 1], [7, 10], 0.3), atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(wide[:, :, 16:]) == 0


@pytest.mark.parametrize(("args", "named"), [
    ((20, 16, torch.float16, torch.float16), "head_dim a multiple of 8 from 8 to 256, got 20"),
    ((300, 16, torch.float16, torch.float16), "got 300"),
    ((64, 12, torch.float16, torch.float16), "block_size one of (1, 2, 4, 8, 16, 32, 64, 128), got 12"),
    ((64, 16, torch.float64, torch.float16), "dtype one of float32, float16, bfloat16, got float64"),
    ((64, 16, torch.float16, torch.int8), "kv_dtype one of float32, float16, bfloat16, got int8"),
])
def test_unsupported_shapes_are_refused_naming_the_supported_values(args: tuple, named: str) -> None:
    with pytest.raises(ValueError, match="^the Triton attention kernel needs") as refused:
        check_supported(*args)
    assert named in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.model
def test_an_engine_on_the_triton_route_refuses_an_unsupported_block_size_at_load(loaded_fp32) -> None:
    from chatcore.engine.core import EngineCore
    from chatcore.models.errors import UnsupportedModel

    with pytest.raises(UnsupportedModel, match=r"^the Triton attention kernel needs block_size one of "
                                               r"\(1, 2, 4, 8, 16, 32, 64, 128\), got 12$"):
        EngineCore(loaded_fp32, Settings(dtype="float32", num_blocks=64, block_size=12))
    assert EngineCore(loaded_fp32, Settings(dtype="float32", num_blocks=64, block_size=16)).kv.block_size == 16
