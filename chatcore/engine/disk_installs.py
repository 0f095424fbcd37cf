"""The disk tier's side of the pool: what it holds of a chain, installs of blocks read back from disk,
prefetches, and reads of blocks to write to disk.

`KVCacheManager` composes one `DiskInstalls`. It holds no table beyond one call: `install` hands its
table to the caller (the manager holds it for a request as `PrefixOwner`), and `prefetch` releases its
own (`PrefetchOwner`) before it returns, leaving the installed blocks cached-free and claimed by the
session in the eviction forecast. Tables are released only through the manager's `_release` (given
as `release`).

`kv` may be None for the block bookkeeping alone (the benchmarks' replays): then nothing is installed
from disk or read for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from chatcore.cache import BlockPool, BlockTable, PrefetchOwner, TableOwner, longest_prefix
from chatcore.engine.session_pins import SessionPins
from chatcore.kv.tensors import KVTensors


class DiskInstalls:
    def __init__(self, pool: BlockPool, kv: KVTensors | None, pins: SessionPins,
                 release: Callable[[BlockTable], None]) -> None:
        """`pins`: whose pins a prefetch may release to make room (`SessionPins.make_room`)."""
        self.pool = pool
        self.kv = kv
        self.pins = pins
        self._release = release

    def cached_prefix(self, tokens: list[int], salt: bytes, max_blocks: int) -> int:
        """How many of the first `max_blocks` full blocks of `tokens` the pool holds, from the start."""
        return len(longest_prefix(self.pool.find, tokens, self.pool.block_size, salt, max_blocks)[0])

    def install(self, tokens: list[int], salt: bytes, max_blocks: int, device_blocks: int,
                tensors: list[torch.Tensor], owner: TableOwner) -> tuple[BlockTable, int]:
        """A table over the pool's longest prefix of `tokens`, extended by the blocks read from disk
        (which start at block `device_blocks`); returns it and the tokens written from disk. Stops
        short, rather than evict, when the pool is below its low watermark."""
        bs = self.pool.block_size
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
        bs = self.pool.block_size
        self.pins.make_room(session_id, len(tensors))
        table, loaded = self.install(tokens, salt, len(tokens) // bs, device_blocks, tensors,
                                     PrefetchOwner(session_id))
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
