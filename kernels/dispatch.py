"""The kernels' one entry: paged decode attention, the KV store and the block copy.

The engine calls these three functions and nothing else. Each runs the Triton kernel on CUDA
tensors, and in Triton's interpreter on CPU tensors while `TRITON_INTERPRET=1` is set (checked
at every call, whenever triton was imported: see kernels/_triton.py). Otherwise decode
attention runs the C kernel (`chatcore.kernels.native`, built on first use) and the KV store its
C copy (`chatcore.kernels.cpu_store`) where they take the arguments, and everything else the torch
reference in `chatcore.kernels.reference`: together, the engine's CPU path. Layouts: query [S, H, D]; key_cache and value_cache
[num_blocks, block_size, KVH, D]; block_tables int32 [S, max_blocks]; context_lens int32 [S].

Importing this module imports neither torch nor triton; they load on first call. The folder
kernels/ is imported as `chatcore.kernels` only (it has no __init__.py): a top-level `kernels`
is Hugging Face's package, which transformers imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatcore.kernels._mode import interpreting

if TYPE_CHECKING:
    import torch

__all__ = ["AttentionRoute", "copy_blocks", "paged_decode_attention", "route", "store_kv", "unified_attention",
           "uses_triton"]


def _use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or (tensor.device.type == "cpu" and interpreting())


def uses_triton(device: torch.device) -> bool:
    """Whether a step on `device` takes the Triton route now (CUDA, or the CPU under `TRITON_INTERPRET=1`)."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of one query token per sequence over its paged KV cache.

    Returns [S, H, D] in the query's dtype (written into `out` when given); the caches may be
    stored in another dtype (`kv_dtype`) and are read converted to the query's. Accumulation is
    fp32. Block-table entries past a sequence's blocks may be anything, even out of range.
    A sequence with context length 0 gets zeros. Requires context_lens[i] <=
    max_blocks * block_size. `num_splits` sets the Triton kernel's split-K factor (None: a
    heuristic from the table capacity, batch and heads); the reference path ignores it.
    """
    from chatcore.kernels import _validate

    _validate.check_decode(query, key_cache, value_cache, block_tables, context_lens, out)
    if _use_triton(query):
        from chatcore.kernels import paged_decode

        return paged_decode.paged_decode_attention(
            query, key_cache, value_cache, block_tables, context_lens, scale, num_splits, out
        )
    from chatcore.kernels import native, reference

    if native.accepts(query, key_cache, value_cache, block_tables, context_lens):
        result = native.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    else:
        result = reference.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    if out is None:
        return result
    return out.copy_(result)


def unified_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    tile_rows: int | None = None,
) -> torch.Tensor:
    """A whole step's attention in one Triton launch: sequence i's rows `query[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`
    are the last of its `seq_lens[i]` cached tokens (already stored) and attend causally over them, read in
    place through `block_tables[i]`. Decode rows are sequences of one row. Triton only (CUDA, or the CPU in the
    interpreter): kernels/unified_attention.py. `tile_rows`: rows of a query tile (None: the mode's default)."""
    from chatcore.kernels import _validate, unified_attention as impl

    _validate.check_unified(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, out)
    return impl.unified_attention(query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale, out, tile_rows)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, KVH, D] into cache slots slot_mapping (int64 [T]; negative: skip).

    A slot is block_id * block_size + offset_in_block. Values are cast to the cache dtype.
    """
    from chatcore.kernels import _validate

    _validate.check_store(key, value, key_cache, value_cache, slot_mapping)
    if _use_triton(key_cache):
        from chatcore.kernels import cache_ops as impl
    else:
        from chatcore.kernels import cpu_store
        from chatcore.kernels import reference as impl
        if cpu_store.accepts(key, value, key_cache, value_cache, slot_mapping):
            impl = cpu_store
    impl.store_kv(key, value, key_cache, value_cache, slot_mapping)


def copy_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks src[i] -> dst[i] (int64 [n]) in both caches, in place.

    dst ids must be distinct and disjoint from src.
    """
    from chatcore.kernels import _validate

    _validate.check_copy(key_cache, value_cache, src, dst)
    if _use_triton(key_cache):
        from chatcore.kernels import cache_ops as impl
    else:
        from chatcore.kernels import reference as impl
    impl.copy_blocks(key_cache, value_cache, src, dst)


@dataclass(frozen=True, slots=True)
class AttentionRoute:
    """What a step's layers call to store their keys and values and to attend their decode rows.

    `store(key, value, key_cache, value_cache, slot_mapping)` and `decode(query, key_cache,
    value_cache, block_tables, context_lens, scale)` keep the contracts of `store_kv` and
    `paged_decode_attention`."""

    store: Callable[..., None]
    decode: Callable[..., torch.Tensor]


def route(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
          value_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor | None,
          context_lens: torch.Tensor | None, max_context: int | None) -> AttentionRoute:
    """The route of a step whose first layer passes these arguments (`query`: its decode rows,
    contiguous; `block_tables` and `context_lens` None when none decodes); `max_context`, when the
    caller knows it, bounds `context_lens` so no kernel reads it back.

    Invariant: every layer of a step passes tensors of one layout (the same pool's views, the same
    metadata, views of the same shapes made by the same code), so the checks and the choice made
    here for the first layer hold for all of them. On the CPU, where the C store and decode take
    them, the route calls those directly: the per-call checks and dispatch cost a measurable share
    of a one-chat decode step (docs/measurements.md, "Route per step"), where the weights streamed
    between layers leave Python's data out of the caches. Everywhere else it is `store_kv` and
    `paged_decode_attention` themselves, checked on every call as before. A data-dependent
    precondition (a slot, a block id, a context length within `max_context`) is still checked by
    the kernel on every call."""
    if key_cache.device.type != "cpu" or _use_triton(key_cache):
        return AttentionRoute(store_kv, paged_decode_attention)
    from chatcore.kernels import _validate, cpu_store, native

    _validate.check_store(key, value, key_cache, value_cache, slot_mapping)
    if not cpu_store.accepts(key, value, key_cache, value_cache, slot_mapping):
        return AttentionRoute(store_kv, paged_decode_attention)
    if block_tables is None or context_lens is None:
        return AttentionRoute(cpu_store.store_kv, paged_decode_attention)
    _validate.check_decode(query, key_cache, value_cache, block_tables, context_lens, None)
    if not native.accepts(query, key_cache, value_cache, block_tables, context_lens):
        return AttentionRoute(cpu_store.store_kv, paged_decode_attention)

    def decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float) -> torch.Tensor:
        return native.paged_decode_attention(query, key_cache, value_cache, block_tables, context_lens, scale,
                                             max_context)

    return AttentionRoute(cpu_store.store_kv, decode)
