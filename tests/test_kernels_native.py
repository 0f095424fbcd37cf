"""The C decode attention (kernels/cpu_decode.c, the engine's CPU decode path) against the
dense oracle in every dtype mix it reads, its refusals, and its build fallback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings

from chatcore.kernels import dispatch as kernels
from chatcore.kernels import native, reference
from tests.test_kernels_reference import case_strategies, dense_attention, make_case

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the torch reference serves the CPU")


# (query, cache): the model's dtype with `kv_dtype=auto`, and the narrower caches `kv_dtype` picks.
DTYPE_MIXES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.bfloat16, torch.float16)]
# The oracle runs in float32 on the same (rounded) inputs: what remains is the output's rounding.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(("query_dtype", "cache_dtype"), DTYPE_MIXES, ids=lambda d: str(d).removeprefix("torch."))
@settings(max_examples=25, deadline=None)
@given(**case_strategies(max_seqs=12, head_dims=(16, 64, 80, 96, 128)))
def test_decode_matches_dense(query_dtype, cache_dtype, lens, num_kv_heads, group, head_dim, block_size, seed):
    query, key_cache, value_cache, table, context_lens = make_case(
        lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
        dtype=torch.float32, seed=seed)
    case = (query.to(query_dtype), key_cache.to(cache_dtype), value_cache.to(cache_dtype), table, context_lens)
    if not native.accepts(*case):
        assert cache_dtype == torch.float16 or query_dtype == torch.float16  # a compiler without _Float16
        return
    scale = head_dim**-0.5
    got = native.paged_decode_attention(*case, scale)
    assert got.shape == query.shape and got.dtype == query_dtype
    tolerance = TOLERANCE[query_dtype]
    torch.testing.assert_close(got.float(), dense_attention(*case, scale), atol=tolerance, rtol=tolerance)
    assert torch.equal(got[context_lens == 0], torch.zeros_like(got[context_lens == 0]))


def test_half_precision_output_rounds_to_nearest_even():
    """bf16 and fp16 outputs are the float32 result rounded as torch rounds it."""
    query, key_cache, value_cache, table, lens = make_case(
        [3, 50, 64], num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=torch.float32, seed=5)
    exact = native.paged_decode_attention(query, key_cache.bfloat16(), value_cache.bfloat16(), table, lens, 0.125)
    rounded = native.paged_decode_attention(query.bfloat16(), key_cache.bfloat16(), value_cache.bfloat16(), table,
                                            lens, 0.125)
    widened = native.paged_decode_attention(query.bfloat16().float(), key_cache.bfloat16(), value_cache.bfloat16(),
                                            table, lens, 0.125)
    assert not torch.equal(exact, widened)  # the query really was rounded on the way in
    assert torch.equal(rounded, widened.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_long_contexts_and_a_strided_table_row(dtype):
    """Contexts across many blocks (the prefetch of the next block), table rows taken from a
    wider buffer (the engine's packed step metadata), every kv head split per task and whole."""
    lens = [1, 16, 17, 700, 1500, 2048]
    query, key_cache, value_cache, table, context_lens = make_case(
        lens, num_kv_heads=3, group=3, head_dim=64, block_size=16, dtype=dtype)
    wide = torch.full((len(lens), table.shape[1] + 5), 7, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    strided = wide[:, : table.shape[1]]
    assert strided.stride(0) != strided.shape[1] and native.accepts(query, key_cache, value_cache, strided,
                                                                      context_lens)
    expected = dense_attention(query, key_cache, value_cache, table, context_lens, 0.125)
    for threads in (1, 2):  # 6 sequences: one kv head per task with 2 threads, whole rows with 1
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = native.paged_decode_attention(query, key_cache, value_cache, strided, context_lens, 0.125)
        finally:
            torch.set_num_threads(previous)
        torch.testing.assert_close(got.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
        if threads == 1:
            first = got
    assert torch.equal(got, first)  # each row sums in one fixed order, whatever the task split


def test_bad_tables_are_refused_not_read():
    query, key_cache, value_cache, table, lens = make_case([20, 33], num_kv_heads=1, group=2, head_dim=16,
                                                           block_size=8, dtype=torch.float32)
    bad = table.clone()
    bad[1, 2] = key_cache.shape[0]  # the third block of a 33-token context: outside the pool
    with pytest.raises(ValueError, match="outside the cache"):
        native.paged_decode_attention(query, key_cache, value_cache, bad, lens, 0.25)
    too_long = torch.tensor([20, table.shape[1] * 8 + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="longer than its block table"):
        native.paged_decode_attention(query, key_cache, value_cache, table, too_long, 0.25)


def test_what_the_c_path_declines_goes_to_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    case = make_case([5, 40], num_kv_heads=2, group=2, head_dim=16, block_size=8, dtype=torch.float32)
    query, key_cache, value_cache, table, lens = case
    assert torch.equal(kernels.paged_decode_attention(*case, 0.25), native.paged_decode_attention(*case, 0.25))
    odd_dim = make_case([5, 40], num_kv_heads=2, group=2, head_dim=12, block_size=8, dtype=torch.float32)
    # bfloat16 caches are read two elements a word, eight words a vector: head_dim % 16
    odd_bf16 = make_case([5, 40], num_kv_heads=2, group=2, head_dim=24, block_size=8, dtype=torch.bfloat16)
    grad_query = query.clone().requires_grad_()
    strided_cache = (query, key_cache.transpose(1, 2).contiguous().transpose(1, 2), value_cache, table, lens)
    for args in (odd_dim, odd_bf16, (grad_query, *case[1:]), strided_cache):
        assert not native.accepts(*args)
        assert torch.equal(kernels.paged_decode_attention(*args, 0.25), reference.paged_decode_attention(*args, 0.25))


def test_without_a_compiler_the_reference_serves(tmp_path):
    """A machine with no working C compiler still decodes: one warning, then the reference."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    code = (
        "import logging, torch\n"
        "from chatcore.kernels import dispatch as kernels, native, reference\n"
        "from tests.test_kernels_reference import make_case\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "case = make_case([9, 30], num_kv_heads=1, group=3, head_dim=16, block_size=8, dtype=torch.float32)\n"
        "same = torch.equal(kernels.paged_decode_attention(*case, 0.25), reference.paged_decode_attention(*case, 0.25))\n"
        "print(native.available(), same)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]
    assert "uses the torch reference" in result.stderr
