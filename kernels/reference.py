"""Torch implementations of the paged-cache operations.

These are the engine's production CPU path (what `kernels.*` runs on CPU tensors when the
Triton interpreter is off) and the oracle the Triton kernels are tested against. They are
vectorised over sequences: one gather, one attention call, no Python loop over sequences or
blocks. docs/kernels.md records the variants that were measured and why this one was kept.

Arguments are not validated here; `kernels.*` validates them before dispatching.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F


class _GatherBuffers(threading.local):
    """Per-thread buffers the CPU decode path gathers K and V into, reused across calls.

    A decode step gathers ~100 MB of K/V per layer; into freshly allocated memory, the page
    faults cost more than the copy (the reference ran 2-2.5x slower, docs/kernels.md).
    Buffers grow geometrically and are never shrunk or freed: the memory held is the largest
    gather seen per (dtype, block shape). A result never aliases them (SDPA returns a new
    tensor), and they are not used when autograd could save the gathered K/V for backward.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}

    def take(self, slot: int, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """A contiguous [num_blocks, *block shape] buffer, valid until `slot` is taken again."""
        key = (slot, cache.dtype, tuple(cache.shape[1:]))
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape[0] < num_blocks:
            rows = max(num_blocks, 0 if buffer is None else buffer.shape[0] * 3 // 2)
            buffer = self.buffers[key] = cache.new_empty((rows, *cache.shape[1:]))
        return buffer[:num_blocks]


_buffers = _GatherBuffers()


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, slot: int, reuse: bool) -> torch.Tensor:
    """cache[table] for a flat table of block ids: [len(table), block_size, KVH, D]."""
    if not reuse:
        return cache.index_select(0, table)
    return torch.index_select(cache, 0, table, out=_buffers.take(slot, cache, table.numel()))


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
    table = block_tables[:, :num_blocks].long().masked_fill(~valid[:, ::block_size], 0).flatten()

    reuse = query.device.type == "cpu" and not (torch.is_grad_enabled() and query.requires_grad)
    # [S * num_blocks, block_size, KVH, D] -> [S, KVH, span, D] as a view (no copy).
    shape = (num_seqs, span, num_kv_heads, head_dim)
    keys = _gather_blocks(key_cache, table, 0, reuse).view(shape).transpose(1, 2)
    values = _gather_blocks(value_cache, table, 1, reuse).view(shape).transpose(1, 2)
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
