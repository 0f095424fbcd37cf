"""The scheduler's bounds per step (`max_batch_tokens`, `max_num_seqs`), sized for the device under `auto`.

- CPU: 512 tokens and 64 sequences. A step's time grows with its tokens on two cores, so a larger
  prefill chunk only delays the decode rows batched beside it (docs/benchmarks.md).
- CUDA: 8192 tokens and 256 sequences. A step there is bound by launches and Python, not by its
  size: on an H200, 64 chats ran at 1,090 tok/s with the CPU's bounds and 2,268 with 8192 tokens,
  and 256 chats at 5,793 with 8192 and 256 (a standalone probe on a lent H200, 2026-12-04).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatcore.config import Settings


@dataclass(frozen=True)
class BatchLimits:
    max_batch_tokens: int
    max_num_seqs: int


CPU_LIMITS = BatchLimits(max_batch_tokens=512, max_num_seqs=64)
CUDA_LIMITS = BatchLimits(max_batch_tokens=8192, max_num_seqs=256)


def batch_limits(settings: Settings, device: torch.device) -> BatchLimits:
    """The settings' bounds, each `auto` replaced by the device's figure."""
    auto = CUDA_LIMITS if device.type == "cuda" else CPU_LIMITS
    tokens = auto.max_batch_tokens if settings.max_batch_tokens == "auto" else settings.max_batch_tokens
    seqs = auto.max_num_seqs if settings.max_num_seqs == "auto" else settings.max_num_seqs
    return BatchLimits(tokens, seqs)
