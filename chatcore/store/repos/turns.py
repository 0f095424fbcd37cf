"""Turns: the messages of a session, with their token ids and serving statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from sqlalchemy import Text, cast, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from chatcore.outcomes import FinishReason
from chatcore.store.models import ROLES, ChatSession, Role, Turn
from chatcore.store.packing import pack_ids


@dataclass(frozen=True, slots=True)
class TurnStats:
    """How a turn was served: token counts by cache source, and latencies in milliseconds."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_device_tokens: int = 0
    cached_disk_tokens: int = 0
    recomputed_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None


class TurnRepo:
    """Turns are numbered 0, 1, 2... per session (`idx`). An assistant turn added with
    `finish_reason=None` is in flight until `finish_turn` closes it."""

    def __init__(self, db: AsyncSession) -> None:
        self.db = db

    async def add_turn(
        self,
        session_id: str,
        role: Role,
        content: str,
        token_ids: Sequence[int],
        *,
        client_id: str | None = None,
        finish_reason: FinishReason | None = None,
        stats: TurnStats | None = None,
        alternatives: list[str] | None = None,
    ) -> Turn:
        """Append a turn with the next `idx` of the session."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        last = await self.db.scalar(select(func.max(Turn.idx)).where(Turn.session_id == session_id))
        turn = Turn(
            session_id=session_id,
            idx=0 if last is None else last + 1,
            role=role,
            content=content,
            token_ids=pack_ids(token_ids),
            client_id=client_id,
            finish_reason=finish_reason,
            alternatives=alternatives,
            **asdict(stats or TurnStats()),
        )
        self.db.add(turn)
        await self.db.flush()
        return turn

    async def add_exchange(self, session_id: str, content: str, token_ids: Sequence[int], *,
                           client_id: str | None = None) -> Turn:
        """Append the user's turn and the assistant's turn in flight after it (one INSERT of both
        rows); returns the assistant's."""
        last = await self.db.scalar(select(func.max(Turn.idx)).where(Turn.session_id == session_id))
        first = 0 if last is None else last + 1
        user = Turn(session_id=session_id, idx=first, role="user", content=content, token_ids=pack_ids(token_ids),
                    client_id=client_id, **asdict(TurnStats()))
        assistant = Turn(session_id=session_id, idx=first + 1, role="assistant", content="", token_ids=pack_ids([]),
                         client_id=client_id, **asdict(TurnStats()))
        self.db.add_all([user, assistant])
        await self.db.flush()
        return assistant

    async def finish_turn(
        self,
        turn_id: int,
        *,
        content: str,
        token_ids: Sequence[int],
        finish_reason: FinishReason,
        stats: TurnStats | None = None,
        alternatives: list[str] | None = None,
    ) -> Turn | None:
        """Close an in-flight turn with its final text, tokens and statistics; None if it does not exist."""
        turn = await self.db.get(Turn, turn_id)
        if turn is None:
            return None
        turn.content = content
        turn.token_ids = pack_ids(token_ids)
        turn.finish_reason = finish_reason
        turn.alternatives = alternatives
        for name, value in asdict(stats or TurnStats()).items():
            setattr(turn, name, value)
        await self.db.flush()
        return turn

    async def list_turns(self, session_id: str) -> list[Turn]:
        return list(await self.db.scalars(select(Turn).where(Turn.session_id == session_id).order_by(Turn.idx)))

    async def chars_for_tenant(self, tenant_id: str) -> int:
        """Characters of every stored message of the tenant's sessions (its store quota's measure,
        chatcore/sessions/quota.py): each turn's text, its other answers as stored (their JSON list;
        a JSON null is none), and each session's system prompt."""
        alternatives = func.length(func.nullif(cast(Turn.alternatives, Text), "null"))
        turns = (select(func.coalesce(func.sum(func.length(Turn.content) + func.coalesce(alternatives, 0)), 0))
                 .join(ChatSession, ChatSession.id == Turn.session_id).where(ChatSession.tenant_id == tenant_id))
        prompts = select(func.coalesce(func.sum(func.length(ChatSession.system_prompt)), 0)).where(
            ChatSession.tenant_id == tenant_id)
        return int(await self.db.scalar(turns) or 0) + int(await self.db.scalar(prompts) or 0)

    async def find_by_client_id(self, session_id: str, client_id: str) -> list[Turn]:
        """The turns of the exchange started by the client's message `client_id`, in order."""
        query = select(Turn).where(Turn.session_id == session_id, Turn.client_id == client_id).order_by(Turn.idx)
        return list(await self.db.scalars(query))

    async def mark_interrupted(self, session_id: str | None = None) -> int:
        """Close in-flight assistant turns (of one session, or all) as "interrupted"; returns how many."""
        query = update(Turn).where(Turn.role == "assistant", Turn.finish_reason.is_(None))
        if session_id is not None:
            query = query.where(Turn.session_id == session_id)
        result = await self.db.execute(query.values(finish_reason=FinishReason.INTERRUPTED))
        return result.rowcount
