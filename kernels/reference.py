"""Torch implementations of the paged-cache operations.

These are the engine's CPU path (what `kernels.*` runs on CPU tensors when the Triton
interpreter is off, except float32 decode attention, which `kernels/native.py` runs in C where a
compiler is present) and the oracle the Triton kernels are tested against. They are
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
        self.buffers: dict[tuple[int, torch.dtype, tuple[int, ...], bool], torch.Tensor] = {}

    def take(self, slot: int, cache: torch.Tensor, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous [num_blocks, *block shape] buffer, valid until (slot, dtype) is taken again."""
        # Inference-mode buffers cannot be written outside inference mode (and the reverse
        # would make results inference tensors): keep one set per mode.
        key = (slot, dtype, tuple(cache.shape[1:]), torch.is_inference_mode_enabled())
        buffer = self.buffers.get(key)
        if buffer is None or buffer.shape[0] < num_blocks:
            rows = max(num_blocks, 0 if buffer is None else buffer.shape[0] * 3 // 2)
            buffer = self.buffers[key] = cache.new_empty((rows, *cache.shape[1:]), dtype=dtype)
        return buffer[:num_blocks]


_buffers = _GatherBuffers()


def _gather_blocks(cache: torch.Tensor, table: torch.Tensor, slot: int, reuse: bool,
                   dtype: torch.dtype) -> torch.Tensor:
    """cache[table] in `dtype` for a flat table of block ids: [len(table), block_size, KVH, D]."""
    if not reuse:
        return cache.index_select(0, table).to(dtype)
    gathered = torch.index_select(cache, 0, table, out=_buffers.take(slot, cache, table.numel(), cache.dtype))
    if cache.dtype == dtype:
        return gathered
    return _buffers.take(slot, cache, table.numel(), dtype).copy_(gathered)


class _StepPlan(threading.local):
    """The masks and tables of the last call, reused while the same tensors come back.

    The engine calls the decode attention once per layer with the same block table and
    context lengths; their derived tensors are built once. The plan holds the two input
    tensors themselves (not their ids), so a new tensor can never be mistaken for them, and
    checks their version counters, so an in-place change is noticed. Inference tensors (the
    engine builds its step inputs under `torch.inference_mode`) have no version counter; the
    engine never changes a step's inputs in place.
    """

    def __init__(self) -> None:
        self.inputs: tuple[torch.Tensor, torch.Tensor, int, int, int] | None = None
        self.plan: dict[str, object] = {}

    def get(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> dict[str, object]:
        last = self.inputs
        versions = (_version(block_tables), _version(context_lens))
        if (last is None or last[0] is not block_tables or last[1] is not context_lens or last[2] != block_size
                or (last[3], last[4]) != versions):
            self.plan = _make_plan(block_tables, context_lens, block_size)
            self.inputs = (block_tables, context_lens, block_size, *versions)
        return self.plan


def _version(tensor: torch.Tensor) -> int:
    return -1 if tensor.is_inference() else tensor._version


_plans = _StepPlan()
MIN_SHARED_BLOCKS = 2


def _make_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> dict[str, object]:
    num_seqs = block_tables.shape[0]
    max_len = int(context_lens.max()) if num_seqs else 0
    num_blocks = -(-max_len // block_size)
    shared = 0
    if num_seqs > 1 and max_len and block_tables.device.type == "cpu":
        full = min(int(context_lens.min()) // block_size, num_blocks)
        head = block_tables[:, :full]
        same = (head == head[0]).all(dim=0)
        shared = full if bool(same.all()) else int(same.to(torch.int8).argmin())
        # The shared part must leave every sequence at least one token in its own tail.
        shared = min(shared, (int(context_lens.min()) - 1) // block_size)
        if shared < MIN_SHARED_BLOCKS:
            shared = 0
    start = shared * block_size
    span = (num_blocks - shared) * block_size
    positions = torch.arange(span, device=block_tables.device) + start
    valid = positions < context_lens[:, None]  # [S, span] over the unshared blocks
    table = block_tables[:, shared:num_blocks].long().masked_fill(~valid[:, ::block_size], 0).flatten()
    return {"max_len": max_len, "num_blocks": num_blocks, "shared": shared, "span": span, "valid": valid,
            "table": table, "shared_table": block_tables[0, :shared].long()}


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
    query's dtype, which keys and values are converted to when the cache is stored in another
    (`kv_dtype`). Query head h attends to kv head h // (H // KVH). A sequence with context
    length 0 gets zeros.

    Block-table entries past a sequence's used blocks are never dereferenced: they are
    replaced by block 0 before the gather and the positions they cover are masked out.
    Cache slots that are gathered but masked (the tail of a sequence's last block, and block
    0 standing in for padding) must hold finite values, which a zero-initialised pool that
    only ever receives real keys and values guarantees: a NaN there would leak through the
    masked matmul. The Triton kernel does not read those slots at all.

    When every sequence starts with the same blocks (a shared system prompt, on CPU), those
    are gathered once and attended by all queries as one problem; the per-sequence tails are
    attended separately, and the two softmaxes are merged through their log-sum-exps.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    plan = _plans.get(block_tables, context_lens, block_size)
    if plan["max_len"] == 0:
        return torch.zeros_like(query)
    span = int(plan["span"])  # type: ignore[call-overload]
    valid: torch.Tensor = plan["valid"]  # type: ignore[assignment]
    reuse = query.device.type == "cpu" and not (torch.is_grad_enabled() and query.requires_grad)
    # [S * blocks, block_size, KVH, D] -> [S, KVH, span, D] as a view (no copy).
    shape = (num_seqs, span, num_kv_heads, head_dim)
    table: torch.Tensor = plan["table"]  # type: ignore[assignment]
    keys = _gather_blocks(key_cache, table, 0, reuse, query.dtype).view(shape).transpose(1, 2)
    values = _gather_blocks(value_cache, table, 1, reuse, query.dtype).view(shape).transpose(1, 2)
    # GQA: the query heads sharing a kv head become the rows of one attention problem.
    grouped = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if not plan["shared"]:
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=valid[:, None, None, :], scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)
    return _cascade(grouped, key_cache, value_cache, keys, values, plan, scale).reshape(num_seqs, num_heads, head_dim)


def _cascade(grouped: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, keys: torch.Tensor,
             values: torch.Tensor, plan: dict[str, object], scale: float) -> torch.Tensor:
    """Shared-prefix attention: one problem for the common blocks, one per sequence for the rest."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    num_seqs, num_kv_heads, group, head_dim = grouped.shape
    shared_table: torch.Tensor = plan["shared_table"]  # type: ignore[assignment]
    length = shared_table.numel() * key_cache.shape[1]
    shared_k = key_cache.index_select(0, shared_table).to(grouped.dtype).view(length, num_kv_heads, head_dim)
    shared_v = value_cache.index_select(0, shared_table).to(grouped.dtype).view(length, num_kv_heads, head_dim)
    shared_k, shared_v = shared_k.transpose(0, 1), shared_v.transpose(0, 1)
    rows = grouped.permute(1, 0, 2, 3).reshape(1, num_kv_heads, num_seqs * group, head_dim)
    head_out, head_lse = flash(rows, shared_k.unsqueeze(0), shared_v.unsqueeze(0), scale=scale)
    head_out = head_out.view(num_kv_heads, num_seqs, group, head_dim).permute(1, 0, 2, 3)
    head_lse = head_lse.view(num_kv_heads, num_seqs, group).permute(1, 0, 2)
    valid: torch.Tensor = plan["valid"]  # type: ignore[assignment]
    mask = torch.zeros(valid.shape, dtype=grouped.dtype).masked_fill_(~valid, float("-inf"))
    tail_out, tail_lse = flash(grouped, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    top = torch.maximum(head_lse, tail_lse)
    head_w = torch.exp(head_lse - top).unsqueeze(-1)
    tail_w = torch.exp(tail_lse - top).unsqueeze(-1)
    merged = (head_out.float() * head_w + torch.nan_to_num(tail_out.float()) * tail_w) / (head_w + tail_w)
    return merged.to(grouped.dtype)


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
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        # One row per slot in a flat [blocks * block_size, KVH, D] view: index_copy_ is a plain copy,
        # several times faster than index_put_ with (block, offset) pairs.
        flat = (-1, *key_cache.shape[2:])
        key_cache.view(flat).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
        value_cache.view(flat).index_copy_(0, slot_mapping, value.to(value_cache.dtype))
        return
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache.index_put_((blocks, offsets), key.to(key_cache.dtype))
    value_cache.index_put_((blocks, offsets), value.to(value_cache.dtype))


def copy_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] in both caches (copy-on-write).

    src, dst int64 [n]; dst ids are distinct and disjoint from src, so the order of the
    copies does not matter.
    """
    key_cache.index_copy_(0, dst, key_cache.index_select(0, src))
    value_cache.index_copy_(0, dst, value_cache.index_select(0, src))
