"""Torch implementations of the paged-cache operations.

These are the engine's production CPU path (what `kernels.*` runs on CPU tensors when the
Triton interpreter is off) and the oracle the Triton kernels are tested against. They are
vectorised over sequences: one gather, one attention call, no Python loop over sequences or
blocks. docs/kernels.md records the variants that were measured and why this one was kept.

Arguments are not validated here; `kernels.*` validates them before dispatching.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Single-token attention of each sequence over its paged keys and values.

    query [S, H, D]; key_cache, value_cache [num_blocks, block_size, KVH, D];
    block_tables int32 [S, max_blocks]; context_lens int32 [S]. Returns [S, H, D] in the
    query's dtype. Query head h attends to kv head h // (H // KVH). A sequence with context
    length 0 gets zeros.

    Block-table entries past a sequence's used blocks are never dereferenced: they are
    replaced by block 0 before the gather and the positions they cover are masked out.
    Cache slots that are gathered but masked (the tail of a sequence's last block, and block
    0 standing in for padding) must hold finite values, which a zero-initialised pool that
    only ever receives real keys and values guarantees: a NaN there would leak through the
    masked matmul. The Triton kernel does not read those slots at all.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    max_len = int(context_lens.max()) if num_seqs else 0
    if max_len == 0:
        return torch.zeros_like(query)
    num_blocks = -(-max_len // block_size)
    span = num_blocks * block_size

    positions = torch.arange(span, device=query.device)
    valid = positions < context_lens[:, None]  # [S, span]
    table = block_tables[:, :num_blocks].long().masked_fill(~valid[:, ::block_size], 0)

    # [S, num_blocks, block_size, KVH, D] -> [S, KVH, span, D] as a view (no copy).
    keys = key_cache[table].view(num_seqs, span, num_kv_heads, head_dim).transpose(1, 2)
    values = value_cache[table].view(num_seqs, span, num_kv_heads, head_dim).transpose(1, 2)
    # GQA: the query heads sharing a kv head become the rows of one attention problem.
    grouped = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token i's key and value into slot slot_mapping[i] (block * block_size + offset).

    key, value [T, KVH, D]; slot_mapping int64 [T]; a negative slot skips the token. Values
    are cast to the cache dtype. Works on caches of any strides (no flattened view needed).
    """
    block_size = key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache.index_put_((blocks, offsets), key[keep].to(key_cache.dtype))
    value_cache.index_put_((blocks, offsets), value[keep].to(value_cache.dtype))


def copy_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] in both caches (copy-on-write).

    src, dst int64 [n]; dst ids are distinct and disjoint from src, so the order of the
    copies does not matter.
    """
    key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
    value_cache.index_copy_(0, dst, value_cache.index_select(0, src))
