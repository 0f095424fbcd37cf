"""Every KV table's one owner, on the engine thread only (like vLLM v1's `KVCacheManager`).

The manager keeps every table: a running request's, one per sequence, keyed by request id and
sequence; the prefix held for a request being added; the sessions' pins (through `pins`). Nothing
outside it, its two parts and `chatcore.cache` (which defines tables) holds a table or calls its
methods: callers name a request and a sequence, and get numbers back (`block_ids`, a copy, for the
step's block tables).

A request's sequences get their tables here: `get_computed_blocks` at admission (the prefix held for
the request, else the pool's longest cached prefix), then `admit` (when `can_admit` says the pool
takes the rest above its low watermark) or `unwind`; `allocate_slots` each step, which returns None
when the pool cannot serve (pins reclaimed first), as vLLM's does; `cache_blocks` hashes the computed
full blocks after the step; `fork` for samples and beams. They give them back here: `finish_seq` as a
sample stops, `free_seq` for one sequence, `free` for a whole request.

The manager composes two owners that hold only their own: `pins` (`SessionPins`), the sessions'
pins, to which a session's finished turn hands its first sample's table (the rule:
`chatcore.engine.pins.keeps_pin`); and `disk` (`DiskInstalls`), the disk tier's installs, prefetches
and reads, which holds no table beyond one call. Questions change nothing (`limits`, `can_admit`,
`block_ids`, `stats`); reclaiming pins for an admission is an action the scheduler takes
(`reclaim_pins_for`). The pool's size, statistics and prefix cache change through the manager too
(`resize`, `reset_prefix_cache`).

A prefix prepared for a request as it is added (the session's pin, or blocks read back from the disk
tier) is held by request id until the scheduler admits the request, or `free` releases it.

Every table carries a typed owner (`chatcore.cache.owners`): `SequenceOwner` for a request's
sequence, `PrefixOwner` for a held prefix, `PinOwner` and `PrefetchOwner` in the parts.

Invariant: `_release` is the only code that releases a table (the parts are handed it;
tests/test_kv_ownership.py checks the source); reference counts themselves change only in
`chatcore.cache.pool`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chatcore.cache import AuditReport, BlockPool, BlockTable, PrefixOwner, SequenceOwner, audit, longest_prefix
from chatcore.cache.pool import PoolStats
from chatcore.engine.block_map import block_map
from chatcore.engine.commands import SessionPrefix
from chatcore.engine.disk_installs import DiskInstalls
from chatcore.engine.fits import PoolLimits
from chatcore.engine.pins import keeps_pin
from chatcore.engine.request import Request, TokenSequence
from chatcore.engine.session_pins import SessionPins
from chatcore.kv.tensors import KVTensors

Copy = tuple[int, int]


class KVCacheManager:
    def __init__(self, pool: BlockPool, kv: KVTensors | None, hot_window_s: float) -> None:
        """`kv` may be None for the block bookkeeping alone (the benchmarks' replays)."""
        self.pool = pool
        self.kv = kv
        self.block_size = pool.block_size
        self.pins = SessionPins(pool, hot_window_s, self._release)
        self.disk = DiskInstalls(pool, kv, self.pins, self._release)
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
        table = self.pins.take(prefix.session_id)
        if table is not None:
            if prefix.use_pin and table.num_tokens < len(prompt):
                self._hold(req, table)
                return None
            self._release(table)
        if prefix.disk is not None:
            start, tensors = prefix.disk
            if tensors:
                self.pins.make_room(prefix.session_id, len(tensors))
            table, loaded = self.disk.install(prompt, req.salt, max_blocks, start, tensors, PrefixOwner(req.request_id))
            self._hold(req, table)
            req.cached_disk_tokens = loaded + bs * _overlap(prefix.prefetched, len(table) - loaded // bs)
            return None
        device_blocks = self.disk.cached_prefix(prompt, req.salt, max_blocks)
        if prefix.disk_tier and device_blocks < max_blocks:
            return device_blocks
        if prefix.prefetched:  # held from here to the scheduler, so that what was prefetched serves
            table, _ = self.disk.install(prompt, req.salt, max_blocks, device_blocks, [], PrefixOwner(req.request_id))
            self._hold(req, table)
            req.cached_disk_tokens = bs * _overlap(prefix.prefetched, len(table))
        return None

    def _hold(self, req: Request, table: BlockTable) -> None:
        table.owner = PrefixOwner(req.request_id)
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
            tables[seq] = BlockTable.from_prefix(self.pool, ids, hashes, owner=SequenceOwner(req.request_id, seq.index))
        self._computed[req.request_id] = tables
        return len(tables[seqs[0]])

    def can_admit(self, req: Request, *, alone: bool) -> bool:
        """Whether the pool takes the rest of the looked-up sequences' tokens and keeps its low watermark
        free (`alone`: nothing runs, so the watermark may be spent). A question: it changes nothing."""
        needed = self._admission_blocks(req)
        return self.pool.can_admit(needed) or (alone and self.pool.can_allocate(needed))

    def reclaim_pins_for(self, req: Request) -> None:
        """Release least recently pinned sessions until the pool takes the rest of the looked-up
        sequences' tokens above its low watermark (or no pin is left): the scheduler's action when
        `can_admit` said no, before the request waits."""
        self.pins.reclaim(self._admission_blocks(req) + self.pool.low_watermark_blocks)

    def _admission_blocks(self, req: Request) -> int:
        """The blocks the looked-up sequences of `req` still need for their tokens."""
        bs = self.block_size
        return sum(-(-len(seq.tokens) // bs) - len(table) for seq, table in self._computed[req.request_id].items())

    def admit(self, req: Request) -> None:
        """The looked-up tables become the sequences' own (the held prefix with them)."""
        self._held.pop(req.request_id, None)
        tables = self._tables.setdefault(req.request_id, {})
        for seq, table in self._computed.pop(req.request_id).items():
            table.owner = SequenceOwner(req.request_id, seq.index)
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

    def block_ids(self, req: Request, seq: TokenSequence) -> tuple[int, ...]:
        """The sequence's physical blocks, in logical order (the step's block table row): a copy the
        caller may keep, which a later copy-on-write or append never changes."""
        return tuple(self._table(req, seq).block_ids)

    def hashed_block_ids(self, req: Request, seq: TokenSequence) -> tuple[int, ...]:
        """The sequence's leading blocks whose content is hashed (`cache_blocks`): what a lookup finds."""
        table = self._table(req, seq)
        return tuple(table.block_ids[: len(table.hashes)])

    def allocate_slots(self, req: Request, seq: TokenSequence, num_tokens: int) -> tuple[list[int], list[Copy]] | None:
        """Slots for the sequence's next `num_tokens`, and the (src, dst) block copies a shared last
        block needs first (copy-on-write). None when the pool cannot serve them, even with every pin
        reclaimed (vLLM's `allocate_slots`): the caller preempts, and nothing changed."""
        table = self._table(req, seq)
        needed = table.blocks_needed(num_tokens)
        if not self.pool.can_allocate(needed):
            self.pins.reclaim(needed)
            if not self.pool.can_allocate(needed):
                return None
        return table.append_slots(num_tokens)

    def cache_blocks(self, req: Request, seq: TokenSequence) -> None:
        """Hash the full blocks among the sequence's computed tokens, so that later lookups find them."""
        self._table(req, seq).commit(seq.tokens, seq.num_computed, req.salt)

    def fork(self, req: Request, parent: TokenSequence, child: TokenSequence) -> None:
        """`child` (a sample or a beam) gets a table sharing the parent's blocks; its last block is copied on write."""
        table = self._table(req, parent).fork(owner=SequenceOwner(req.request_id, child.index))
        self._tables[req.request_id][child] = table

    def rename(self, req: Request) -> None:
        """Name each of the request's tables after its sequence's index (beams are renumbered every step)."""
        for seq, table in self._tables.get(req.request_id, {}).items():
            table.owner = SequenceOwner(req.request_id, seq.index)

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
                self.pins.pin(session_id, table)
                return list(table.hashes)
        return []

    @property
    def pinned_sessions(self) -> list[str]:
        """Pinned sessions, least recently pinned first (`SessionPins.sessions`)."""
        return self.pins.sessions

    # ----- the pool itself: its size, statistics, prefix cache and map ------------------------
    def resize(self, num_blocks: int) -> int:
        """Grow or shrink the pool and its tensors together; block ids never change.

        Shrinking removes only free or cached-free blocks from the top of the id space, and
        never below the high watermark of available blocks. Returns the new size.
        """
        assert self.kv is not None, "resized without KV tensors"
        current = self.pool.num_blocks
        if num_blocks > current:
            self.kv.resize(num_blocks)
            self.pool.grow(num_blocks - current)
        elif num_blocks < current:
            self.pool.shrink(current - num_blocks)
            self.kv.resize(self.pool.num_blocks)
        return self.pool.num_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def audit(self) -> AuditReport:
        return audit(self.pool)

    def reset_prefix_cache(self) -> int:
        """Forget every cached-free block (blocks in use stay); returns how many went."""
        return self.pool.evict_cached()

    def block_map(self, session_of_request: dict[str, str]) -> dict[str, Any]:
        """The operators' view of the pool (`chatcore.engine.block_map`)."""
        return block_map(self.pool, session_of_request)

def _overlap(prefetched: range, held_blocks: int) -> int:
    """How many of the prefetched blocks lie within the first `held_blocks` of the chain."""
    return max(0, min(prefetched.stop, held_blocks) - prefetched.start)
