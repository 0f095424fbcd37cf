"""Every KV table's one owner, on the engine thread only (like vLLM v1's `KVCacheManager`).

The manager keeps every table: a running request's, one per sequence, keyed by request id and
sequence; the prefix held for a request being added; the sessions' pins. Nothing outside it (and
`chatcore.cache`, which defines tables) holds a table or calls its methods: callers name a request
and a sequence, and get numbers back (`block_ids` for the step's block tables).

A request's sequences get their tables here: `get_computed_blocks` at admission (the prefix held for
the request, else the pool's longest cached prefix), then `admit` (when `can_admit` says the pool
takes the rest above its low watermark) or `unwind`; `allocate_slots` each step, which returns None
when the pool cannot serve (pins reclaimed first), as vLLM's does; `cache_blocks` hashes the computed
full blocks after the step; `fork` for samples and beams. They give them back here: `finish_seq` as a
sample stops, `free_seq` for one sequence, `free` for a whole request.

A session's finished turn keeps its first sample's table as the session's pin (the rule:
`chatcore.engine.pins.keeps_pin`): a lock reference held by session id (SGLang's `lock_ref`), which
the sessions layer drops by id (`unpin`, `drop`) and never holds. Pins expire after the hot window,
are trimmed to `max_hot_sessions` and `pinned_kv_fraction` of the pool (`tend_pins`), and are
reclaimed least recently pinned first when the scheduler needs blocks, before any running request is
preempted. A released pin's full blocks stay findable as cached-free: the session is merely warm.

A prefix prepared for a request as it is added (the session's pin, or blocks read back from the disk
tier) is held by request id until the scheduler admits the request, or `free` releases it.

`kv` may be None for the block bookkeeping alone (the benchmarks' replays): then nothing is installed
from disk or read for it.

Invariant: `_release` is the only code that releases a table (tests/test_kv_ownership.py checks the
source); reference counts themselves change only in `chatcore.cache.pool`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chatcore.cache import BlockPool, BlockTable, longest_prefix
from chatcore.engine.commands import SessionPrefix
from chatcore.engine.fits import PoolLimits
from chatcore.engine.pins import keeps_pin
from chatcore.engine.request import Request, TokenSequence
from chatcore.kv.tensors import KVTensors

Copy = tuple[int, int]


@dataclass(slots=True)
class Pin:
    table: BlockTable
    expires_at: float


class KVCacheManager:
    def __init__(self, pool: BlockPool, kv: KVTensors | None, hot_window_s: float) -> None:
        self.pool = pool
        self.kv = kv
        self.block_size = pool.block_size
        self.hot_window_s = hot_window_s
        self._pins: OrderedDict[str, Pin] = OrderedDict()
        self._held: dict[str, BlockTable] = {}
        self._computed: dict[str, dict[TokenSequence, BlockTable]] = {}  # looked up, not yet admitted
        self._tables: dict[str, dict[TokenSequence, BlockTable]] = {}  # request id -> sequence -> table

    def _release(self, table: BlockTable) -> None:
        """The one place a table is released: its blocks' references drop (deepest first)."""
        if not table.released:
            table.release()

    # ----- what may ever fit ------------------------------------------------------------------
    def limits(self) -> PoolLimits:
        """The pool's size as admission sees it (`chatcore.engine.fits`)."""
        num_blocks = self.pool.num_blocks
        return PoolLimits(self.block_size, num_blocks, num_blocks - self.pool.low_watermark_blocks)

    # ----- admission -------------------------------------------------------------------------
    def prepare(self, req: Request, prefix: SessionPrefix) -> int | None:
        """A session turn's prefix, held for `req` as it is added: the session's pin when it holds a
        prefix of the prompt, else the pool's cached prefix extended by the blocks read back from
        disk. Returns None when the request may be added; else it declines, returning how many full
        prompt blocks the pool holds, so the caller reads the rest from the disk tier first.

        Tokens count as served by the disk tier only once a held table covers their blocks: a
        prefetched block evicted before the turn is added served nothing."""
        prompt, bs = req.prompt, self.block_size
        max_blocks = (len(prompt) - 1) // bs
        table = self._take_pin(prefix.session_id)
        if table is not None:
            if prefix.use_pin and table.num_tokens < len(prompt):
                self._hold(req, table)
                return None
            self._release(table)
        if prefix.disk is not None:
            start, tensors = prefix.disk
            if tensors:
                self.make_room(prefix.session_id, len(tensors))
            table, loaded = self.install(prompt, req.salt, max_blocks, start, tensors, req.request_id)
            self._hold(req, table)
            req.cached_disk_tokens = loaded + bs * _overlap(prefix.prefetched, len(table) - loaded // bs)
            return None
        device_blocks = self.cached_prefix(prompt, req.salt, max_blocks)
        if prefix.disk_tier and device_blocks < max_blocks:
            return device_blocks
        if prefix.prefetched:  # held from here to the scheduler, so that what was prefetched serves
            table, _ = self.install(prompt, req.salt, max_blocks, device_blocks, [], req.request_id)
            self._hold(req, table)
            req.cached_disk_tokens = bs * _overlap(prefix.prefetched, len(table))
        return None

    def _hold(self, req: Request, table: BlockTable) -> None:
        table.owner = req.request_id
        self._held[req.request_id] = table

    def get_computed_blocks(self, req: Request, seqs: Sequence[TokenSequence]) -> int:
        """Look up each sequence's starting table (vLLM's `get_computed_blocks`): the prefix held for
        the request (its first sample), else the pool's longest cached prefix. At least one token is
        always left to compute, since its logits start the answer. The tables wait here until `admit`
        gives them to the sequences, or `unwind` takes them back when the request stays waiting.
        Returns how many full blocks the first sequence starts with."""
        tables: dict[TokenSequence, BlockTable] = {}
        for seq in seqs:
            held = self._held.get(req.request_id) if seq.index == 0 else None
            if held is not None and held.num_tokens < len(seq.tokens):
                tables[seq] = held
                continue
            if held is not None:
                self._release(self._held.pop(req.request_id))
            max_blocks = (len(seq.tokens) - 1) // self.block_size
            ids, hashes = longest_prefix(self.pool.find, seq.tokens, self.block_size, req.salt, max_blocks)
            tables[seq] = BlockTable.from_prefix(self.pool, ids, hashes, owner=f"{req.request_id}/{seq.index}")
        self._computed[req.request_id] = tables
        return len(tables[seqs[0]])

    def can_admit(self, req: Request, *, alone: bool) -> bool:
        """Whether the pool takes the rest of the looked-up sequences' tokens and keeps its low watermark
        free (`alone`: nothing runs, so the watermark may be spent); pins are reclaimed first if not."""
        bs = self.block_size
        needed = sum(-(-len(seq.tokens) // bs) - len(table) for seq, table in self._computed[req.request_id].items())
        if self.pool.can_admit(needed) or (alone and self.pool.can_allocate(needed)):
            return True
        self.reclaim(needed + self.pool.low_watermark_blocks)
        return self.pool.can_admit(needed)

    def admit(self, req: Request) -> None:
        """The looked-up tables become the sequences' own (the held prefix with them)."""
        self._held.pop(req.request_id, None)
        tables = self._tables.setdefault(req.request_id, {})
        for seq, table in self._computed.pop(req.request_id).items():
            table.owner = f"{req.request_id}/{seq.index}"
            tables[seq] = table
            seq.num_computed = table.num_tokens

    def unwind(self, req: Request) -> None:
        """Take back the tables `get_computed_blocks` looked up for a request that stays waiting; its
        held prefix stays held."""
        held = self._held.get(req.request_id)
        for table in self._computed.pop(req.request_id, {}).values():
            if table is not held:
                self._release(table)

    # ----- running sequences -------------------------------------------------------------------
    def _table(self, req: Request, seq: TokenSequence) -> BlockTable:
        return self._tables[req.request_id][seq]

    def has_table(self, req: Request, seq: TokenSequence) -> bool:
        return seq in self._tables.get(req.request_id, {})

    def block_ids(self, req: Request, seq: TokenSequence) -> list[int]:
        """The sequence's physical blocks, in logical order (the step's block table row): read, never change."""
        return self._table(req, seq).block_ids

    def hashed_block_ids(self, req: Request, seq: TokenSequence) -> list[int]:
        """The sequence's leading blocks whose content is hashed (`cache_blocks`): what a lookup finds."""
        table = self._table(req, seq)
        return table.block_ids[: len(table.hashes)]

    def allocate_slots(self, req: Request, seq: TokenSequence, num_tokens: int) -> tuple[list[int], list[Copy]] | None:
        """Slots for the sequence's next `num_tokens`, and the (src, dst) block copies a shared last
        block needs first (copy-on-write). None when the pool cannot serve them, even with every pin
        reclaimed (vLLM's `allocate_slots`): the caller preempts, and nothing changed."""
        table = self._table(req, seq)
        needed = table.blocks_needed(num_tokens)
        if not self.pool.can_allocate(needed):
            self.reclaim(needed)
            if not self.pool.can_allocate(needed):
                return None
        return table.append_slots(num_tokens)

    def cache_blocks(self, req: Request, seq: TokenSequence) -> None:
        """Hash the full blocks among the sequence's computed tokens, so that later lookups find them."""
        self._table(req, seq).commit(seq.tokens, seq.num_computed, req.salt)

    def fork(self, req: Request, parent: TokenSequence, child: TokenSequence) -> None:
        """`child` (a sample or a beam) gets a table sharing the parent's blocks; its last block is copied on write."""
        self._tables[req.request_id][child] = self._table(req, parent).fork(owner=f"{req.request_id}/{child.index}")

    def rename(self, req: Request) -> None:
        """Name each of the request's tables after its sequence's index (beams are renumbered every step)."""
        for seq, table in self._tables.get(req.request_id, {}).items():
            table.owner = f"{req.request_id}/{seq.index}"

    def free_seq(self, req: Request, seq: TokenSequence) -> None:
        table = self._tables.get(req.request_id, {}).pop(seq, None)
        if table is not None:
            self._release(table)
        seq.num_computed = 0

    def finish_seq(self, req: Request, seq: TokenSequence) -> None:
        """A sample stopped: its table goes back now, unless it stays for the session's pin (`keeps_pin`)."""
        if not keeps_pin(req.session_id, seq.index, seq.finish_reason):
            self.free_seq(req, seq)

    def free(self, req: Request) -> list[bytes]:
        """Release every table a request holds, in any state. A session's turn that ended well first
        keeps its first sample's table as the session's pin; returns that table's block hashes
        (for the disk tier), or [] when nothing was pinned."""
        kept = self._keep(req)
        held = self._held.pop(req.request_id, None)
        if held is not None:
            self._release(held)
        self.unwind(req)
        for seq in req.seqs:
            self.free_seq(req, seq)
        for table in self._tables.pop(req.request_id, {}).values():
            self._release(table)
        return kept

    def _keep(self, req: Request) -> list[bytes]:
        """The table `keeps_pin` keeps (a session's turn that ended well: its first sample's) becomes the
        session's pin; its block hashes, or []."""
        session_id, tables = req.session_id, self._tables.get(req.request_id, {})
        for seq in req.seqs:
            if session_id is not None and seq in tables and keeps_pin(session_id, seq.index, seq.finish_reason):
                table = tables.pop(seq)
                self._pin(session_id, table)
                return list(table.hashes)
        return []

    # ----- pins --------------------------------------------------------------------------------
    def _pin(self, session_id: str, table: BlockTable) -> None:
        """Hold `table` for the hot window, replacing (and releasing) any older pin of the session."""
        self.unpin(session_id)
        table.owner = f"session:{session_id}"
        self._pins[session_id] = Pin(table, time.monotonic() + self.hot_window_s)
        self.pool.claim(session_id, table.block_ids)

    def _take_pin(self, session_id: str) -> BlockTable | None:
        pin = self._pins.pop(session_id, None)
        return pin.table if pin is not None else None

    def unpin(self, session_id: str) -> bool:
        pin = self._pins.pop(session_id, None)
        if pin is None:
            return False
        self._release(pin.table)
        return True

    def drop(self, session_id: str) -> None:
        """A deleted session: its pin goes, and the eviction forecast forgets it."""
        self.unpin(session_id)
        self.pool.drop_group(session_id)

    @property
    def pinned_sessions(self) -> list[str]:
        """Pinned sessions, least recently pinned first."""
        return list(self._pins)

    def pinned_block_ids(self, session_id: str) -> list[int]:
        """The blocks of the session's pin, in logical order ([] when it holds none)."""
        pin = self._pins.get(session_id)
        return list(pin.table.block_ids) if pin is not None else []

    def pinned_blocks(self, session_id: str) -> int:
        pin = self._pins.get(session_id)
        return len(pin.table) if pin is not None else 0

    def reclaim(self, blocks_wanted: int) -> int:
        """Release least recently pinned sessions until the pool has `blocks_wanted` available."""
        released = 0
        while self._pins and self.pool.num_available < blocks_wanted:
            self.unpin(next(iter(self._pins)))
            released += 1
        return released

    def tend_pins(self, max_pins: int, max_fraction: float, now: float | None = None) -> None:
        """Expire pins past their hot window, then release the least recently pinned while there are
        more than `max_pins`, or while they hold more than `max_fraction` of the pool."""
        now = now if now is not None else time.monotonic()
        for sid in [sid for sid, pin in self._pins.items() if pin.expires_at <= now]:
            self.unpin(sid)
        while len(self._pins) > max_pins:
            self.unpin(next(iter(self._pins)))
        limit = int(max_fraction * self.pool.num_blocks)
        pinned = sum(len(pin.table) for pin in self._pins.values())
        while self._pins and pinned > limit:
            sid, pin = next(iter(self._pins.items()))
            pinned -= len(pin.table)
            self.unpin(sid)

    def make_room(self, session_id: str, wanted: int) -> None:
        """Release the pins of sessions the pool's forecast expects back after `session_id`, latest
        first, until the pool can take the `wanted` blocks read back for it. Without this, a small
        pool full of just-finished turns' pins refused every prefetch (an install stops at the low
        watermark) and each turn read its history again on its own critical path."""
        if self._room() >= wanted:
            return
        forecast, now = self.pool.forecast, self.pool.clock()
        waits = {g: forecast.wait(g, now) for g in [session_id, *self._pins] if g in forecast}
        mine = waits.pop(session_id, None)
        if mine is None:
            return
        for later in sorted((s for s, wait in waits.items() if wait > mine), key=waits.__getitem__, reverse=True):
            if self._room() >= wanted:
                break
            self.unpin(later)

    def _room(self) -> int:
        """Blocks an install may take now: those available above the low watermark."""
        return self.pool.num_available - self.pool.low_watermark_blocks

    # ----- the pool's content, for the disk tier ---------------------------------------------
    def cached_prefix(self, tokens: list[int], salt: bytes, max_blocks: int) -> int:
        """How many of the first `max_blocks` full blocks of `tokens` the pool holds, from the start."""
        return len(longest_prefix(self.pool.find, tokens, self.block_size, salt, max_blocks)[0])

    def install(self, tokens: list[int], salt: bytes, max_blocks: int, device_blocks: int,
                tensors: list[torch.Tensor], owner: str) -> tuple[BlockTable, int]:
        """A table over the pool's longest prefix of `tokens`, extended by the blocks read from disk
        (which start at block `device_blocks`); returns it and the tokens written from disk. Stops
        short, rather than evict, when the pool is below its low watermark."""
        bs = self.block_size
        ids, found = longest_prefix(self.pool.find, tokens, bs, salt, max_blocks)
        skip = len(ids) - device_blocks
        usable = tensors[skip:] if skip >= 0 else []
        table = BlockTable.from_prefix(self.pool, ids, found, owner=owner)
        if not usable or not self.pool.can_admit(len(usable)):
            return table, 0
        try:
            assert self.kv is not None, "installed from disk without KV tensors"
            table.append_slots(len(usable) * bs)
            for j, tensor in enumerate(usable):
                self.kv.write_block(table.block_ids[len(ids) + j], tensor)
            table.commit(tokens, (len(ids) + len(usable)) * bs, salt)
        except BaseException:
            self._release(table)  # a block file of the wrong shape, say: nothing may stay referenced
            raise
        return table, len(usable) * bs

    def prefetch(self, session_id: str, tokens: list[int], salt: bytes, device_blocks: int,
                 tensors: list[torch.Tensor]) -> range:
        """Install a session's full blocks read back from disk as cached-free blocks the session
        claims in the eviction forecast; returns the installed blocks' places in its chain."""
        bs = self.block_size
        self.make_room(session_id, len(tensors))
        table, loaded = self.install(tokens, salt, len(tokens) // bs, device_blocks, tensors, f"prefetch:{session_id}")
        self.pool.claim(session_id, table.block_ids, use=False)
        installed = range(len(table) - loaded // bs, len(table))
        self._release(table)
        return installed

    def read(self, hashes: list[bytes]) -> list[tuple[bytes, torch.Tensor]]:
        """The KV of the blocks the pool still holds under these hashes (for the disk tier)."""
        assert self.kv is not None, "read without KV tensors"
        out = []
        for block_hash in hashes:
            block_id = self.pool.index.get(block_hash)
            if block_id is not None and self.pool.blocks[block_id].hash == block_hash:
                out.append((block_hash, self.kv.read_block(block_id)))
        return out


def _overlap(prefetched: range, held_blocks: int) -> int:
    """How many of the prefetched blocks lie within the first `held_blocks` of the chain."""
    return max(0, min(prefetched.stop, held_blocks) - prefetched.start)
