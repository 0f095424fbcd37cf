"""Session chains: the canonical token history and block hashes that rebuild a session's KV."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

from chatcore.store.models import SessionChain
from chatcore.store.packing import pack_hashes, pack_ids, unpack_hashes, unpack_ids


@dataclass(frozen=True, slots=True)
class Chain:
    """A session chain, unpacked."""

    session_id: str
    token_ids: list[int]
    block_hashes: list[bytes]
    block_size: int
    num_computed: int
    updated_at: datetime
    window_start: int = 0  # complete exchanges before the model's view (context policy `truncate`)


class ChainRepo:
    def __init__(self, db: AsyncSession) -> None:
        self.db = db

    async def save_chain(
        self,
        session_id: str,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        block_size: int,
        num_computed: int,
        window_start: int = 0,
    ) -> None:
        """Insert or replace the session's chain.

        Raises `ValueError` unless `block_size >= 1`, `0 <= num_computed <= len(token_ids)`
        and the hashes cover at most the full blocks (`len(block_hashes) <= len(token_ids) // block_size`).
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        if not 0 <= num_computed <= len(token_ids):
            raise ValueError(f"num_computed {num_computed} outside [0, {len(token_ids)}]")
        if len(block_hashes) > len(token_ids) // block_size:
            raise ValueError(f"{len(block_hashes)} block hashes for {len(token_ids) // block_size} full blocks")
        values = {
            "token_ids": pack_ids(token_ids),
            "block_hashes": pack_hashes(block_hashes),
            "block_size": block_size,
            "num_computed": num_computed,
            "window_start": window_start,
        }
        chain = await self.db.get(SessionChain, session_id)
        if chain is None:
            self.db.add(SessionChain(session_id=session_id, **values))
        else:
            for name, value in values.items():
                setattr(chain, name, value)
        await self.db.flush()

    async def load_chain(self, session_id: str) -> Chain | None:
        chain = await self.db.get(SessionChain, session_id)
        if chain is None:
            return None
        return Chain(
            session_id=chain.session_id,
            token_ids=unpack_ids(chain.token_ids),
            block_hashes=unpack_hashes(chain.block_hashes),
            block_size=chain.block_size,
            num_computed=chain.num_computed,
            updated_at=chain.updated_at,
            window_start=chain.window_start,
        )
