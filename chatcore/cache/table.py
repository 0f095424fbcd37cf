"""A sequence's block table: logical block index -> physical block id.

* `num_tokens` counts the token slots handed out; the KV of every position below it is
  written by the step that reserved it.
* `hashes[i]` is the chained content hash of logical block i, for the leading full blocks
  whose KV is computed (`commit`). The chain continues across turns and restarts.
* Appending into a partly filled last block that another table also maps (ref > 1) copies
  it first: the table swaps in a fresh block and returns the (src, dst) pair that the KV
  layer must copy before the step writes. Full blocks are never written again.
* Release unmaps every entry first, then decrements, deepest block first.
Every method either succeeds or raises with the pool unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from chatcore.cache.errors import CacheError, NoFreeBlocks
from chatcore.cache.owners import TableOwner
from chatcore.cache.pool import BlockPool
from chatcore.cache.prefix import ROOT_HASH, hash_block

Copy = tuple[int, int]


class BlockTable:
    def __init__(self, pool: BlockPool, owner: TableOwner) -> None:
        self.pool = pool
        self.owner = owner
        self.block_ids: list[int] = []
        self.hashes: list[bytes] = []
        self.num_tokens = 0
        self._released = False
        pool.attach(self)

    @classmethod
    def from_prefix(cls, pool: BlockPool, block_ids: Sequence[int], hashes: Sequence[bytes],
                    owner: TableOwner) -> BlockTable:
        """A table over cached full blocks (a prefix hit); each gains a reference."""
        if len(block_ids) != len(hashes):
            raise CacheError("a prefix needs one hash per block")
        table = cls(pool, owner)
        for block_id in block_ids:
            pool.inc_ref(block_id)
            table.block_ids.append(block_id)
        table.hashes = list(hashes)
        table.num_tokens = len(block_ids) * pool.block_size
        return table

    @property
    def released(self) -> bool:
        return self._released

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def __len__(self) -> int:
        return len(self.block_ids)

    def _check_live(self) -> None:
        if self._released:
            raise CacheError(f"use after release of table of {self.owner}")

    def _last_block_shared(self) -> bool:
        return self.num_tokens % self.block_size != 0 and self.pool.ref(self.block_ids[-1]) > 1

    def blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks that appending `num_new_tokens` would take from the pool (copy included)."""
        if num_new_tokens <= 0:
            return 0
        bs = self.block_size
        grow = -(-(self.num_tokens + num_new_tokens) // bs) - len(self.block_ids)
        return grow + (1 if self._last_block_shared() else 0)

    def append_slots(self, num_new_tokens: int) -> tuple[list[int], list[Copy]]:
        """Reserve slots for the next tokens; returns their slot ids and any copy-on-write pair."""
        self._check_live()
        if num_new_tokens <= 0:
            return [], []
        needed = self.blocks_needed(num_new_tokens)
        if not self.pool.can_allocate(needed):
            raise NoFreeBlocks(f"the table of {self.owner} needs {needed} blocks, "
                               f"{self.pool.num_available} available")
        copies: list[Copy] = []
        if self._last_block_shared():
            src = self.block_ids[-1]
            dst = self.pool.allocate(after=self.block_ids[-2] if len(self.block_ids) > 1 else None)
            self.block_ids[-1] = dst
            self.pool.dec_ref(src)
            copies.append((src, dst))
        bs = self.block_size
        start = self.num_tokens
        end = start + num_new_tokens
        while len(self.block_ids) * bs < end:
            self.block_ids.append(self.pool.allocate(after=self.block_ids[-1] if self.block_ids else None))
        self.num_tokens = end
        ids = self.block_ids
        return [ids[p // bs] * bs + p % bs for p in range(start, end)], copies

    def slot(self, position: int) -> int:
        if not 0 <= position < self.num_tokens:
            raise CacheError(f"position {position} outside table of {self.num_tokens} tokens")
        return self.block_ids[position // self.block_size] * self.block_size + position % self.block_size

    def fork(self, owner: TableOwner) -> BlockTable:
        """A new table sharing every block of this one (each ref +1)."""
        self._check_live()
        child = BlockTable(self.pool, owner)
        for block_id in self.block_ids:
            self.pool.inc_ref(block_id)
            child.block_ids.append(block_id)
        child.hashes = list(self.hashes)
        child.num_tokens = self.num_tokens
        return child

    def commit(self, token_ids: Sequence[int], num_computed: int, salt: bytes) -> int:
        """Hash the full blocks among the first `num_computed` tokens; returns how many were new.

        `token_ids` must hold the sequence's tokens for at least those positions.
        """
        self._check_live()
        bs = self.block_size
        full = min(num_computed, self.num_tokens, len(token_ids)) // bs
        added = 0
        parent = self.hashes[-1] if self.hashes else ROOT_HASH
        for i in range(len(self.hashes), full):
            block_tokens = token_ids[i * bs:(i + 1) * bs]
            block_hash = hash_block(parent, block_tokens, salt)
            self.pool.register(self.block_ids[i], block_hash, block_tokens, None if i == 0 else parent)
            self.hashes.append(block_hash)
            parent = block_hash
            added += 1
        return added

    def release(self) -> None:
        """Unmap every entry, then decrement deepest first."""
        self._check_live()
        block_ids = self.block_ids
        self.block_ids = []
        self.hashes = []
        self.num_tokens = 0
        self._released = True
        self.pool.detach(self)
        for block_id in reversed(block_ids):
            self.pool.dec_ref(block_id)
