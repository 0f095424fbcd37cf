"""The disk tier's index of persisted KV blocks, keyed by content hash (hex)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Row, delete, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from chatcore.store.models import KvBlock
from chatcore.store.types import utcnow


@dataclass(frozen=True, slots=True)
class IndexedFile:
    """A written block file, as the index records it."""

    hash: str
    path: str
    size: int
    checksum: str


class KvBlockRepo:
    """Least recently used first means: oldest `last_used_at`, ties broken by hash."""

    def __init__(self, db: AsyncSession) -> None:
        self.db = db

    async def upsert_blocks(self, files: Sequence[IndexedFile], model_fingerprint: str) -> None:
        """Index written blocks in a few statements, whatever their number; rewriting a known hash
        replaces its file fields and counts as a use. One row per block through the ORM held the
        event loop for tens of milliseconds a turn, beside the engine's steps (docs/measurements.md,
        "Block index writes")."""
        if not files:
            return
        known = await self.known([f.hash for f in files])
        fields = [{"hash": f.hash, "path": f.path, "size": f.size, "checksum": f.checksum,
                   "model_fingerprint": model_fingerprint} for f in files]
        new = [row for row in fields if row["hash"] not in known]
        if new:
            await self.db.execute(insert(KvBlock), new)
        again = [{**row, "last_used_at": utcnow()} for row in fields if row["hash"] in known]
        if again:
            await self.db.execute(update(KvBlock), again)

    async def get_block(self, hash: str) -> KvBlock | None:
        return await self.db.get(KvBlock, hash)

    async def touch_blocks(self, hashes: list[str], at: datetime | None = None) -> int:
        """Count a hit on each indexed block of `hashes` and mark it used now (or at `at`), in one
        statement; returns how many were indexed."""
        if not hashes:
            return 0
        result = await self.db.execute(
            update(KvBlock).where(KvBlock.hash.in_(hashes)).values(hits=KvBlock.hits + 1, last_used_at=at or utcnow())
            .execution_options(synchronize_session=False)
        )
        return int(result.rowcount)

    async def delete_blocks(self, hashes: list[str]) -> int:
        """Drop the rows of `hashes` in one statement; returns how many there were."""
        if not hashes:
            return 0
        result = await self.db.execute(
            delete(KvBlock).where(KvBlock.hash.in_(hashes)).execution_options(synchronize_session=False))
        return int(result.rowcount)

    async def lru_blocks(self, limit: int, model_fingerprint: str | None = None) -> list[Row[tuple[str, int]]]:
        """Up to `limit` blocks' (hash, size), least recently used first (the eviction order)."""
        query = select(KvBlock.hash, KvBlock.size)
        if model_fingerprint is not None:
            query = query.where(KvBlock.model_fingerprint == model_fingerprint)
        query = query.order_by(KvBlock.last_used_at, KvBlock.hash).limit(limit)
        return list(await self.db.execute(query))

    async def total_size(self, model_fingerprint: str | None = None) -> int:
        """Bytes indexed, for one model or all."""
        query = select(func.coalesce(func.sum(KvBlock.size), 0))
        if model_fingerprint is not None:
            query = query.where(KvBlock.model_fingerprint == model_fingerprint)
        return int(await self.db.scalar(query) or 0)

    async def known(self, hashes: list[str]) -> set[str]:
        """Which of `hashes` are indexed."""
        if not hashes:
            return set()
        query = select(KvBlock.hash).where(KvBlock.hash.in_(hashes))
        return set(await self.db.scalars(query))

    async def checksums(self, hashes: list[str]) -> dict[str, str]:
        """The stored payload checksum of each of `hashes` that is indexed."""
        if not hashes:
            return {}
        rows = await self.db.execute(select(KvBlock.hash, KvBlock.checksum).where(KvBlock.hash.in_(hashes)))
        return {row.hash: row.checksum for row in rows}
