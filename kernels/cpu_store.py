"""The KV store in C (`kernels/cpu_store.c`): a step's new keys and values into their cache slots.

The torch reference (`reference.store_kv`) takes two index copies and a check for skipped slots
that reads the slot mapping back: 13-20 us a layer for a decode step's few tokens, where the C
copy takes a few. It serves CPU caches of the rows' own dtype whose slots are contiguous rows
(the engine's `KVTensors`), rows of any token stride (a fused q|k|v output's key and value
views); everything else stays with the reference.
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


@functools.cache
def _kernel() -> Callable[..., int] | None:
    loaded = native.library()
    if loaded is None:
        return None
    function = loaded.chatcore_store_kv
    function.argtypes = _ARGTYPES
    function.restype = ctypes.c_int
    return function


def _rows_contiguous(tensor: torch.Tensor) -> bool:
    """Whether each token's [heads, head_dim] is one contiguous run of memory."""
    return tensor.stride(2) == 1 and tensor.stride(1) == tensor.shape[2]


def accepts(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            slot_mapping: torch.Tensor) -> bool:
    """Whether these (already validated) arguments can take the C copy."""
    return (key.device.type == "cpu" and key.dtype == key_cache.dtype and value.dtype == key_cache.dtype
            and key_cache.is_contiguous() and value_cache.is_contiguous() and slot_mapping.is_contiguous()
            and _rows_contiguous(key) and _rows_contiguous(value)
            and not (torch.is_grad_enabled() and (key.requires_grad or value.requires_grad))
            and _kernel() is not None)


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`reference.store_kv`'s contract for arguments `accepts` took; a slot past the cache raises
    ValueError and writes nothing."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the C kernels are not built here (kernels/native.py logged why)")
    size = key.element_size()
    row_bytes = key.shape[1] * key.shape[2] * size
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    with native.traced(PROFILER_NAME):
        status = kernel(key.data_ptr(), value.data_ptr(), key.stride(0) * size, value.stride(0) * size,
                        key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
                        row_bytes, num_slots)
    if status:
        raise ValueError(f"a slot is outside the cache's {num_slots} slots")
