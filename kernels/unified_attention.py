"""Triton attention for a whole step: prefill chunks of any length and decode rows in one launch.

The step's query rows are packed [T, H, D]: sequence i owns rows cu_seqlens_q[i] .. cu_seqlens_q[i+1]
(a decode row is a sequence of one row). Its context holds seq_lens[i] tokens in the paged cache,
the last q_len of which are its own rows (already stored): row j of the sequence sits at position
seq_lens[i] - q_len + j and attends causally to every cached token up to it.

Grid: (T // BLOCK_Q + S, num_kv_heads), fixed by the shapes alone (no read-back). Query tiles are
numbered sequence by sequence: sequence i's tiles start at cu_seqlens_q[i] // BLOCK_Q + i, which
over-counts by at most one tile per sequence, so the grid always covers every row; a program finds
its sequence by a binary search over cu_seqlens_q and one whose tile lies past its sequence's rows
stores nothing. A program owns BLOCK_Q query tokens times the GROUP query heads that share its kv
head, packed as BLOCK_M = BLOCK_Q * GROUP (padded) rows, so each K/V tile is read once per group.
It walks the context TILE_N tokens at a time, resolving each token's block through the block table
(read in place: no gather copy), with an online softmax in fp32 in the log2 domain.

Invariants:
- Only tokens below each row's causal bound (and below seq_lens) are read; block-table entries past
  them may be anything and are never loaded.
- Every valid row sees its sequence's token 0 in its first tile, so its running max is finite from
  then on; padding rows stay at -inf and are guarded (weights 0, sum 1), and never stored.
- Cache offsets are int64 (block id cast before it meets the block stride).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from chatcore.kernels._triton import LazyKernel, interpreted, max_combine, require_launchable, sum_combine

__all__ = ["SUPPORTED_BLOCK_SIZES", "SUPPORTED_DTYPES", "MAX_HEAD_DIM", "check_supported", "unified_attention"]

_LOG2E = math.log2(math.e)
_TILE_TOKENS = 64  # context tokens per inner tile (several blocks when blocks are smaller)
_MIN_ROWS = 16  # a tile's rows and head_dim padded to one MMA tile (16-bit tl.dot needs K >= 16)
# Rows a query tile holds by default: one MMA tile on a GPU (untuned); in the interpreter, where each
# program costs ~20 ms of Python whatever its size, 64 (a 60-token chunk: 0.8 s a layer at 16, 0.2 at 64).
_TILE_ROWS = 16
_INTERPRETED_TILE_ROWS = 64
SUPPORTED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def check_supported(head_dim: int, block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """Refuse, in one line naming what is supported, a shape or dtype this kernel cannot serve."""
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"the Triton attention kernel needs head_dim a multiple of 8 from 8 to {MAX_HEAD_DIM}, "
                         f"got {head_dim}")
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"the Triton attention kernel needs block_size one of {SUPPORTED_BLOCK_SIZES}, "
                         f"got {block_size}")
    names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
    for what, value in (("dtype", dtype), ("kv_dtype", kv_dtype)):
        if value not in SUPPORTED_DTYPES:
            raise ValueError(f"the Triton attention kernel needs {what} one of {names}, "
                             f"got {str(value).removeprefix('torch.')}")


def _unified_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_ptr, out_ptr,
    scale_log2, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vh, stride_vd,
    stride_bts, stride_btb,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The last sequence whose first tile is at or before this one.
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tile_id:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_first = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_first
    q_local = (tile_id - (q_first // BLOCK_Q + seq)) * BLOCK_Q
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM_PAD)
    col_ok = cols < HEAD_DIM
    q_idx = q_local + rows // GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    heads = kv_head * GROUP + rows % GROUP
    token = (q_first + q_idx).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + cols[None, :] * stride_qd,
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    position = prefix + q_idx  # each row's own position: it sees keys 0 ..= position
    # The tile's last row bounds the keys it reads; a tile past its sequence's rows reads none.
    kv_end = tl.where(q_local < q_len, tl.minimum(seq_len, prefix + q_local + BLOCK_Q), 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_PAD], 0.0, tl.float32)
    span = tl.arange(0, TILE_N)
    k_head = kv_head.to(tl.int64) * stride_kh
    v_head = kv_head.to(tl.int64) * stride_vh
    table = block_tables_ptr + seq.to(tl.int64) * stride_bts
    for start in range(0, kv_end, TILE_N):
        keys = start + span
        key_ok = keys < kv_end
        block_ids = tl.load(table + (keys // BLOCK_SIZE) * stride_btb, mask=key_ok, other=0).to(tl.int64)
        slots = (keys % BLOCK_SIZE).to(tl.int64)
        kv_mask = key_ok[:, None] & col_ok[None, :]
        k = tl.load(k_ptr + block_ids[:, None] * stride_kb + slots[:, None] * stride_kt + k_head
                    + cols[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + block_ids[:, None] * stride_vb + slots[:, None] * stride_vt + v_head
                    + cols[None, :] * stride_vd, mask=kv_mask, other=0.0)
        # DOT_FP32: fp32 queries, and every dtype under the interpreter (its bf16 tl.dot is wrong);
        # "ieee" keeps a GPU from rounding fp32 operands to TF32.
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        seen = key_ok[None, :] & (keys[None, :] <= position[:, None]) & row_ok[:, None]
        s = tl.where(seen, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, max_combine))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # padding rows: no -inf - -inf
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l = l * alpha + tl.reduce(p, 1, sum_combine)
        if DOT_FP32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m = m_new

    acc = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + token[:, None] * stride_ot + heads[:, None] * stride_oh + cols[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


_unified = LazyKernel(_unified_kernel)


def tile_shape(group: int, rows: int) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M): query tokens per tile and the tile's rows (BLOCK_Q * group, padded to a power of two
    of at least `rows`; a group wider than that takes one token a tile)."""
    block_m = max(_MIN_ROWS, triton.next_power_of_2(rows), triton.next_power_of_2(group))
    return block_m // group, block_m


def unified_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None, tile_rows: int | None = None) -> torch.Tensor:
    """Attention of a step's packed rows over the paged cache, one launch.

    query [T, H, D]; key_cache, value_cache [num_blocks, block_size, KVH, D] (any supported dtype,
    read converted to the query's); block_tables int32 [S, max_blocks]; cu_seqlens_q int32 [S + 1]
    (0, then each sequence's cumulative row count, ending at T); seq_lens int32 [S] (each sequence's
    context, its own rows included, already stored). Returns [T, H, D] in the query's dtype. `tile_rows`: a
    query tile's rows (None: the mode's default).
    """
    require_launchable(query)
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    rows = tile_rows or (_INTERPRETED_TILE_ROWS if interpreted() else _TILE_ROWS)
    block_q, block_m = tile_shape(group, rows)
    _unified[(num_tokens // block_q + num_seqs, num_kv_heads)](
        query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out,
        scale * _LOG2E, num_seqs,
        *query.stride(), *key_cache.stride(), *value_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(_MIN_ROWS, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, TILE_N=max(_TILE_TOKENS, block_size),
        DOT_FP32=query.dtype == torch.float32 or interpreted(),
        num_warps=4,
    )
    return out
