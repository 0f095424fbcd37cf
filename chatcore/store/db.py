"""Engines, sessions and migrations.

`create_engine` is the only place that opens databases: on SQLite it turns on
foreign keys (and WAL for files) for every new connection, which the schema's
`ON DELETE CASCADE` relies on. Migrations run through Alembic with the scripts in
the repository's `migrations/` folder (a wheel carries a copy: chatcore/resources.py);
`run_migrations` and `downgrade` are synchronous (Alembic's async env.py calls
`asyncio.run`), so code already inside an event loop awaits `migrate` instead.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from chatcore.resources import MIGRATIONS_DIR
from chatcore.store.write_queue import QueuedSession, WriteQueue


def _sqlite_file(url: URL) -> Path | None:
    """The database file of a SQLite URL, or None for other backends and in-memory databases."""
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:") or url.query.get("mode") == "memory":
        return None
    return Path(database)


BUSY_TIMEOUT_MS = 5000
SYNCHRONOUS = {"NORMAL": "NORMAL", "FULL": "FULL"}  # the only values that reach the pragma


def create_engine(url: str, synchronous: str = "NORMAL") -> AsyncEngine:
    """An async engine for `url`, with SQLite's per-connection pragmas.

    For a SQLite file, the parent directory is created, and every connection gets
    `foreign_keys=ON`, `journal_mode=WAL`, `synchronous` (NORMAL: a power loss may lose the last
    acknowledged turns, never corrupt the file; FULL: it loses none) and a busy timeout (a writer waits
    for another's lock instead of failing at once with "database is locked"); an in-memory
    SQLite database gets `foreign_keys=ON` only.
    """
    parsed = make_url(url)
    engine = create_async_engine(parsed)
    if parsed.get_backend_name() != "sqlite":
        return engine
    path = _sqlite_file(parsed)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    pragmas = ["foreign_keys=ON"]
    if path is not None:
        pragmas += ["journal_mode=WAL", f"synchronous={SYNCHRONOUS[synchronous]}", f"busy_timeout={BUSY_TIMEOUT_MS}"]

    @event.listens_for(engine.sync_engine, "connect")
    def _set_pragmas(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        for pragma in pragmas:
            cursor.execute(f"PRAGMA {pragma}")
        cursor.close()

    return engine


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    """Sessions that keep loaded attributes after commit (`expire_on_commit=False`),
    so objects stay readable outside their transaction without a lazy load. On SQLite, their
    transactions queue in this process (`chatcore.store.write_queue`)."""
    if engine.dialect.name == "sqlite":
        return async_sessionmaker(engine, expire_on_commit=False, class_=QueuedSession,
                                  write_queue=WriteQueue())
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Config:
    """An Alembic config for `url` built in code; `migrations/env.py` reads the URL
    from `config.attributes["database_url"]` (no ini interpolation of `%` in passwords)."""
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(f"Alembic scripts not found at {MIGRATIONS_DIR}; this chatcore was installed without them")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["database_url"] = url
    return config


def run_migrations(url: str, revision: str = "head") -> None:
    """Upgrade the database at `url` to `revision`. Synchronous; must not run inside an event loop."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Downgrade the database at `url` to `revision` ("base" drops everything). Synchronous."""
    command.downgrade(alembic_config(url), revision)


async def migrate(url: str, revision: str = "head") -> None:
    """`run_migrations` for callers inside a running event loop (it runs in a worker thread)."""
    await asyncio.to_thread(run_migrations, url, revision)
