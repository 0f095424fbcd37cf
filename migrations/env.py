"""Alembic environment for chatcore: the async engine of `chatcore.store.db` and the
metadata of `chatcore.store.models`.

The URL comes from, in order: `config.attributes["database_url"]` (set by
`chatcore.store.db.alembic_config`), `sqlalchemy.url` in the ini file, then
`Settings().resolved_database_url` (CHATCORE_DATABASE_URL, or SQLite under
CHATCORE_DATA_DIR). Online runs call `asyncio.run`, so they must not be started
from a running event loop (`chatcore.store.db.migrate` uses a worker thread).
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection, make_url

from chatcore.store.db import create_engine
from chatcore.store.models import Base
from chatcore.store.types import UTCDateTime

config = context.config
if config.config_file_name is not None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _database_url() -> str:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    if url:
        return str(url)
    from chatcore.config import Settings

    return Settings().resolved_database_url


def _render_item(type_: str, obj: Any, autogen_context: Any) -> str | bool:
    """Autogenerate writes `UTCDateTime` as its portable column type: revisions never import chatcore."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _options(dialect_name: str) -> dict[str, Any]:
    # Batch mode lets SQLite alter tables by copying them; other backends alter in place.
    return {
        "target_metadata": Base.metadata,
        "render_as_batch": dialect_name == "sqlite",
        "compare_type": True,
        "render_item": _render_item,
    }


def _run_offline() -> None:
    url = _database_url()
    context.configure(url=url, literal_binds=True, **_options(make_url(url).get_backend_name()))
    with context.begin_transaction():
        context.run_migrations()


# Replicas that start together on one PostgreSQL database upgrade it one at a time: each waits
# for this transaction-scoped lock, then finds the schema at head. (SQLite serializes writers.)
MIGRATION_LOCK_ID = 0x63686174  # "chat"


def _run_sync(connection: Connection) -> None:
    context.configure(connection=connection, **_options(connection.dialect.name))
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": MIGRATION_LOCK_ID})
        context.run_migrations()


async def _run_online() -> None:
    engine = create_engine(_database_url())
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    _run_offline()
else:
    asyncio.run(_run_online())
