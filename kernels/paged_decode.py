"""Triton paged decode attention: a split-K (flash-decoding) pass and its reduction.

Grid of the main pass: (num_seqs, num_kv_heads, num_splits). A program owns one sequence,
one kv head and one contiguous slice of that sequence's context; it loads the query rows of
every query head in the kv head's group as one tile, so each K/V tile is read once per group.
The slice is walked TILE_N tokens at a time (several blocks per tile when block_size < TILE_N),
resolving each token's block through the block table, with an online softmax in fp32.

With one split the pass normalises and writes the output itself. Otherwise each program
writes an unnormalised partial (acc, running max m, running sum l, in the log2 domain) and
the reduction pass (grid (num_seqs, num_heads)) rescales and sums the partials.

Invariants:
- A split that owns no tokens (short context, or context 0) writes m = -inf, l = 0, acc = 0
  and contributes exactly nothing; a row whose splits are all empty is written as zeros.
- Only tokens < context_len are read; block-table entries past them are never loaded.
- Cache offsets are formed in int64 (block id cast before multiplying by the block stride).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from chatcore.kernels._triton import (
    LazyKernel,
    interpreted,
    max_combine,
    require_launchable,
    sum_combine,
)

_LOG2E = math.log2(math.e)
# Tokens per inner-loop tile when blocks are smaller than this (several blocks per tile).
_TILE_TOKENS = 64
# The query tile's rows (the GQA group) are padded, masked, to one MMA tile height, and
# head_dim to at least 16: a 16-bit tl.dot on a GPU needs its reduction dimension (head_dim
# for q.k, TILE_N for p.v) >= 16. tests/test_kernels_triton.py compiles for sm_80/sm_90.
_MIN_DOT_ROWS = 16
_MIN_DOT_COLS = 16
# Split heuristic: aim for this many programs per SM, never below this many tokens per split.
_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32
# Stand-in SM count when there is no GPU to ask (interpreter mode).
_NOMINAL_SM_COUNT = 132


def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    scale_log2,
    num_heads,
    stride_qs,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_bts,
    stride_btb,
    stride_os,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)

    rows = tl.arange(0, GROUP_PAD)
    cols = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < GROUP
    col_ok = cols < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + cols[None, :] * stride_qd,
        mask=row_ok[:, None] & col_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)

    # This split's slice of the sequence: whole tiles, the context divided evenly.
    tiles_per_split = ((context_len + TILE_N - 1) // TILE_N + NUM_SPLITS - 1) // NUM_SPLITS
    start = split * tiles_per_split * TILE_N
    end = tl.minimum(context_len, start + tiles_per_split * TILE_N)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.full([GROUP_PAD], 0.0, tl.float32)
    acc = tl.full([GROUP_PAD, HEAD_DIM_PAD], 0.0, tl.float32)
    tile = tl.arange(0, TILE_N)
    k_head = kv_head.to(tl.int64) * stride_kh
    v_head = kv_head.to(tl.int64) * stride_vh
    for tile_start in range(start, end, TILE_N):
        tokens = tile_start + tile
        tok_ok = tokens < end
        block_ids = tl.load(
            block_tables_ptr + seq * stride_bts + (tokens // BLOCK_SIZE) * stride_btb, mask=tok_ok, other=0
        ).to(tl.int64)
        slots = (tokens % BLOCK_SIZE).to(tl.int64)
        kv_mask = tok_ok[:, None] & col_ok[None, :]
        k = tl.load(
            k_ptr + block_ids[:, None] * stride_kb + slots[:, None] * stride_kt + k_head + cols[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        )
        v = tl.load(
            v_ptr + block_ids[:, None] * stride_vb + slots[:, None] * stride_vt + v_head + cols[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        )
        # DOT_FP32: fp32 inputs, and every dtype under the interpreter, whose bf16 tl.dot
        # returns garbage; "ieee" keeps a GPU from rounding fp32 operands to TF32.
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        s = tl.where(tok_ok[None, :], s * scale_log2, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m, tl.reduce(s, 1, max_combine))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.reduce(p, 1, sum_combine)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m = m_new

    out_mask = row_ok[:, None] & col_ok[None, :]
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + cols[None, :] * stride_od,
            acc.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partials are contiguous: m, l [S, H, NUM_SPLITS]; acc [S, H, NUM_SPLITS, HEAD_DIM].
        part = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m, mask=row_ok)
        tl.store(part_l_ptr + part, l, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + cols[None, :], acc, mask=out_mask)


def _reduce_kernel(
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    num_heads,
    stride_os,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    cols = tl.arange(0, HEAD_DIM_PAD)
    col_ok = cols < HEAD_DIM
    first = (seq * num_heads + head) * NUM_SPLITS  # partials are [S, H, NUM_SPLITS(, HEAD_DIM)]

    m_max = tl.full([1], float("-inf"), tl.float32)
    for split in range(NUM_SPLITS):
        m_max = tl.maximum(m_max, tl.load(part_m_ptr + first + split))
    # All splits empty (context 0): use 0 as the reference so exp2(-inf - 0) = 0, not NaN.
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.full([1], 0.0, tl.float32)
    o = tl.full([HEAD_DIM_PAD], 0.0, tl.float32)
    for split in range(NUM_SPLITS):
        weight = tl.exp2(tl.load(part_m_ptr + first + split) - m_ref)
        denom += weight * tl.load(part_l_ptr + first + split)
        o += weight * tl.load(part_acc_ptr + (first + split) * HEAD_DIM + cols, mask=col_ok, other=0.0)
    o = o / tl.where(denom == 0.0, 1.0, denom)
    out = out_ptr + seq * stride_os + head * stride_oh + cols * stride_od
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=col_ok)


_decode = LazyKernel(_decode_kernel)
_reduce = LazyKernel(_reduce_kernel)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pick_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, sm_count: int) -> int:
    """Splits per (sequence, kv head) so the grid fills the GPU without tiny splits.

    max_context is an upper bound on the context length (the block table's capacity: reading
    the real maximum would synchronise with the GPU).
    """
    wanted = -(-(_PROGRAMS_PER_SM * sm_count) // max(1, num_seqs * num_kv_heads))
    worthwhile = -(-max_context // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, worthwhile, _MAX_SPLITS))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None, out: torch.Tensor | None) -> torch.Tensor:
    """Launch the decode pass (and the reduction when split). Arguments already validated."""
    require_launchable(query)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    _check_launch(block_size, num_splits)
    if out is None:
        out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = _default_splits(query, num_kv_heads, block_tables.shape[1] * block_size)

    group = num_heads // num_kv_heads
    head_dim_pad = max(_MIN_DOT_COLS, triton.next_power_of_2(head_dim))
    part_acc, part_m, part_l = _partials(query, out, num_splits)

    _decode[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        out,
        part_acc,
        part_m,
        part_l,
        scale * _LOG2E,
        num_heads,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_tables.stride(),
        *out.stride(),
        GROUP=group,
        GROUP_PAD=max(_MIN_DOT_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=max(_TILE_TOKENS, block_size),
        NUM_SPLITS=num_splits,
        DOT_FP32=query.dtype == torch.float32 or interpreted(),
        num_warps=4,
    )
    if num_splits > 1:
        _reduce_splits(part_acc, part_m, part_l, out, head_dim_pad)
    return out


def _check_launch(block_size: int, num_splits: int | None) -> None:
    """What the Triton kernel needs beyond the validated arguments: a power-of-two block size, a split or more."""
    if block_size & (block_size - 1):
        raise ValueError(f"the Triton kernel needs a power-of-two block_size, got {block_size}")
    if num_splits is not None and num_splits < 1:
        raise ValueError("num_splits must be >= 1")


def _default_splits(query: torch.Tensor, num_kv_heads: int, max_context: int) -> int:
    """`pick_num_splits` for this device's SM count (a nominal one in the interpreter)."""
    sm_count = _sm_count(query.device) if query.is_cuda and not interpreted() else _NOMINAL_SM_COUNT
    return pick_num_splits(query.shape[0], num_kv_heads, max_context, sm_count)


def _partials(query: torch.Tensor, out: torch.Tensor,
              num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split pass's unnormalised partials (acc, m, l); with one split, `out` three times (unused)."""
    if num_splits == 1:
        return out, out, out
    num_seqs, num_heads, head_dim = query.shape
    part_m = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    return part_acc, part_m, part_l


def _reduce_splits(part_acc: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, out: torch.Tensor,
                   head_dim_pad: int) -> None:
    """The reduction pass: rescale and sum each row's split partials into `out` (the query's shape)."""
    num_seqs, num_heads, num_splits, head_dim = part_acc.shape
    _reduce[(num_seqs, num_heads)](
        part_acc,
        part_m,
        part_l,
        out,
        num_heads,
        *out.stride(),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        NUM_SPLITS=num_splits,
        num_warps=1,
    )

