"""The typed ORM schema. `migrations/` holds its history; the two must never differ.

Portability rules (SQLite now, PostgreSQL later):
- only portable column types: String, Text, Integer, Float, Boolean, LargeBinary, JSON,
  and `UTCDateTime` for every timestamp (aware UTC on both backends);
- every constraint and index gets a stable name from `NAMING_CONVENTION`, so batch
  migrations on SQLite can find them;
- foreign keys cascade in the database (`ON DELETE CASCADE`); on SQLite the engine
  turns `PRAGMA foreign_keys` on for every connection (see `chatcore.store.db`);
- defaults are set in Python and, for counters and flags, mirrored as server defaults.

There are no ORM relationships: repositories query by key, so no lazy load can
happen in async code.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal, get_args

from sqlalchemy import (
    JSON,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, MappedColumn, mapped_column

from chatcore.store.types import UTCDateTime, utcnow

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

SessionState = Literal["hot", "warm", "cold"]
Role = Literal["system", "user", "assistant"]

SESSION_STATES: tuple[str, ...] = get_args(SessionState)
ROLES: tuple[str, ...] = get_args(Role)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime()}


def _created() -> MappedColumn[Any]:
    return mapped_column(default=utcnow)


def _counter() -> MappedColumn[Any]:
    return mapped_column(Integer, default=0, server_default=text("0"))


def _tenant_fk() -> MappedColumn[Any]:
    return mapped_column(String(32), ForeignKey("tenants.id", ondelete="CASCADE"), index=True)


def _session_fk(*, primary_key: bool = False) -> MappedColumn[Any]:
    return mapped_column(String(64), ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=primary_key)


class Tenant(Base):
    """An isolation boundary: sessions and API keys belong to exactly one tenant."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # uuid4().hex
    name: Mapped[str] = mapped_column(String(255), unique=True)
    created_at: Mapped[datetime] = _created()


class ApiKey(Base):
    """An API key. Only the sha256 hex of the key is stored; the plaintext is shown once."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # uuid4().hex
    tenant_id: Mapped[str] = _tenant_fk()
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    prefix: Mapped[str] = mapped_column(String(8))
    is_admin: Mapped[bool] = mapped_column(default=False, server_default=false())
    created_at: Mapped[datetime] = _created()
    revoked_at: Mapped[datetime | None]


class ChatSession(Base):
    """A conversation. `next_seq` is the next WebSocket frame sequence number to hand out."""

    __tablename__ = "sessions"
    __table_args__ = (
        CheckConstraint(_in("state", SESSION_STATES), name="state"),
        Index(None, "state", "last_active_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # secrets.token_urlsafe(16)
    tenant_id: Mapped[str] = _tenant_fk()
    title: Mapped[str] = mapped_column(String(255), default="", server_default="")
    system_prompt: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    last_active_at: Mapped[datetime] = mapped_column(default=utcnow)
    state: Mapped[str] = mapped_column(String(8), default="hot", server_default="hot")
    model_fingerprint: Mapped[str] = mapped_column(String(128))
    resume_token_hash: Mapped[str] = mapped_column(String(64))
    next_seq: Mapped[int] = _counter()
    owner_replica: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None]


class SessionChain(Base):
    """Everything needed to rebuild a session's KV: its canonical tokens and block hashes.

    Invariants: `token_ids` packs little-endian uint32 (`packing.pack_ids`);
    `block_hashes` concatenates 16-byte hashes of the leading full blocks, so
    `len(hashes) <= len(token_ids) // block_size`; `num_computed <= len(token_ids)`.
    `token_ids` is the model's view: with the context policy `truncate` it starts after the
    session's first `window_start` complete exchanges (the system prompt always stays).
    """

    __tablename__ = "session_chains"

    session_id: Mapped[str] = _session_fk(primary_key=True)
    token_ids: Mapped[bytes]
    block_hashes: Mapped[bytes]
    block_size: Mapped[int]
    num_computed: Mapped[int] = _counter()
    window_start: Mapped[int] = _counter()
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Turn(Base):
    """One message of a session. `idx` numbers the turns of a session from 0.

    An assistant turn with `finish_reason` NULL is still being generated; after a
    crash, `TurnRepo.mark_interrupted` closes such turns as "interrupted".
    """

    __tablename__ = "turns"
    __table_args__ = (
        UniqueConstraint("session_id", "idx"),
        CheckConstraint(_in("role", ROLES), name="role"),
        Index(None, "session_id", "client_id"),
    )

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    session_id: Mapped[str] = _session_fk()  # indexed by uq_turns_session_id_idx
    idx: Mapped[int]
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    token_ids: Mapped[bytes]
    client_id: Mapped[str | None] = mapped_column(String(128))
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = _counter()
    cached_tokens: Mapped[int] = _counter()
    cached_device_tokens: Mapped[int] = _counter()
    cached_disk_tokens: Mapped[int] = _counter()
    recomputed_tokens: Mapped[int] = _counter()
    completion_tokens: Mapped[int] = _counter()
    queue_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    total_ms: Mapped[float | None] = mapped_column(Float)
    alternatives: Mapped[list[str] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = _created()


class KvBlock(Base):
    """The disk tier's index entry for one persisted KV block, keyed by its content hash (hex)."""

    __tablename__ = "kv_blocks"

    hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    path: Mapped[str] = mapped_column(String(255))
    size: Mapped[int]
    checksum: Mapped[str] = mapped_column(String(128))
    model_fingerprint: Mapped[str] = mapped_column(String(128), index=True)
    created_at: Mapped[datetime] = _created()
    last_used_at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    hits: Mapped[int] = _counter()
