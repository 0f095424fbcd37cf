"""The Alembic history against the models, and the engine's per-connection settings."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Connection, inspect, text
from sqlalchemy.ext.asyncio import AsyncEngine

from chatcore.store.db import MIGRATIONS_DIR, create_engine, downgrade, migrate
from chatcore.store.models import Base
from tests.test_store_support import database_url, engine  # noqa: F401  (fixtures)

TABLES = {"tenants", "api_keys", "sessions", "session_chains", "turns", "kv_blocks"}
REPO_ROOT = MIGRATIONS_DIR.parent


async def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda sync: inspect(sync).get_table_names()))
    finally:
        await engine.dispose()


async def test_upgrade_downgrade_upgrade(database_url: str) -> None:  # noqa: F811
    await migrate(database_url)
    assert await _tables(database_url) == TABLES | {"alembic_version"}
    await asyncio.to_thread(downgrade, database_url, "base")
    assert await _tables(database_url) == {"alembic_version"}
    await migrate(database_url)
    assert await _tables(database_url) == TABLES | {"alembic_version"}
    await migrate(database_url)  # idempotent at head


def _diff(conn: Connection) -> list[object]:
    context = MigrationContext.configure(conn, opts={"compare_type": True})
    return compare_metadata(context, Base.metadata)


async def test_models_match_migrated_schema(engine: AsyncEngine) -> None:  # noqa: F811
    async with engine.connect() as conn:
        assert await conn.run_sync(_diff) == []


async def test_sqlite_connection_pragmas(engine: AsyncEngine) -> None:  # noqa: F811
    if engine.dialect.name != "sqlite":
        pytest.skip("SQLite pragmas")
    async with engine.connect() as conn:
        assert (await conn.exec_driver_sql("PRAGMA foreign_keys")).scalar() == 1
        assert (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar() == "wal"
        assert (await conn.exec_driver_sql("PRAGMA synchronous")).scalar() == 1  # NORMAL


async def test_engine_creates_the_parent_directory(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'a' / 'b' / 'chatcore.db'}"
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT 1"))).scalar() == 1
    finally:
        await engine.dispose()
    assert (tmp_path / "a" / "b" / "chatcore.db").is_file()


def test_alembic_ini_takes_the_url_from_the_environment(database_url: str) -> None:  # noqa: F811
    env = {**os.environ, "CHATCORE_DATABASE_URL": database_url}

    def alembic(*args: str) -> str:
        command = [sys.executable, "-m", "alembic", "-c", str(REPO_ROOT / "alembic.ini"), *args]
        result = subprocess.run(command, env=env, capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return result.stdout

    alembic("upgrade", "head")
    assert "(head)" in alembic("current")
    alembic("check")  # fails when autogenerate would write a new revision


def test_the_server_s_files_are_private(tmp_path) -> None:
    import stat

    data = tmp_path / "new" / "data"
    env = {**os.environ, "CHATCORE_DATA_DIR": str(data)}
    subprocess.run([sys.executable, "-m", "chatcore.cli", "migrate"], env=env, check=True, capture_output=True)
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert stat.S_IMODE((data / "chatcore.db").stat().st_mode) == 0o600


@pytest.mark.parametrize(("setting", "pragma"), [("NORMAL", 1), ("FULL", 2)])
async def test_sqlite_connections_get_the_synchronous_setting_and_a_busy_timeout(tmp_path, setting, pragma) -> None:
    from chatcore.store.db import BUSY_TIMEOUT_MS

    sqlite = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}", setting)
    try:
        async with sqlite.connect() as conn:
            assert (await conn.execute(text("PRAGMA synchronous"))).scalar() == pragma
            assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar() == BUSY_TIMEOUT_MS
    finally:
        await sqlite.dispose()
