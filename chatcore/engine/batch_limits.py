"""The scheduler's bounds per step (`max_batch_tokens`, `max_num_seqs`), sized for the device under `auto`.

- CPU: 512 tokens and 64 sequences. A step's time grows with its tokens on two cores, so a larger
  prefill chunk only delays the decode rows batched beside it (docs/benchmarks.md).
- CUDA: 8192 tokens and 256 sequences. A step there is bound by launches and Python, not by its
  size, so larger bounds serve more chats faster (docs/measurements.md, "Step bounds on a GPU").
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
