"""The KV store in C (`kernels/cpu_store.c`): a step's new keys and values into their cache slots.

The torch reference (`reference.store_kv`) takes two index copies and a check for skipped slots
that reads the slot mapping back: 13-20 us a layer for a decode step's few tokens, where the C
copy takes a few. It serves CPU caches of the rows' own dtype whose slots are contiguous rows
(the engine's `KVTensors`), rows of any token stride (a fused q|k|v output's key and value
views); everything else stays with the reference.

`store_kv` checks every argument the C copy trusts (dtypes, shapes, layouts, device) on every
call, from metadata alone: `dispatch.route` calls it directly for every layer of a step after
checking only the first, so these checks are all that stand between a wrong tensor and a write
past the cache.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from chatcore.kernels import native

PROFILER_NAME = "kernels::store_kv_c"  # how a call shows in torch.profiler (bench/step_ops.py)
_ARGTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)
_SLOT_DTYPE, _SLOT_BYTES = torch.int64, 8  # cpu_store.c reads the slots as int64_t


@functools.cache
def _kernel() -> Callable[..., int] | None:
    loaded = native.library()
    if loaded is None:
        return None
    function = loaded.chatcore_store_kv
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    return function


def _plan(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
          slot_mapping: torch.Tensor) -> tuple[int, int, int, int, int, int] | str:
    """The C copy's sizes for these arguments (tokens, key and value token strides in bytes, row
    bytes, cache slots, the slots' address), or why it cannot take them. What it trusts: CPU
    tensors; key, value and both caches of one dtype (the row size comes from it); key and value
    [tokens, kv_heads, head_dim], each token's row contiguous; caches [blocks, block_size,
    kv_heads, head_dim], contiguous; int64 slots [tokens], contiguous, at an 8-byte boundary (read
    as int64_t; rows are copied with memcpy, at any address). Metadata only: nothing is read, no
    device synchronised, a few attribute reads."""
    dtype, key_shape, cache_shape, slot_shape = key_cache.dtype, key.shape, key_cache.shape, slot_mapping.shape
    if not (key.is_cpu and value.is_cpu and key_cache.is_cpu and value_cache.is_cpu and slot_mapping.is_cpu):
        return "the C KV store takes CPU tensors only"
    if key.dtype is not dtype or value.dtype is not dtype or value_cache.dtype is not dtype:
        return (f"the C KV store copies rows of the cache's dtype: key {key.dtype}, value {value.dtype}, caches "
                f"{dtype} and {value_cache.dtype}")
    if slot_mapping.dtype is not _SLOT_DTYPE:
        return f"slot_mapping must be int64, not {slot_mapping.dtype}"
    if (len(key_shape) != 3 or len(cache_shape) != 4 or key_shape[1] != cache_shape[2]
            or key_shape[2] != cache_shape[3] or value.shape != key_shape or value_cache.shape != cache_shape):
        return (f"key and value must be [tokens, kv_heads, head_dim] of the caches' [blocks, block_size, kv_heads, "
                f"head_dim]: key {tuple(key_shape)}, value {tuple(value.shape)}, caches {tuple(cache_shape)} and "
                f"{tuple(value_cache.shape)}")
    if len(slot_shape) != 1 or slot_shape[0] != key_shape[0] or not slot_mapping.is_contiguous():
        return f"slot_mapping must be contiguous [{key_shape[0]}], not {tuple(slot_shape)}"
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        return "the C KV store takes contiguous caches only"
    key_strides, value_strides = key.stride(), value.stride()
    if not (key_strides[2] == value_strides[2] == 1 and key_strides[1] == value_strides[1] == key_shape[2]):
        return "the C KV store takes key and value rows whose [kv_heads, head_dim] is contiguous"
    slots = slot_mapping.data_ptr()
    if slots % _SLOT_BYTES:
        return "slot_mapping must start at an 8-byte boundary (the C reads int64_t)"
    size = dtype.itemsize
    return (key_shape[0], key_strides[0] * size, value_strides[0] * size, key_shape[1] * key_shape[2] * size,
            cache_shape[0] * cache_shape[1], slots)


def accepts(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            slot_mapping: torch.Tensor) -> bool:
    """Whether the C copy takes these arguments (and no autograd graph would be lost)."""
    return (not isinstance(_plan(key, value, key_cache, value_cache, slot_mapping), str)
            and not (torch.is_grad_enabled() and (key.requires_grad or value.requires_grad))
            and _kernel() is not None)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`reference.store_kv`'s contract for arguments the C copy takes. Raises ValueError, writing
    nothing, for arguments it does not take (`_plan` says why) and when a slot is past the cache."""
    plan = _plan(key, value, key_cache, value_cache, slot_mapping)
    if isinstance(plan, str):
        raise ValueError(plan)
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the C kernels are not built here (kernels/native.py logged why)")
    tokens, key_stride, value_stride, row_bytes, num_slots, slots = plan
    with native.traced(PROFILER_NAME):
        status = kernel(key.data_ptr(), value.data_ptr(), key_stride, value_stride, key_cache.data_ptr(),
                        value_cache.data_ptr(), slots, tokens, row_bytes, num_slots)
    if status:
        raise ValueError(f"a slot is outside the cache's {num_slots} slots")
