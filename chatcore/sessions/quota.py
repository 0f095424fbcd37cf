"""The tenant's store quota: the one check every writer of stored message text passes first.

The measure is `TurnRepo.chars_for_tenant`: the characters of the tenant's stored messages (every
turn's text, its other answers as stored, and each session's system prompt). A write reserves the
characters it may add before it writes; the reservation holds until its rows are committed, so
writes of one tenant running at once (branches, imports, turns) are counted together and the
stored total never passes `max_stored_chars_per_tenant` (on one replica: replicas sharing a
database each count their own writes in flight). A write that would pass it is refused
(`TooLarge`, the message naming the limit) before anything is stored.

A turn reserves its user message plus the most its answers can hold (`answer_chars`): the answer
is generated after the check, so its worst case is counted up front and the characters it does
not use go back when the turn is saved.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from chatcore.sessions.errors import TooLarge
from chatcore.store.repos import Repos

# `alternatives` (the answers past the first when n > 1) are stored as a JSON list with ASCII
# escapes: a byte of text is at most one character, which is at most 6 once escaped (\\u0001), and
# each item adds its quotes and a separator.
JSON_CHARS_PER_CHAR = 6
JSON_ITEM_CHARS = 4


def longest_token(tokenizer: Any) -> int:
    """The most characters one generated token can add to an answer's text: its vocabulary's
    longest piece (a byte-level piece has a character per byte, and decoding never yields more
    characters than bytes; a SentencePiece piece decodes to at most its length)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(p) for p in pieces if isinstance(p, str)), default=1)


def answer_chars(max_tokens: int, n: int, token_chars: int) -> int:
    """The most characters a turn's answers can store: the first in the turn's text, the other
    `n - 1` in its `alternatives` JSON list."""
    longest = max_tokens * token_chars
    others = (n - 1) * (longest * JSON_CHARS_PER_CHAR + JSON_ITEM_CHARS)
    return longest + others


class Reservation:
    """Characters a write may add, counted as the tenant's until `settle` (idempotent)."""

    def __init__(self, quota: StoreQuota, tenant_id: str, chars: int) -> None:
        self._quota = quota
        self.tenant_id = tenant_id
        self.chars = chars

    def settle(self) -> None:
        if self.chars:
            self._quota.pending[self.tenant_id] -= self.chars
            if self._quota.pending[self.tenant_id] <= 0:
                del self._quota.pending[self.tenant_id]
            self.chars = 0


class StoreQuota:
    """`max_stored_chars_per_tenant`, checked against what is stored plus what is being written."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], limit: int) -> None:
        self.sessionmaker = sessionmaker
        self.limit = limit
        self.pending: Counter[str] = Counter()  # reserved by writes not yet committed, per tenant
        self._guards: dict[str, tuple[asyncio.Lock, int]] = {}

    async def reserve(self, tenant_id: str, chars: int, what: str) -> Reservation:
        """Count `chars` as the tenant's until the reservation is settled; `TooLarge` (nothing
        reserved) where the stored characters, those in flight and these would pass the limit.
        `what` names the write in the refusal ("the branch")."""
        if chars <= 0:
            return Reservation(self, tenant_id, 0)  # nothing added: never refused
        lock, users = self._guards.get(tenant_id, (asyncio.Lock(), 0))
        self._guards[tenant_id] = (lock, users + 1)
        try:
            async with lock:  # the read and the count together: no other write of the tenant between
                # In flight taken before the read: a write commits before it settles, so one settled
                # meanwhile is in the read (or in both: counted twice, never missed).
                pending = self.pending[tenant_id]
                async with self.sessionmaker() as db:
                    stored = await Repos(db).turns.chars_for_tenant(tenant_id)
                if stored + pending + chars > self.limit:
                    flight = f" ({pending} more being written)" if pending else ""
                    raise TooLarge(f"the tenant stores {stored} characters of messages{flight} and {what} adds "
                                   f"{chars}; the limit is {self.limit} (max_stored_chars_per_tenant)")
                self.pending[tenant_id] += chars
        finally:
            lock, users = self._guards[tenant_id]
            if users == 1:
                del self._guards[tenant_id]
            else:
                self._guards[tenant_id] = (lock, users - 1)
        return Reservation(self, tenant_id, chars)

    @asynccontextmanager
    async def hold(self, tenant_id: str, chars: int, what: str) -> AsyncIterator[Reservation]:
        """`reserve` for the span of a write that commits before the block ends."""
        reservation = await self.reserve(tenant_id, chars, what)
        try:
            yield reservation
        finally:
            reservation.settle()
