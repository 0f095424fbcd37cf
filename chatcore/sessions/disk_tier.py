"""The disk tier: KV block files plus their index in the database, under a byte budget.

Writes are write-through and off the decode path: when a turn completes, the engine thread
copies the new full blocks out of the KV tensors, and a worker thread writes the files;
the index rows follow on the event loop. The writer yields to prefills: before each file it
waits, up to `WRITE_DEFER_S` after the write was asked for, until no request awaits its first
token (`quiet`, the engine's `prefill_quiet`). On two cores, a turn's files (hashing, copies,
fsyncs) written beside the next turn's prefill made that turn ~10 ms slower (docs/benchmarks.md).
Reads verify every file (`DiskBlocks.read`); a rejected file is deleted and its index row
dropped, and the caller recomputes.

The budget is enforced per conversation, as in the pool (`chatcore.cache.forecast`): each turn
claims its session's chain of hashes. Over budget, blocks no conversation claims go first
(least recently used first, by the index's `last_used_at`: after a restart, that is everything
until its session returns); then the conversation expected back last loses its blocks from the
tail, never a block another conversation's chain still holds. Rows are deleted in one
transaction, and the files after it commits, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from chatcore import openmp
from chatcore.cache.forecast import ReuseForecast
from chatcore.kv.disk import DiskBlocks
from chatcore.store.repos import Repos
from chatcore.store.repos.blocks import IndexedFile

log = logging.getLogger(__name__)
WRITER_NICE = 10
ORPHAN_AGE_S = 600.0
WRITE_DEFER_S = 2.0  # the longest a write waits for the prefills (`DiskTier.quiet`): it never starves


class DiskTier:
    def __init__(self, root: Path, fingerprint: str, budget_bytes: int,
                 sessionmaker: async_sessionmaker[AsyncSession], clock: Callable[[], float] = time.monotonic,
                 quiet: threading.Event | None = None, defer_s: float = WRITE_DEFER_S) -> None:
        """`clock`: the reuse forecast's; `quiet`: set while no prefill runs (None: never wait)."""
        self.files = DiskBlocks(root, fingerprint)
        self.quiet = quiet
        self.defer_s = defer_s
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.sessionmaker = sessionmaker
        self.clock = clock
        # Reads are on a turn's critical path; writes and deletes are not, and their hashing and
        # copying would otherwise take CPU from the engine's step (see `_background_priority`).
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatcore-disk-read",
                                          initializer=openmp.single_threaded)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chatcore-disk-write",
                                          initializer=_background_priority)
        self._known: set[bytes] = set()
        self.forecast: ReuseForecast[bytes] = ReuseForecast()
        self._block_bytes = 0  # one block file's size (all blocks of a model have one shape)
        self.writes = 0
        self.rejected = 0
        self.missing = 0  # indexed, but deleted (by another replica's budget) before we read it

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)

    def claim(self, session_id: str, hashes: list[bytes], *, use: bool = True) -> None:
        """The session's chain, root first: the eviction unit on disk."""
        self.forecast.claim(session_id, hashes, self.clock(), use=use)

    def drop(self, session_id: str) -> None:
        self.forecast.drop(session_id)

    def soonest(self, session_ids: list[str], horizon_s: float) -> str | None:
        """Of `session_ids`, the one the forecast expects back soonest, if within `horizon_s`
        (sessions that never claimed a chain here have no forecast and are skipped)."""
        now = self.clock()
        best: tuple[float, str] | None = None
        for session_id in session_ids:
            if session_id in self.forecast:
                wait = self.forecast.wait(session_id, now)
                if wait <= horizon_s and (best is None or wait < best[0]):
                    best = (wait, session_id)
        return None if best is None else best[1]

    async def filter_unknown(self, hashes: list[bytes]) -> list[bytes]:
        """The hashes not yet on disk."""
        todo = [h for h in hashes if h not in self._known]
        if not todo:
            return []
        async with self.sessionmaker() as db:
            known = await Repos(db).blocks.known([h.hex() for h in todo])
        self._known.update(bytes.fromhex(h) for h in known)
        return [h for h in todo if h.hex() not in known]

    async def worth_writing(self, session_id: str, todo: list[bytes]) -> list[bytes]:
        """The leading part of `todo` (new blocks of the session's claimed chain, root first) that
        the budget would keep. Over budget, once the blocks no conversation claims are counted
        out, the conversation expected back last loses its tail (`enforce_budget`); when that is
        `session_id` itself, writing its tail would only delete it again. Under a round robin
        that does not fit, each turn's session is that conversation: a recomputed 1,100-token
        history took the writer 1.1-2.7 s of hashing, copies and fsyncs beside the next turns' steps."""
        if not todo or not self._block_bytes:
            return todo
        async with self.sessionmaker() as db:
            repos = Repos(db)
            excess = await repos.blocks.total_size() + len(todo) * self._block_bytes - self.budget_bytes
            if excess <= 0:
                return todo
            excess -= sum(row.size for row in await repos.blocks.lru_blocks(256)
                          if self.forecast.owner(bytes.fromhex(row.hash)) is None)
        if excess <= 0:
            return todo
        new = set(todo)
        # The choice `enforce_budget` would make after the write. It sticks: the blocks the victim
        # does not write are what it would have lost, and later writes take its older blocks.
        victim = self.forecast.victim(
            self.clock(), lambda h: (h in self._known or h in new) and self.forecast.holders(h) <= 1)
        if victim is None or self.forecast.owner(victim) != session_id:
            return todo
        return todo[: max(0, len(todo) - -(-excess // self._block_bytes))]

    async def save(self, blocks: list[tuple[bytes, torch.Tensor]]) -> int:
        """Write blocks (hash, tensor) and index them; returns how many were written."""
        if not blocks:
            return 0
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.defer_s
        written = await loop.run_in_executor(self._writer, self._write_all, blocks, deadline)
        for attempt in range(2):
            try:
                async with self.sessionmaker() as db, db.begin():
                    await Repos(db).blocks.upsert_blocks(
                        [IndexedFile(block_hash.hex(), info.name, info.size, info.checksum) for block_hash, info in written],
                        self.fingerprint)
                break
            except IntegrityError:
                # Another replica indexed one of these blocks (the same content) at the same time:
                # the second attempt finds its row and updates it.
                if attempt:
                    raise
        self._known.update(h for h, _ in written)
        if written:
            self._block_bytes = written[-1][1].size
        self.writes += len(written)
        await self.enforce_budget()
        return len(written)

    def _write_all(self, blocks: list[tuple[bytes, torch.Tensor]], deadline: float) -> list:
        written = []
        for block_hash, tensor in blocks:
            if self.quiet is not None:
                self.quiet.wait(max(0.0, deadline - time.monotonic()))
            written.append((block_hash, self.files.write(block_hash, tensor)))
        return written

    async def load(self, hashes: list[bytes]) -> list[torch.Tensor]:
        """The longest run of leading `hashes` readable from disk, verified; counts the hits."""
        if not hashes:
            return []
        async with self.sessionmaker() as db:
            indexed = await Repos(db).blocks.checksums([h.hex() for h in hashes])
        run: list[tuple[bytes, str]] = []
        for block_hash in hashes:
            if block_hash.hex() not in indexed:
                break
            run.append((block_hash, indexed[block_hash.hex()]))
        if not run:
            return []
        loop = asyncio.get_running_loop()
        tensors, missing = await loop.run_in_executor(self._reader, self._read_run, run)
        run_hashes = [h for h, _ in run]
        self._known.update(run_hashes[: len(tensors)])
        async with self.sessionmaker() as db, db.begin():
            repos = Repos(db)
            await repos.blocks.touch_blocks([h.hex() for h in run_hashes[: len(tensors)]])
            if len(tensors) < len(run):
                bad = run_hashes[len(tensors)]
                if missing:
                    self.missing += 1  # its evictor drops the row too; dropping it twice is harmless
                else:
                    self.rejected += 1
                self._known.discard(bad)
                await repos.blocks.delete_blocks([bad.hex()])
        return tensors

    def _read_run(self, run: list[tuple[bytes, str]]) -> tuple[list[torch.Tensor], bool]:
        """The readable leading blocks of `run` (hash, indexed checksum), and whether the run
        stopped at a missing file."""
        out: list[torch.Tensor] = []
        for block_hash, checksum in run:
            try:
                tensor = self.files.read(block_hash, missing_ok=False, checksum=checksum)
            except FileNotFoundError:
                return out, True
            if tensor is None:
                break
            out.append(tensor)
        return out, False

    async def enforce_budget(self) -> int:
        """Delete blocks until the index fits the byte budget; returns how many."""
        async with self.sessionmaker() as db, db.begin():
            repos = Repos(db)
            excess = await repos.blocks.total_size() - self.budget_bytes
            if excess <= 0:
                return 0
            victims = await self._victims(repos, excess)
            await repos.blocks.delete_blocks([h.hex() for h in victims])
        for block_hash in victims:
            self._known.discard(block_hash)
        await asyncio.get_running_loop().run_in_executor(self._writer, self._delete_files, victims)
        return len(victims)

    async def _victims(self, repos: Repos, excess: int) -> list[bytes]:
        """Unclaimed blocks, least recently used first; then whole conversations, from the tail."""
        victims: list[bytes] = []
        freed = 0
        for row in await repos.blocks.lru_blocks(256):
            self._block_bytes = self._block_bytes or row.size
            block_hash = bytes.fromhex(row.hash)
            if freed < excess and self.forecast.owner(block_hash) is None:
                victims.append(block_hash)
                freed += row.size
        now = self.clock()
        while freed < excess:
            block_hash = self.forecast.victim(now, lambda h: h in self._known and self.forecast.holders(h) <= 1)
            if block_hash is None:
                break
            self.forecast.forget(block_hash)  # chosen: no longer the group's
            victims.append(block_hash)
            freed += self._block_bytes
        return victims

    async def sweep(self, min_age_s: float = ORPHAN_AGE_S) -> int:
        """Delete what a crash left: temporary files, and block files the index does not know.
        Only files older than `min_age_s`, since a replica sharing the directory writes a file
        before it indexes it. Returns how many files went."""
        loop = asyncio.get_running_loop()
        temporary, blocks = await loop.run_in_executor(self._writer, self.files.old_files, min_age_s)
        orphans: list[bytes] = []
        async with self.sessionmaker() as db:
            for start in range(0, len(blocks), 500):
                chunk = blocks[start:start + 500]
                known = await Repos(db).blocks.known([h.hex() for h in chunk])
                orphans += [h for h in chunk if h.hex() not in known]
        await loop.run_in_executor(self._writer, self._delete_files, orphans)
        await loop.run_in_executor(self._writer, _unlink_all, temporary)
        if orphans or temporary:
            log.info("disk tier: removed %d unindexed block files and %d temporary files", len(orphans),
                     len(temporary))
        return len(orphans) + len(temporary)

    def _delete_files(self, hashes: list[bytes]) -> None:
        for block_hash in hashes:
            self.files.delete(block_hash)


def _background_priority() -> None:
    """Lower the calling thread's CPU priority (Linux sets nice per thread): the write-through runs
    beside the next turn's prefill, and on a machine with few cores it would slow every thread of
    the step's matmuls. Its tensor ops run on itself alone (chatcore/openmp.py)."""
    openmp.single_threaded()
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at normal priority
        pass


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
