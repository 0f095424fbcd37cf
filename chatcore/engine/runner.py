"""Turns a step plan into tensors and runs one forward pass of the model over the paged cache.

The packed row holds the decode tokens first (one per sequence), then the prefill chunks.
Positions restart for each sequence, so RoPE sees each token's true position. The pass goes
through the model's own top-level forward (its `...ForCausalLM`), so whatever it does after the
decoder (final norm, logit scaling, final logit softcapping) applies as in transformers. Only the
rows whose logits are needed (the last token of each sequence that samples) reach the LM head:
they are given as `logits_to_keep`, a 1-D index tensor sliced from the step's one upload.

All of the step's integer metadata (block copies, token ids, positions, slots, sampled rows,
block tables, context lengths) is packed on the host into one int32
array and crosses to the device in one upload (`StepTransfers`); the tensors the model and the
kernels take are views and casts of it made on the device.
"""

from __future__ import annotations

import numpy as np
import torch

from chatcore.engine.scheduler import ScheduledSeq, StepPlan
from chatcore.engine.transfers import StepTransfers
from chatcore.kv.tensors import KVTensors
from chatcore.models.loader import LoadedModel
from chatcore.models.paged_attention import PrefillMeta, StepMeta


def _block_tables(entries: list[ScheduledSeq], width: int) -> np.ndarray:
    """[len(entries), width] int32; padding holds block 0, never read past a context."""
    out = np.zeros((len(entries), width), dtype=np.int32)
    for i, entry in enumerate(entries):
        row = entry.seq.table.block_ids[:width]  # type: ignore[union-attr]
        out[i, : len(row)] = row
    return out


class _Packer:
    """Host arrays appended in order; `take` hands back each one's slice of the uploaded tensor."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.offsets: list[int] = [0]

    def add(self, values: np.ndarray | list[int]) -> int:
        array = np.asarray(values, dtype=np.int32).reshape(-1)
        self.parts.append(array)
        self.offsets.append(self.offsets[-1] + array.size)
        return len(self.parts) - 1

    def packed(self) -> np.ndarray:
        return np.concatenate(self.parts) if self.parts else np.zeros(0, dtype=np.int32)

    def take(self, device_values: torch.Tensor, index: int) -> torch.Tensor:
        return device_values[self.offsets[index]: self.offsets[index + 1]]


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv: KVTensors) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.kv = kv
        self.block_size = kv.block_size
        self.device = loaded.device
        self.transfers = StepTransfers(loaded.device)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run the step; returns float32 logits on the device for each entry that samples, in plan order."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: Triton launches on the current device
        bs = self.block_size
        pack = _Packer()
        copies = plan.copies
        copy_src = pack.add([c[0] for c in copies])
        copy_dst = pack.add([c[1] for c in copies])
        entries = plan.decode + plan.prefill
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for entry in entries:
            end = entry.start + entry.num_tokens
            ids.extend(entry.seq.tokens[entry.start: end])
            positions.extend(range(entry.start, end))
            slots.extend(entry.slots)
            if entry.samples:
                sample_rows.append(len(ids) - 1)
        ids_at, positions_at, slots_at, rows_at = pack.add(ids), pack.add(positions), pack.add(slots), pack.add(sample_rows)
        decode = plan.decode
        decode_width = max(-(-(e.start + 1) // bs) for e in decode) if decode else 0
        decode_tables = pack.add(_block_tables(decode, decode_width))
        decode_lens = pack.add([e.start + 1 for e in decode])
        prefill = plan.prefill
        max_ctx = max((e.start + e.num_tokens for e in prefill), default=0)
        prefill_tables = pack.add(_block_tables(prefill, -(-max_ctx // bs)))

        values = self.transfers.upload(pack.packed())

        def long(index: int) -> torch.Tensor:
            return pack.take(values, index).long()

        if copies:
            self.kv.copy_blocks(long(copy_src), long(copy_dst))
        meta = StepMeta(
            kv=self.kv,
            slot_mapping=long(slots_at),
            num_decode=len(decode),
            decode_block_tables=pack.take(values, decode_tables).view(len(decode), decode_width) if decode else None,
            decode_context_lens=pack.take(values, decode_lens) if decode else None,
            prefill=PrefillMeta(pack.take(values, prefill_tables).view(len(prefill), -1),
                                tuple(e.start for e in prefill), tuple(e.num_tokens for e in prefill))
            if prefill else None,
        )
        out = self.model(input_ids=long(ids_at).unsqueeze(0), position_ids=long(positions_at).unsqueeze(0),
                         use_cache=False, logits_to_keep=long(rows_at), chatcore_step=meta)
        return out.logits[0].float()
