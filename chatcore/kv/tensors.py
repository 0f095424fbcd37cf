"""The KV tensors: one tensor [layers, 2, num_blocks, block_size, kv_heads, head_dim].

`layer(i)` returns the key and value caches of layer i as contiguous views of shape
[num_blocks, block_size, kv_heads, head_dim], the layout the kernels take. A block id is
the same index in every layer, so the bookkeeping in `chatcore.cache` maps straight onto it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from chatcore.kernels import dispatch as kernels

# The dtypes a model or its KV may have, by the name settings and block files give them.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KVTensors:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.data = _zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype, device)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize

    @property
    def num_blocks(self) -> int:
        return self.data.shape[2]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[index, 0], self.data[index, 1]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: copy blocks src[i] -> dst[i] (int64 on the pool's device) in every layer."""
        for index in range(self.num_layers):
            key_cache, value_cache = self.layer(index)
            kernels.copy_blocks(key_cache, value_cache, src, dst)

    def read_block(self, block_id: int) -> torch.Tensor:
        """A host copy of one block across all layers: [layers, 2, block_size, kv_heads, head_dim]."""
        return self.data[:, :, block_id].to("cpu", copy=True)

    def write_block(self, block_id: int, block: torch.Tensor) -> None:
        self.data[:, :, block_id].copy_(block)

    def resize(self, num_blocks: int) -> None:
        """Grow or shrink to `num_blocks`, keeping the contents of every surviving block id."""
        current = self.num_blocks
        if num_blocks == current:
            return
        if num_blocks < current:
            self.data = self.data[:, :, :num_blocks].clone()
            return
        extra = _zeros((*self.data.shape[:2], num_blocks - current, *self.data.shape[3:]), self.data.dtype,
                       self.data.device)
        self.data = torch.cat([self.data, extra], dim=2)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed tensor. On the CPU its pages are committed only when first written (calloc'd
    memory), so a pool sized for a share of RAM costs memory only as blocks are used."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
