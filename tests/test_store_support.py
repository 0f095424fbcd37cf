"""Fixtures shared by the store tests (imported by them; this module holds no tests).

`database_url` is parametrized over backends: each test gets a fresh, empty
database per backend. SQLite files live in `tmp_path`; PostgreSQL databases are
created in one throw-away cluster per test process (`tests/pg_helpers.py`), when
PostgreSQL's binaries are installed (`make services`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from chatcore.store.db import create_engine, create_sessionmaker, migrate
from chatcore.store.repos import Repos
from tests.pg_helpers import fresh_database_url, postgres_available

BACKENDS = ["sqlite"] + (["postgresql"] if postgres_available() else [])


def sqlite_url(directory: Path) -> str:
    return f"sqlite+aiosqlite:///{directory / 'chatcore.db'}"


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh, empty database."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path)
    if request.param == "postgresql":
        return fresh_database_url(request.config)
    raise NotImplementedError(request.param)


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on a database migrated to head."""
    await migrate(database_url)
    engine = create_engine(database_url)
    yield engine
    await engine.dispose()


@pytest.fixture
def sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return create_sessionmaker(engine)


@pytest.fixture
async def repos(sessionmaker: async_sessionmaker[AsyncSession]) -> AsyncIterator[Repos]:
    """All repositories inside one transaction, committed after the test."""
    async with sessionmaker() as db, db.begin():
        yield Repos(db)
