"""Decode steps replayed as CUDA graphs: one launch for the whole forward of a decode-only step.

On CUDA a decode step of a small model is bound by the host (a profile at 64 chats on an H200:
1,230 launches a step, the GPU busy 10% of it). At start, the model's forward over a decode-only
batch is captured once per batch size of a ladder (1, 2, 4, 8, then steps of 16 up to
`max_num_seqs`); a decode step then pads its rows to the next captured size and replays.

Invariants:
- Each captured size `b` owns one static int32 input buffer, laid out [ids b | positions b |
  slots b | context lengths b | block tables b x width]; a step writes the whole of it with one
  host-to-device copy from the step's upload, then replays. Padding rows have slot -1 (the store
  skips them) and context length 0 (the kernel gives zeros), so they touch no block.
- The block tables are `width` wide, the longest context in blocks, so any sequence fits.
- A graph reads the KV tensor it was captured with; after the pool is resized (a new tensor),
  every size is captured again before it replays.
- The logits a replay returns live in the graph's memory: valid until the next replay, which is
  the next step's (the step samples from them before that).
Prefill and mixed steps run eagerly (chatcore/engine/runner.py).

`capture=False` builds the same buffers and runs the same forward eagerly at each "replay": the
padding and the buffers' layout are tested on the CPU, where CUDA graphs do not exist
(tests/test_decode_graphs.py); the capture itself runs only on a GPU (`make gpu-check`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from chatcore.kv.tensors import KVTensors
from chatcore.models.paged_attention import StepMeta

log = logging.getLogger(__name__)
SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 16
FIELDS = 4  # ids, positions, slots, context lengths: one int32 each per row, before the block tables

# The model's forward over a decode batch: (input ids [1, b], positions [1, b], step metadata) -> logits [b, vocab].
Forward = Callable[[torch.Tensor, torch.Tensor, StepMeta], torch.Tensor]


def ladder(max_num_seqs: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then every multiple of 16, and `max_num_seqs` itself."""
    sizes = {s for s in SMALL_SIZES if s < max_num_seqs}
    sizes.update(range(SIZE_STEP, max_num_seqs, SIZE_STEP))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def host_layout(size: int, width: int, ids: list[int], positions: list[int], slots: list[int],
                context_lens: list[int], tables: np.ndarray) -> np.ndarray:
    """The static buffer's contents for `len(ids)` rows padded to `size`: int32 [size * (FIELDS + width)]."""
    rows = len(ids)
    out = np.zeros(size * (FIELDS + width), dtype=np.int32)
    out[0:rows] = ids
    out[size: size + rows] = positions
    out[2 * size: 3 * size] = -1
    out[2 * size: 2 * size + rows] = slots
    out[3 * size: 3 * size + rows] = context_lens
    out[FIELDS * size:].reshape(size, width)[:rows, : tables.shape[1]] = tables
    return out


@dataclass
class _Graph:
    size: int
    inputs: torch.Tensor  # the static buffer, int32 [size * (FIELDS + width)]
    logits: torch.Tensor | None = None  # the captured output
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """The captured decode forwards, one per size of `ladder(max_num_seqs)`."""

    def __init__(self, forward: Forward, kv: KVTensors, max_num_seqs: int, width: int, *, capture: bool) -> None:
        self.forward = forward
        self.kv = kv
        self.width = width
        self.capture = capture
        self.sizes = ladder(max_num_seqs)
        self._graphs: dict[int, _Graph] = {}
        self._captured_for: int | None = None  # the KV tensor's address the graphs read
        self._pool = None

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, rows: int) -> int | None:
        """The captured size a step of `rows` decode rows pads to; None past the largest."""
        return next((s for s in self.sizes if s >= rows), None)

    def capture_all(self) -> float:
        """Capture every size, largest first so the smaller ones reuse its memory; returns the seconds taken."""
        started = time.perf_counter()
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture_one(size)
        self._captured_for = self.kv.data.data_ptr()
        return time.perf_counter() - started

    def _capture_one(self, size: int) -> _Graph:
        inputs = torch.from_numpy(host_layout(size, self.width, [], [], [], [], np.zeros((0, 0), np.int32)))
        entry = _Graph(size, inputs.to(self.kv.data.device))
        if not self.capture:
            return entry
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run(entry)  # compiles the Triton kernels and warms the allocator before the capture
        torch.cuda.current_stream().wait_stream(stream)
        entry.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(entry.graph, pool=self._pool):
            entry.logits = self._run(entry)
        return entry

    def _run(self, entry: _Graph) -> torch.Tensor:
        size, width, values = entry.size, self.width, entry.inputs
        meta = StepMeta(
            kv=self.kv,
            slot_mapping=values[2 * size: 3 * size].long(),
            num_decode=size,
            decode_block_tables=values[FIELDS * size:].view(size, width),
            decode_context_lens=values[3 * size: 4 * size],
            prefill=None,
        )
        ids = values[:size].long().unsqueeze(0)
        positions = values[size: 2 * size].long().unsqueeze(0)
        return self.forward(ids, positions, meta)

    def replay(self, size: int, uploaded: torch.Tensor, rows: int) -> torch.Tensor:
        """Run the step whose static buffer's contents were uploaded (`host_layout`); the logits of its `rows` rows."""
        if self._captured_for != self.kv.data.data_ptr():
            seconds = self.capture_all()
            log.info("decode graphs captured again for the resized KV pool in %.2f s", seconds)
        entry = self._graphs[size]
        entry.inputs.copy_(uploaded, non_blocking=True)
        if entry.graph is None:
            return self._run(entry)[:rows]
        entry.graph.replay()
        assert entry.logits is not None
        return entry.logits[:rows]
