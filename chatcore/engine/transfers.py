"""The engine step's only crossings between host and device.

Invariant: a step makes exactly one `upload` (all of its integer metadata, packed into one
int32 buffer; a step that samples a grammar-constrained sequence adds its bitmask) and exactly one `download` (the sampled ids, and what beam search needs, packed
into one float64 tensor). Nothing else in the step reads device data back or builds device
tensors from host data, so on a GPU the step synchronises once, at its end.
tests/test_step_transfers.py holds this by counting at this seam.

On CUDA the host buffer is pinned and copied with `non_blocking`; before it is rewritten, the
previous upload's copy is waited for (it finished long ago: the step after it downloaded).
On the CPU the "device" tensor is the host buffer itself, valid until the next upload.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class StepTransfers:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None

    def upload(self, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        """The step's metadata on the device, as one int32 tensor (a view of the host buffer on the CPU)."""
        count = len(values)
        if self._copied is not None:
            self._copied.synchronize()
        if self._host.numel() < count:
            self._host = torch.empty(max(count, 2 * self._host.numel()), dtype=torch.int32, pin_memory=self._pinned)
        host = self._host[:count]
        host.numpy()[:] = values
        if self.device.type == "cpu":
            return host
        moved = host.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return moved

    def upload_bitmask(self, bitmask: torch.Tensor) -> torch.Tensor:
        """A step's grammar bitmask (chatcore/engine/grammar_matchers.py) on the device: the second upload,
        made only by steps that sample a grammar-constrained sequence."""
        return bitmask if self.device.type == "cpu" else bitmask.to(self.device, non_blocking=True)

    def download(self, packed: torch.Tensor) -> list[float]:
        """The step's results on the host: the one device-to-host copy, which waits for the step."""
        return packed.tolist()


class DownloadPack:
    """A step's device results, gathered for its one download: named segments of one float64
    tensor (token ids and float32 log-probs are exact in float64), read back by name."""

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self._spans: dict[str, tuple[int, int]] = {}
        self._size = 0

    def add(self, name: str, values: torch.Tensor) -> None:
        flat = values.reshape(-1).double()
        self._spans[name] = (self._size, self._size + flat.numel())
        self._size += flat.numel()
        self._parts.append(flat)

    def packed(self) -> torch.Tensor:
        return torch.cat(self._parts)

    def segment(self, host: list[float], name: str) -> list[float]:
        """A named segment of the downloaded values."""
        start, end = self._spans[name]
        return host[start:end]
