"""The block pool: every block's reference count, the free queue and the LRU of cached-free blocks.

Invariants (checked by `chatcore.cache.audit`):

* Every block is exactly one of: *free* (in `_free`, unhashed), *cached-free* (ref 0, hashed,
  in `_lru`, still findable through the prefix index) or *in use* (ref > 0, in neither queue).
* A block's reference count equals the number of block-table entries pointing at it. This
  module holds the only `inc_ref` / `dec_ref`; nothing else changes a count.
* Allocation takes a free block first (preferring the one right after a hint, so a sequence's
  blocks stay physically adjacent), then evicts the least recently used cached-free block.
* When a block's count reaches 0 it joins the MRU end of the LRU if hashed, else the front of
  the free queue (an evicted block too), where allocation takes it next: a block once written
  has its memory committed, so the pool's resident memory stays at the most blocks ever in use
  at once, and new blocks (at the back, as the pool made or grew them) are touched only when
  those run out. On the CPU a block's first write faults its pages in, a large share of a fresh
  pool's prefill step (docs/measurements.md, "First writes"). Callers release a table deepest block
  first, so among blocks freed together the longest-prefix ones are evicted first and shared
  roots survive.
* Eviction policy `lru` takes the least recently used cached-free block. Policy `cost` looks at
  the `COST_WINDOW` least recently used ones and takes, in this order: one with no hashed block
  continuing it (a leaf: evicting a parent first would strand its children, unreachable), then
  one from which the fewest conversations ever branched (`fanout`: a system prompt's last
  block outlives a lone tail), then the least recent. `_children` counts, per hash, the hashed
  blocks whose parent it is; the audit recounts it.
* Eviction policy `session` (the default) treats conversations as units: a block no conversation
  claims (`claim`) goes first, by the `cost` rule among the `COST_WINDOW` least recently used;
  then the deepest cached-free leaf of the conversation expected back last
  (`chatcore.cache.forecast`), which resists a cyclic scan where LRU does not.
* Block ids never change: the pool grows by appending ids and shrinks only from the top.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from chatcore.cache.errors import CacheError, NoFreeBlocks
from chatcore.cache.forecast import ReuseForecast
from chatcore.cache.owners import TableOwner
from chatcore.cache.prefix import PrefixIndex

EvictHook = Callable[[int, bytes, tuple[int, ...]], None]
COST_WINDOW = 16
POLICIES = ("lru", "cost", "session")
# The one default: a pool's, and the server's (`Settings.eviction_policy`, CHATCORE_EVICTION_POLICY).
DEFAULT_EVICTION = "session"


class AttachedTable(Protocol):
    """What the pool knows of a table mapping its blocks (a `BlockTable`, whose module imports
    this one and not the reverse): for the audit and the block map. Its `owner` is typed
    (`chatcore.cache.owners`): the registry says who holds each table without a name to parse."""

    owner: TableOwner
    block_ids: list[int]
    num_tokens: int


@dataclass(slots=True)
class Block:
    id: int
    ref: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    alloc_site: str | None = None
    parent_hash: bytes | None = None
    fanout: int = 0  # hashed children ever registered under this block


@dataclass(slots=True)
class PoolStats:
    total: int
    free: int
    cached: int
    used: int
    sum_refs: int
    hashed: int
    evictions: int


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        low_watermark: float = 0.15,
        high_watermark: float = 0.30,
        debug: bool = False,
        on_evict: EvictHook | None = None,
        eviction: str = DEFAULT_EVICTION,
        clock: Callable[[], float] = time.monotonic,
        depth_cost: float = 0.0,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if not 0 <= low_watermark <= high_watermark < 1:
            raise ValueError("need 0 <= low_watermark <= high_watermark < 1")
        self.block_size = block_size
        self.low_watermark = low_watermark
        self.high_watermark = high_watermark
        if eviction not in POLICIES:
            raise ValueError(f"unknown eviction policy {eviction!r}")
        self.debug = debug
        self.on_evict = on_evict
        self.eviction = eviction
        self.clock = clock
        self.forecast: ReuseForecast[int] = ReuseForecast(depth_cost)
        self.blocks: list[Block] = []
        self._free: OrderedDict[int, None] = OrderedDict()
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.index = PrefixIndex()
        # hash -> how many hashed blocks continue it: the cached chains that die with it.
        self._children: dict[bytes, int] = {}
        self._tables: dict[AttachedTable, None] = {}  # an ordered set
        self.evictions = 0
        self.grow(num_blocks)

    # ----- sizes and watermarks -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can take: free plus cached-free (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - self.num_available

    @property
    def low_watermark_blocks(self) -> int:
        return int(self.low_watermark * len(self.blocks))

    def can_admit(self, num_new_blocks: int) -> bool:
        """Admission keeps at least the low watermark of blocks available after allocating."""
        return self.num_available - num_new_blocks >= self.low_watermark_blocks

    def can_allocate(self, num_new_blocks: int) -> bool:
        return self.num_available >= num_new_blocks

    # ----- reference counts: the only place they change -----------------------------------
    def inc_ref(self, block_id: int) -> None:
        block = self._block(block_id)
        if block.ref == 0:
            if block_id in self._lru:
                del self._lru[block_id]
            else:
                raise CacheError(f"inc_ref of free block {block_id}: allocate it first")
        block.ref += 1

    def dec_ref(self, block_id: int) -> None:
        block = self._block(block_id)
        if block.ref <= 0:
            raise CacheError(f"double free: dec_ref of block {block_id} whose ref is already 0")
        block.ref -= 1
        if block.ref == 0:
            block.alloc_site = None
            if block.hash is not None:
                self._lru[block_id] = None
            else:
                block.token_ids = None
                self._push_free(block_id)

    def allocate(self, after: int | None = None) -> int:
        """Take a block with ref 1. `after` hints the previous block of the same sequence."""
        block_id = self._take_free(after)
        block = self.blocks[block_id]
        block.ref = 1
        if self.debug:
            block.alloc_site = _caller_site()
        return block_id

    def _push_free(self, block_id: int) -> None:
        """`block_id` at the front of the free queue: the next allocation without a hint takes it."""
        self._free[block_id] = None
        self._free.move_to_end(block_id, last=False)

    def _take_free(self, after: int | None) -> int:
        if after is not None and after + 1 in self._free:
            del self._free[after + 1]
            return after + 1
        if self._free:
            return self._free.popitem(last=False)[0]
        if self._lru:
            block_id = self._victim()
            del self._lru[block_id]
            self._evict(block_id)
            return block_id
        raise NoFreeBlocks(f"all {len(self.blocks)} blocks are in use")

    def _victim(self) -> int:
        if self.eviction == "lru":
            return next(iter(self._lru))
        if self.eviction == "cost":
            return self._cheapest(lambda block_id: True)
        owner = self.forecast.owner
        unclaimed = self._cheapest(lambda block_id: owner(block_id) is None)
        if unclaimed >= 0:
            return unclaimed
        grouped = self.forecast.victim(self.clock(), self._is_cached_leaf)
        return grouped if grouped is not None else self._cheapest(lambda block_id: True)

    def _cheapest(self, eligible: Callable[[int], bool]) -> int:
        """Among the `COST_WINDOW` least recently used cached-free blocks that are `eligible`:
        a leaf, then the fewest conversations branched from, then the least recent; -1 if none."""
        best, best_key = -1, (0, 0)
        for count, block_id in enumerate(self._lru):
            if count >= COST_WINDOW:
                break
            if not eligible(block_id):
                continue
            block = self.blocks[block_id]
            assert block.hash is not None
            key = (self._children.get(block.hash, 0), block.fanout)
            if best < 0 or key < best_key:
                best, best_key = block_id, key
            if best_key == (0, 0):
                break
        return best

    def _is_cached_leaf(self, block_id: int) -> bool:
        block_hash = self.blocks[block_id].hash
        return block_id in self._lru and block_hash is not None and block_hash not in self._children

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.hash is not None and block.token_ids is not None
        if self.on_evict is not None:
            self.on_evict(block_id, block.hash, block.token_ids)
        self.index.remove(block.hash, block_id)
        self.forecast.forget(block_id)
        if block.parent_hash is not None:
            left = self._children[block.parent_hash] - 1
            if left:
                self._children[block.parent_hash] = left
            else:
                del self._children[block.parent_hash]
        block.hash = None
        block.parent_hash = None
        block.token_ids = None
        block.fanout = 0
        self.evictions += 1

    # ----- prefix sharing ------------------------------------------------------------------
    def register(self, block_id: int, block_hash: bytes, token_ids: Sequence[int],
                 parent_hash: bytes | None = None) -> bool:
        """Make a full, in-use block findable by its content hash.

        Returns False when another block already holds the same content: this one then
        stays unhashed and returns to the free queue when released.
        """
        block = self._block(block_id)
        if block.ref == 0:
            raise CacheError(f"register of unused block {block_id}")
        if len(token_ids) != self.block_size:
            raise CacheError(f"only full blocks are hashed ({len(token_ids)} != {self.block_size})")
        if block.hash is not None:
            return block.hash == block_hash
        if not self.index.add(block_hash, block_id):
            return False
        block.hash = block_hash
        block.token_ids = tuple(token_ids)
        if parent_hash is not None:
            block.parent_hash = parent_hash
            self._children[parent_hash] = self._children.get(parent_hash, 0) + 1
            parent_id = self.index.get(parent_hash)
            if parent_id is not None:
                self.blocks[parent_id].fanout += 1
        return True

    def find(self, block_hash: bytes, token_ids: Sequence[int]) -> int | None:
        """The block holding exactly these tokens under this hash, touched; None on a miss."""
        block_id = self.index.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids):
            return None
        if block_id in self._lru:
            self._lru.move_to_end(block_id)
        return block_id

    def claim(self, group: str, block_ids: Sequence[int], *, use: bool = True) -> None:
        """A conversation's chain (root first): its hashed blocks become the group's eviction
        unit; `use` records a turn now (`chatcore.cache.forecast`)."""
        self.forecast.claim(group, [b for b in block_ids if self._block(b).hash is not None], self.clock(),
                            use=use)

    def drop_group(self, group: str) -> None:
        self.forecast.drop(group)

    def evict_cached(self, max_blocks: int | None = None) -> int:
        """Drop up to `max_blocks` cached-free blocks, least recently used first."""
        count = 0
        while self._lru and (max_blocks is None or count < max_blocks):
            block_id = self._lru.popitem(last=False)[0]
            self._evict(block_id)
            self._push_free(block_id)
            count += 1
        return count

    # ----- growth --------------------------------------------------------------------------
    def grow(self, count: int) -> list[int]:
        """Append `count` new free blocks; existing ids are untouched."""
        first = len(self.blocks)
        new_ids = list(range(first, first + count))
        for block_id in new_ids:
            self.blocks.append(Block(block_id))
            self._free[block_id] = None
        return new_ids

    def shrink(self, max_count: int) -> int:
        """Remove up to `max_count` blocks from the top of the id space while they are not in use.

        Stops at the first in-use block from the top, and never goes below the high watermark
        of available blocks. Returns how many blocks were removed.
        """
        removed = 0
        while removed < max_count and len(self.blocks) > 1:
            top = self.blocks[-1]
            if top.ref > 0:
                break
            if self.num_available - 1 < self.high_watermark * (len(self.blocks) - 1):
                break
            if top.id in self._lru:
                del self._lru[top.id]
                self._evict(top.id)
            else:
                del self._free[top.id]
            self.blocks.pop()
            removed += 1
        return removed

    # ----- tables: the registry of live tables, each with its typed owner -------------------
    def attach(self, table: AttachedTable) -> None:
        self._tables[table] = None

    def detach(self, table: AttachedTable) -> None:
        self._tables.pop(table, None)

    @property
    def tables(self) -> list[AttachedTable]:
        return list(self._tables)

    # ----- inspection ----------------------------------------------------------------------
    def children_counts(self) -> dict[bytes, int]:
        return dict(self._children)

    def ref(self, block_id: int) -> int:
        return self._block(block_id).ref

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._lru

    def free_ids(self) -> list[int]:
        """Free blocks, next to be allocated first."""
        return list(self._free)

    def lru_ids(self) -> list[int]:
        """Cached-free blocks, next to be evicted first."""
        return list(self._lru)

    def stats(self) -> PoolStats:
        return PoolStats(
            total=len(self.blocks),
            free=len(self._free),
            cached=len(self._lru),
            used=self.num_used,
            sum_refs=sum(b.ref for b in self.blocks),
            hashed=len(self.index),
            evictions=self.evictions,
        )

    def _block(self, block_id: int) -> Block:
        if not 0 <= block_id < len(self.blocks):
            raise CacheError(f"unknown block id {block_id}")
        return self.blocks[block_id]


def _caller_site() -> str:
    """The first stack frame outside chatcore.cache: who allocated a block (debug mode only)."""
    frame = sys._getframe(2)
    while frame is not None and "chatcore/cache/" in frame.f_code.co_filename.replace("\\", "/"):
        frame = frame.f_back
    if frame is None:
        return "?"
    summary = traceback.extract_stack(frame, limit=1)[-1]
    return f"{summary.filename}:{summary.lineno} in {summary.name}"
