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

A decode-only step replays a captured graph instead, when `enable_decode_graphs` captured them
(on CUDA, at start: chatcore/engine/decode_graphs.py); its upload then holds the block copies and
the graph's static input buffer, padded to the captured size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from chatcore.engine.decode_graphs import DecodeGraphs, host_layout
from chatcore.engine.step_types import ScheduledSeq, StepPlan
from chatcore.engine.transfers import StepTransfers
from chatcore.kv.tensors import KVTensors
from chatcore.models.loader import LoadedModel
from chatcore.models.paged_attention import PrefillMeta, StepMeta, UnifiedMeta, unified_route

log = logging.getLogger(__name__)


def _block_tables(entries: list[ScheduledSeq], width: int) -> np.ndarray:
    """[len(entries), width] int32; padding holds block 0, never read past a context."""
    out = np.zeros((len(entries), width), dtype=np.int32)
    for i, entry in enumerate(entries):
        row = entry.block_ids[:width]
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

    def add_copies(self, copies: list[tuple[int, int]]) -> tuple[int, int] | None:
        """The step's copy-on-write pairs as two arrays (sources, destinations); None when there are none."""
        if not copies:
            return None
        return self.add([c[0] for c in copies]), self.add([c[1] for c in copies])

    def copy_blocks(self, kv: KVTensors, device_values: torch.Tensor, at: tuple[int, int] | None) -> None:
        """Run the copies `add_copies` packed, before anything writes the step's KV."""
        if at is not None:
            kv.copy_blocks(self.take(device_values, at[0]).long(), self.take(device_values, at[1]).long())


def _token_rows(entries: list[ScheduledSeq]) -> tuple[list[int], list[int], list[int], list[int]]:
    """The step's packed row: token ids, positions and KV slots of every entry's chunk, and the rows
    whose logits sample (each sampling entry's last)."""
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
    return ids, positions, slots, sample_rows


_MetaBuilder = Callable[[torch.Tensor, KVTensors, torch.Tensor], StepMeta]


def _pack_split(pack: _Packer, plan: StepPlan, bs: int) -> _MetaBuilder:
    """The CPU route's metadata: decode rows' tables and lengths, then each prefill chunk's table and span."""
    decode, prefill = plan.decode, plan.prefill
    decode_width = max(-(-(e.start + 1) // bs) for e in decode) if decode else 0
    decode_tables = pack.add(_block_tables(decode, decode_width))
    decode_lens = pack.add([e.start + 1 for e in decode])
    max_ctx = max((e.start + e.num_tokens for e in prefill), default=0)
    prefill_tables = pack.add(_block_tables(prefill, -(-max_ctx // bs)))

    def meta(values: torch.Tensor, kv: KVTensors, slots: torch.Tensor) -> StepMeta:
        return StepMeta(
            kv=kv,
            slot_mapping=slots,
            num_decode=len(decode),
            decode_block_tables=pack.take(values, decode_tables).view(len(decode), decode_width) if decode else None,
            decode_context_lens=pack.take(values, decode_lens) if decode else None,
            prefill=PrefillMeta(pack.take(values, prefill_tables).view(len(prefill), -1),
                                tuple(e.start for e in prefill), tuple(e.num_tokens for e in prefill))
            if prefill else None,
            decode_max_context=max((e.start + 1 for e in decode), default=0),
        )

    return meta


def _pack_unified(pack: _Packer, plan: StepPlan, bs: int) -> _MetaBuilder:
    """The Triton route's metadata: every entry (decode rows, then chunks) as one sequence of the step's
    one attention launch a layer: one table row each, the cumulative row counts and the context lengths."""
    entries = plan.decode + plan.prefill
    lengths = [e.start + e.num_tokens for e in entries]
    width = -(-max(lengths) // bs)
    tables = pack.add(_block_tables(entries, width))
    cu_seqlens = pack.add(np.concatenate(([0], np.cumsum([e.num_tokens for e in entries]))))
    seq_lens = pack.add(lengths)

    def meta(values: torch.Tensor, kv: KVTensors, slots: torch.Tensor) -> StepMeta:
        unified = UnifiedMeta(pack.take(values, tables).view(len(entries), width), pack.take(values, cu_seqlens),
                              pack.take(values, seq_lens))
        return StepMeta(kv=kv, slot_mapping=slots, num_decode=len(plan.decode), decode_block_tables=None,
                        decode_context_lens=None, prefill=None, unified=unified)

    return meta


class ModelRunner:
    def __init__(self, loaded: LoadedModel, kv: KVTensors) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.kv = kv
        self.block_size = kv.block_size
        self.device = loaded.device
        self.transfers = StepTransfers(loaded.device)
        self.graphs: DecodeGraphs | None = None

    def enable_decode_graphs(self, max_num_seqs: int, max_context: int, *, capture: bool) -> None:
        """Capture the decode forward for every batch size up to `max_num_seqs` (`capture=False`: the same
        buffers, run eagerly; for tests on the CPU). A capture that fails leaves decode steps eager."""
        width = -(-max_context // self.block_size)
        graphs = DecodeGraphs(self._decode_forward, self.kv, max_num_seqs, width, capture=capture)
        try:
            with torch.inference_mode():
                seconds = graphs.capture_all()
        except Exception:  # the eager path still serves; the operator learns why from the log
            log.warning("decode graphs could not be captured; decode steps run eagerly", exc_info=True)
            return
        self.graphs = graphs
        log.info("decode graphs: %d batch sizes up to %d captured in %.2f s", len(graphs.sizes), graphs.max_size,
                 seconds)

    def _decode_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """Every row's logits: the graph's forward (a decode row always samples)."""
        out = self.model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=0, chatcore_step=meta)
        return out.logits[0].float()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run the step; returns float32 logits on the device for each entry that samples, in plan order."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: Triton launches on the current device
        graphs = self.graphs
        size = graphs.size_for(len(plan.decode)) if graphs is not None and plan.decode and not plan.prefill else None
        if size is not None and max(e.start for e in plan.decode) < graphs.width * self.block_size:  # type: ignore[union-attr]
            return self._replay(plan, size)
        return self._eager(plan)

    def _eager(self, plan: StepPlan) -> torch.Tensor:
        """Any step through the model's own modules: one upload of every index, the block copies, one forward."""
        pack = _Packer()
        copy_at = pack.add_copies(plan.copies)
        ids_at, positions_at, slots_at, rows_at = (pack.add(rows) for rows in _token_rows(plan.decode + plan.prefill))
        attention = _pack_unified(pack, plan, self.block_size) if unified_route(self.device) \
            else _pack_split(pack, plan, self.block_size)
        values = self.transfers.upload(pack.packed())

        def long(index: int) -> torch.Tensor:
            return pack.take(values, index).long()

        pack.copy_blocks(self.kv, values, copy_at)
        meta = attention(values, self.kv, long(slots_at))
        out = self.model(input_ids=long(ids_at).unsqueeze(0), position_ids=long(positions_at).unsqueeze(0),
                         use_cache=False, logits_to_keep=long(rows_at), chatcore_step=meta)
        return out.logits[0].float()

    def _replay(self, plan: StepPlan, size: int) -> torch.Tensor:
        """A decode-only step through the graph of `size` rows: one upload, the block copies, one replay."""
        assert self.graphs is not None
        decode = plan.decode
        pack = _Packer()
        copy_at = pack.add_copies(plan.copies)
        width = max(-(-(e.start + 1) // self.block_size) for e in decode)
        layout = pack.add(host_layout(size, self.graphs.width, [e.seq.tokens[e.start] for e in decode],
                                      [e.start for e in decode], [e.slots[0] for e in decode],
                                      [e.start + 1 for e in decode], _block_tables(decode, width)))
        values = self.transfers.upload(pack.packed())
        pack.copy_blocks(self.kv, values, copy_at)
        return self.graphs.replay(size, pack.take(values, layout), len(decode))
