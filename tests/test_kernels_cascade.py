"""The reference's shared-prefix path: sequences that start with the same blocks, as in chat
traffic with a common system prompt, attend to them as one problem. Checked against the
per-sequence oracle, with and without sharing, and across calls that reuse the step plan."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chatcore.kernels import reference
from tests.test_kernels_reference import dense_attention, make_case


def share_prefix(table: torch.Tensor, lens: torch.Tensor, shared_blocks: int, block_size: int) -> torch.Tensor:
    """Make every sequence's first `shared_blocks` blocks the first sequence's."""
    table = table.clone()
    table[1:, :shared_blocks] = table[0, :shared_blocks]
    assert int(lens.min()) > shared_blocks * block_size
    return table


@settings(max_examples=30, deadline=None)
@given(
    shared=st.integers(2, 5),
    tails=st.lists(st.integers(1, 70), min_size=2, max_size=6),
    group=st.sampled_from([1, 3]),
    block_size=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**16),
)
def test_shared_prefix_matches_the_oracle(shared, tails, group, block_size, seed) -> None:
    lens = [shared * block_size + t for t in tails]
    query, keys, values, table, context = make_case(lens, num_kv_heads=3, group=group, head_dim=64,
                                                    block_size=block_size, dtype=torch.float32, seed=seed)
    table = share_prefix(table, context, shared, block_size)
    plan = reference._make_plan(table, context, block_size)
    assert plan["shared"] == shared
    got = reference.paged_decode_attention(query, keys, values, table, context, 0.125)
    expected = dense_attention(query, keys, values, table, context, 0.125)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shared_prefix_half_precision(dtype) -> None:
    lens = [70, 50, 90, 33]
    query, keys, values, table, context = make_case(lens, num_kv_heads=3, group=3, head_dim=64, block_size=16,
                                                    dtype=dtype, seed=3)
    table = share_prefix(table, context, 2, 16)
    got = reference.paged_decode_attention(query, keys, values, table, context, 0.125)
    expected = dense_attention(query, keys, values, table, context, 0.125)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_no_sharing_below_two_blocks_or_for_one_sequence() -> None:
    lens = [40, 40]
    _, _, _, table, context = make_case(lens, num_kv_heads=1, group=1, head_dim=16, block_size=16, dtype=torch.float32)
    assert reference._make_plan(share_prefix(table, context, 1, 16), context, 16)["shared"] == 0
    assert reference._make_plan(table[:1], context[:1], 16)["shared"] == 0


def test_the_step_plan_follows_changes_to_its_inputs() -> None:
    lens = [60, 60, 60]
    query, keys, values, table, context = make_case(lens, num_kv_heads=3, group=3, head_dim=64, block_size=16,
                                                    dtype=torch.float32, seed=5)
    table = share_prefix(table, context, 3, 16)
    first = reference.paged_decode_attention(query, keys, values, table, context, 0.125)
    torch.testing.assert_close(first, dense_attention(query, keys, values, table, context, 0.125))
    context -= 20  # in place: the plan must be rebuilt, not reused
    table[2, 0] = table[1, 3]  # and sharing now stops at the first block
    second = reference.paged_decode_attention(query, keys, values, table, context, 0.125)
    torch.testing.assert_close(second, dense_attention(query, keys, values, table, context, 0.125))
    assert reference._plans.plan["shared"] == 0


def test_inference_mode_and_normal_calls_interleave() -> None:
    """The engine calls under inference mode, tests and autograd users outside it, in one thread."""
    lens = [60, 60, 60]
    for mode in (True, False, True):
        with torch.inference_mode(mode):
            query, keys, values, table, context = make_case(lens, num_kv_heads=3, group=3, head_dim=64,
                                                            block_size=16, dtype=torch.float32, seed=7)
            table = share_prefix(table, context, 3, 16)
            got = reference.paged_decode_attention(query, keys, values, table, context, 0.125)
        torch.testing.assert_close(got, dense_attention(query, keys, values, table, context, 0.125))


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shared", [0, 2])
def test_a_narrower_cache_is_read_in_the_query_dtype(kv_dtype, shared) -> None:
    """kv_dtype: fp32 queries over fp16/bf16 caches equal the fp32 path over the stored values."""
    query, keys, values, table, context = make_case([70, 50, 90, 33], num_kv_heads=3, group=3, head_dim=64,
                                                    block_size=16, dtype=torch.float32, seed=4)
    if shared:
        table = share_prefix(table, context, shared, 16)
    keys, values = keys.to(kv_dtype), values.to(kv_dtype)
    assert reference._make_plan(table, context, 16)["shared"] == shared
    got = reference.paged_decode_attention(query, keys, values, table, context, 0.125)
    assert got.dtype == torch.float32
    expected = reference.paged_decode_attention(query, keys.float(), values.float(), table, context, 0.125)
    assert torch.equal(got, expected)
