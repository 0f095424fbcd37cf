"""How big the device pool is, what its KV is stored in, and what a block of depth costs to recompute."""

from __future__ import annotations

import torch

from chatcore.config import Settings
from chatcore.kv.sizing import device_pool_bytes
from chatcore.kv.tensors import DTYPES, KVTensors
from chatcore.models.loader import LoadedModel


def kv_storage_dtype(settings: Settings, loaded: LoadedModel) -> torch.dtype:
    return loaded.dtype if settings.kv_dtype == "auto" else DTYPES[settings.kv_dtype]


def pool_size(settings: Settings, loaded: LoadedModel) -> int:
    """`num_blocks` when set, else as many blocks as `kv_cache_gb` (or the GPU's share) holds, at least 16."""
    if settings.num_blocks is not None:
        return settings.num_blocks
    per_block = KVTensors.bytes_per_block(loaded.num_layers, settings.block_size, loaded.num_kv_heads,
                                          loaded.head_dim, kv_storage_dtype(settings, loaded))
    budget = device_pool_bytes(settings.kv_cache_gb, loaded.device, settings.gpu_memory_fraction)
    return max(16, budget // per_block)


def depth_cost(loaded: LoadedModel, block_size: int) -> float:
    """Recompute FLOPs a block of depth adds to a block (attention), relative to a block's linear
    FLOPs (2 x parameters per token): what losing a deep block costs over a shallow one."""
    params = sum(p.numel() for p in loaded.model.parameters())
    attention_per_position = 4 * loaded.num_layers * loaded.num_heads * loaded.head_dim
    return attention_per_position * block_size / (2 * params)
