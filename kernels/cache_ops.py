"""Triton kernels that write the paged KV cache: store new tokens, copy whole blocks.

Both move token rows ([num_kv_heads, head_dim], padded to powers of two and masked), for keys and
values together: the store a tile of tokens per program, the copy one slot per step of its loop; and form cache offsets in int64 (block id and slot are
int64 before they meet a stride), so pools past 2^31 elements are addressed correctly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatcore.kernels._triton import LazyKernel, interpreted, require_launchable

_STORE_TOKENS = 16  # tokens a store program writes (untuned)
_INTERPRETED_STORE_TOKENS = 256


def _store_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vcd,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,
):
    tokens = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)
    in_range = tokens < num_tokens
    slots = tl.load(slot_mapping_ptr + tokens, mask=in_range, other=-1)
    # A negative slot skips the token: it is neither read nor written.
    wanted = (slots >= 0)[:, None, None]
    block = (slots // BLOCK_SIZE)[:, None, None]
    offset = (slots % BLOCK_SIZE)[:, None, None]
    rows = tokens[:, None, None]
    heads = tl.arange(0, KV_HEADS_PAD)[None, :, None]
    cols = tl.arange(0, HEAD_DIM_PAD)[None, None, :]
    mask = wanted & (heads < NUM_KV_HEADS) & (cols < HEAD_DIM)
    k = tl.load(key_ptr + rows * stride_kt + heads * stride_kh + cols * stride_kd, mask=mask)
    v = tl.load(value_ptr + rows * stride_vt + heads * stride_vh + cols * stride_vd, mask=mask)
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kct + heads * stride_kch + cols * stride_kcd
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + cols * stride_vcd
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def _copy_blocks_kernel(
    key_cache_ptr,
    value_cache_ptr,
    src_ptr,
    dst_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pair = tl.program_id(0)
    src = tl.load(src_ptr + pair)
    dst = tl.load(dst_ptr + pair)
    heads = tl.arange(0, KV_HEADS_PAD)[:, None]
    cols = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (cols < HEAD_DIM)
    k_row = heads * stride_kh + cols * stride_kd
    v_row = heads * stride_vh + cols * stride_vd
    for slot in range(BLOCK_SIZE):
        k = tl.load(key_cache_ptr + src * stride_kb + slot * stride_kt + k_row, mask=mask)
        tl.store(key_cache_ptr + dst * stride_kb + slot * stride_kt + k_row, k, mask=mask)
        v = tl.load(value_cache_ptr + src * stride_vb + slot * stride_vt + v_row, mask=mask)
        tl.store(value_cache_ptr + dst * stride_vb + slot * stride_vt + v_row, v, mask=mask)


_store_kv = LazyKernel(_store_kv_kernel)
_copy_blocks = LazyKernel(_copy_blocks_kernel)


def _row_meta(cache: torch.Tensor) -> dict[str, int]:
    _, block_size, num_kv_heads, head_dim = cache.shape
    return {
        "NUM_KV_HEADS": num_kv_heads,
        "KV_HEADS_PAD": triton.next_power_of_2(num_kv_heads),
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "BLOCK_SIZE": block_size,
    }


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Launch the store kernel, one program per tile of tokens (in the interpreter, where a program costs its
    Python whatever its size, a larger tile: 300 tokens took 2.8 s a program each). Arguments already validated."""
    require_launchable(key_cache)
    if key.shape[0] == 0:
        return
    # Cast on the host: the kernel then copies bits, and no rounding mode is involved.
    key = key.to(key_cache.dtype)
    value = value.to(value_cache.dtype)
    tokens = _INTERPRETED_STORE_TOKENS if interpreted() else _STORE_TOKENS
    _store_kv[(triton.cdiv(key.shape[0], tokens),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.shape[0],
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        **_row_meta(key_cache),
        TOKENS=tokens,
        num_warps=4,
    )


def copy_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Launch the copy kernel, one program per (src, dst) pair. Arguments already validated."""
    require_launchable(key_cache)
    if src.shape[0] == 0:
        return
    _copy_blocks[(src.shape[0],)](
        key_cache,
        value_cache,
        src,
        dst,
        *key_cache.stride(),
        *value_cache.stride(),
        **_row_meta(key_cache),
        num_warps=1,
    )
