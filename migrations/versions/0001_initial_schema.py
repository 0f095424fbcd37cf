"""initial schema: tenants, api_keys, sessions, session_chains, turns, kv_blocks

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _counter(name: str) -> sa.Column:
    return sa.Column(name, sa.Integer(), server_default=sa.text("0"), nullable=False)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        _timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )

    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=8), nullable=False),
        sa.Column("is_admin", sa.Boolean(), server_default=sa.false(), nullable=False),
        _timestamp("created_at"),
        _timestamp("revoked_at", nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
    )
    op.create_index(op.f("ix_api_keys_key_hash"), "api_keys", ["key_hash"], unique=True)
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])

    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("tenant_id", sa.String(length=32), nullable=False),
        sa.Column("title", sa.String(length=255), server_default="", nullable=False),
        sa.Column("system_prompt", sa.Text(), nullable=True),
        _timestamp("created_at"),
        _timestamp("updated_at"),
        _timestamp("last_active_at"),
        sa.Column("state", sa.String(length=8), server_default="hot", nullable=False),
        sa.Column("model_fingerprint", sa.String(length=128), nullable=False),
        sa.Column("resume_token_hash", sa.String(length=64), nullable=False),
        _counter("next_seq"),
        sa.Column("owner_replica", sa.String(length=255), nullable=True),
        _timestamp("lease_expires_at", nullable=True),
        sa.CheckConstraint("state IN ('hot', 'warm', 'cold')", name=op.f("ck_sessions_state")),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_sessions_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
    )
    op.create_index(op.f("ix_sessions_state_last_active_at"), "sessions", ["state", "last_active_at"])
    op.create_index(op.f("ix_sessions_tenant_id"), "sessions", ["tenant_id"])

    op.create_table(
        "session_chains",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("block_hashes", sa.LargeBinary(), nullable=False),
        sa.Column("block_size", sa.Integer(), nullable=False),
        _counter("num_computed"),
        _timestamp("updated_at"),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_session_chains_session_id_sessions"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_session_chains")),
    )

    op.create_table(
        "turns",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("token_ids", sa.LargeBinary(), nullable=False),
        sa.Column("client_id", sa.String(length=128), nullable=True),
        sa.Column("finish_reason", sa.String(length=16), nullable=True),
        _counter("prompt_tokens"),
        _counter("cached_tokens"),
        _counter("cached_device_tokens"),
        _counter("cached_disk_tokens"),
        _counter("recomputed_tokens"),
        _counter("completion_tokens"),
        sa.Column("queue_ms", sa.Float(), nullable=True),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("total_ms", sa.Float(), nullable=True),
        sa.Column("alternatives", sa.JSON(), nullable=True),
        _timestamp("created_at"),
        sa.CheckConstraint("role IN ('system', 'user', 'assistant')", name=op.f("ck_turns_role")),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_turns_session_id_sessions"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_turns")),
        sa.UniqueConstraint("session_id", "idx", name=op.f("uq_turns_session_id_idx")),
    )
    op.create_index(op.f("ix_turns_session_id_client_id"), "turns", ["session_id", "client_id"])

    op.create_table(
        "kv_blocks",
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("path", sa.String(length=255), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("checksum", sa.String(length=128), nullable=False),
        sa.Column("model_fingerprint", sa.String(length=128), nullable=False),
        _timestamp("created_at"),
        _timestamp("last_used_at"),
        _counter("hits"),
        sa.PrimaryKeyConstraint("hash", name=op.f("pk_kv_blocks")),
    )
    op.create_index(op.f("ix_kv_blocks_last_used_at"), "kv_blocks", ["last_used_at"])
    op.create_index(op.f("ix_kv_blocks_model_fingerprint"), "kv_blocks", ["model_fingerprint"])


def downgrade() -> None:
    for table in ("kv_blocks", "turns", "session_chains", "sessions", "api_keys", "tenants"):
        op.drop_table(table)
