"""The disk tier's index of persisted KV blocks, keyed by content hash (hex)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from chatcore.store.models import KvBlock
from chatcore.store.types import utcnow


class KvBlockRepo:
    """Least recently used first means: oldest `last_used_at`, ties broken by hash."""

    def __init__(self, db: AsyncSession) -> None:
        self.db = db

    async def upsert_block(
        self, hash: str, *, path: str, size: int, checksum: str, model_fingerprint: str
    ) -> KvBlock:
        """Index a written block; rewriting a known hash replaces its file fields and counts as a use."""
        block = await self.db.get(KvBlock, hash)
        if block is None:
            block = KvBlock(hash=hash, path=path, size=size, checksum=checksum, model_fingerprint=model_fingerprint)
            self.db.add(block)
        else:
            block.path, block.size, block.checksum = path, size, checksum
            block.model_fingerprint = model_fingerprint
            block.last_used_at = utcnow()
        await self.db.flush()
        return block

    async def get_block(self, hash: str) -> KvBlock | None:
        return await self.db.get(KvBlock, hash)

    async def touch_block(self, hash: str, at: datetime | None = None) -> bool:
        """Count a hit and mark the block used now (or at `at`); False when it is not indexed."""
        result = await self.db.execute(
            update(KvBlock).where(KvBlock.hash == hash).values(hits=KvBlock.hits + 1, last_used_at=at or utcnow())
        )
        return bool(result.rowcount)

    async def delete_block(self, hash: str) -> bool:
        result = await self.db.execute(delete(KvBlock).where(KvBlock.hash == hash))
        return bool(result.rowcount)

    async def lru_blocks(self, limit: int, model_fingerprint: str | None = None) -> list[KvBlock]:
        """Up to `limit` blocks, least recently used first (the eviction order)."""
        query = select(KvBlock)
        if model_fingerprint is not None:
            query = query.where(KvBlock.model_fingerprint == model_fingerprint)
        query = query.order_by(KvBlock.last_used_at, KvBlock.hash).limit(limit)
        return list(await self.db.scalars(query))

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
