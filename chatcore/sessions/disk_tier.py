"""The disk tier: KV block files plus their index in the database, under a byte budget.

Writes are write-through and off the decode path: when a turn completes, the engine thread
copies the new full blocks out of the KV tensors, and a worker thread writes the files;
the index rows follow on the event loop. Reads verify every file (`DiskBlocks.read`); a
rejected file is deleted and its index row dropped, and the caller recomputes. The budget is
enforced least recently used first, by the index's `last_used_at`.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from chatcore.kv.disk import DiskBlocks
from chatcore.store.repos import Repos

log = logging.getLogger(__name__)


class DiskTier:
    def __init__(self, root: Path, fingerprint: str, budget_bytes: int,
                 sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self.files = DiskBlocks(root, fingerprint)
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.sessionmaker = sessionmaker
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatcore-disk")
        self._known: set[bytes] = set()
        self.writes = 0
        self.rejected = 0
        self.missing = 0  # indexed, but deleted (by another replica's budget) before we read it

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    async def filter_unknown(self, hashes: list[bytes]) -> list[bytes]:
        """The hashes not yet on disk."""
        todo = [h for h in hashes if h not in self._known]
        if not todo:
            return []
        async with self.sessionmaker() as db:
            known = await Repos(db).blocks.known([h.hex() for h in todo])
        self._known.update(bytes.fromhex(h) for h in known)
        return [h for h in todo if h.hex() not in known]

    async def save(self, blocks: list[tuple[bytes, torch.Tensor]]) -> int:
        """Write blocks (hash, tensor) and index them; returns how many were written."""
        if not blocks:
            return 0
        loop = asyncio.get_running_loop()
        written = await loop.run_in_executor(self._executor, self._write_all, blocks)
        for attempt in range(2):
            try:
                async with self.sessionmaker() as db, db.begin():
                    repos = Repos(db)
                    for block_hash, info in written:
                        await repos.blocks.upsert_block(block_hash.hex(), path=info.name, size=info.size,
                                                        checksum=info.checksum, model_fingerprint=self.fingerprint)
                break
            except IntegrityError:
                # Another replica indexed one of these blocks (the same content) at the same time:
                # the second attempt finds its row and updates it.
                if attempt:
                    raise
        self._known.update(h for h, _ in written)
        self.writes += len(written)
        await self.enforce_budget()
        return len(written)

    def _write_all(self, blocks: list[tuple[bytes, torch.Tensor]]) -> list:
        return [(block_hash, self.files.write(block_hash, tensor)) for block_hash, tensor in blocks]

    async def load(self, hashes: list[bytes]) -> list[torch.Tensor]:
        """The longest run of leading `hashes` readable from disk, verified; counts the hits."""
        if not hashes:
            return []
        async with self.sessionmaker() as db:
            indexed = await Repos(db).blocks.known([h.hex() for h in hashes])
        run: list[bytes] = []
        for block_hash in hashes:
            if block_hash.hex() not in indexed:
                break
            run.append(block_hash)
        if not run:
            return []
        loop = asyncio.get_running_loop()
        tensors, missing = await loop.run_in_executor(self._executor, self._read_run, run)
        async with self.sessionmaker() as db, db.begin():
            repos = Repos(db)
            for block_hash in run[: len(tensors)]:
                await repos.blocks.touch_block(block_hash.hex())
            if len(tensors) < len(run):
                bad = run[len(tensors)]
                if missing:
                    self.missing += 1  # its evictor drops the row too; dropping it twice is harmless
                else:
                    self.rejected += 1
                self._known.discard(bad)
                await repos.blocks.delete_block(bad.hex())
        return tensors

    def _read_run(self, run: list[bytes]) -> tuple[list[torch.Tensor], bool]:
        """The readable leading blocks of `run`, and whether the run stopped at a missing file."""
        out: list[torch.Tensor] = []
        for block_hash in run:
            try:
                tensor = self.files.read(block_hash, missing_ok=False)
            except FileNotFoundError:
                return out, True
            if tensor is None:
                break
            out.append(tensor)
        return out, False

    async def enforce_budget(self) -> int:
        """Delete least recently used blocks until the index fits the byte budget."""
        removed = 0
        async with self.sessionmaker() as db, db.begin():
            repos = Repos(db)
            total = await repos.blocks.total_size()
            while total > self.budget_bytes:
                victims = await repos.blocks.lru_blocks(64)
                if not victims:
                    break
                for row in victims:
                    if total <= self.budget_bytes:
                        break
                    self.files.delete(bytes.fromhex(row.hash))
                    self._known.discard(bytes.fromhex(row.hash))
                    await repos.blocks.delete_block(row.hash)
                    total -= row.size
                    removed += 1
        return removed
