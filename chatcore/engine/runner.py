"""Turns a step plan into tensors and runs one forward pass of the model over the paged cache.

The packed row holds the decode tokens first (one per sequence), then the prefill chunks.
Positions restart for each sequence, so RoPE sees each token's true position. Only the rows
whose logits are needed (the last token of each sequence that samples) reach the LM head.
"""

from __future__ import annotations

import torch

from chatcore.engine.scheduler import ScheduledSeq, StepPlan
from chatcore.kv.tensors import KVTensors
from chatcore.models.loader import LoadedModel
from chatcore.models.paged_attention import PrefillMeta, StepMeta


def _block_table_tensor(entries: list[ScheduledSeq], num_blocks: int) -> torch.Tensor:
    """[len(entries), num_blocks] int32; padding holds block 0, never read past a context."""
    rows = [e.seq.table.block_ids[:num_blocks] for e in entries]  # type: ignore[union-attr]
    out = torch.zeros(len(rows), num_blocks, dtype=torch.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
    return out


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv: KVTensors) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.kv = kv
        self.block_size = kv.block_size

    def _prefill_meta(self, entries: list[ScheduledSeq]) -> PrefillMeta:
        bs = self.block_size
        starts = [e.start for e in entries]
        q_lens = [e.num_tokens for e in entries]
        ctx_lens = [s + q for s, q in zip(starts, q_lens, strict=True)]
        max_q, max_ctx = max(q_lens), max(ctx_lens)
        tables = _block_table_tensor(entries, -(-max_ctx // bs))
        if len(entries) == 1 and starts[0] == 0:
            return PrefillMeta(tables, None, None, 1, max_q, max_ctx)
        q_pos = torch.tensor(starts).unsqueeze(1) + torch.arange(max_q).unsqueeze(0)
        mask = (torch.arange(max_ctx).view(1, 1, -1) <= q_pos.unsqueeze(2)).unsqueeze(1)
        scatter = None
        if len(entries) > 1:
            scatter = torch.cat([torch.arange(q) + i * max_q for i, q in enumerate(q_lens)])
        return PrefillMeta(tables, mask, scatter, len(entries), max_q, max_ctx,
                           start=starts[0] if len(entries) == 1 else 0)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run the step; returns float32 logits for each entry that samples, in plan order."""
        self.kv.copy_blocks(plan.copies)
        entries = plan.decode + plan.prefill
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        for entry in entries:
            ids.extend(entry.seq.tokens[entry.start: entry.start + entry.num_tokens])
            positions.extend(range(entry.start, entry.start + entry.num_tokens))
            slots.extend(entry.slots)
            if entry.samples:
                sample_rows.append(len(ids) - 1)
        decode = plan.decode
        meta = StepMeta(
            kv=self.kv,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_decode=len(decode),
            decode_block_tables=_block_table_tensor(decode, max(-(-(e.start + 1) // self.block_size)
                                                                for e in decode)) if decode else None,
            decode_context_lens=torch.tensor([e.start + 1 for e in decode], dtype=torch.int32) if decode else None,
            prefill=self._prefill_meta(plan.prefill) if plan.prefill else None,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64).unsqueeze(0)
        position_ids = torch.tensor(positions, dtype=torch.int64).unsqueeze(0)
        hidden = self.model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                  chatcore_step=meta).last_hidden_state
        rows = hidden[0, torch.tensor(sample_rows, dtype=torch.int64)]
        return self.model.lm_head(rows).float()
