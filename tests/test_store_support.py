"""Fixtures shared by the store tests (imported by them; this module holds no tests).

`database_url` is parametrized over backends: each test gets a fresh, empty
database per backend. SQLite files live in `tmp_path`; a PostgreSQL backend can be
added to `BACKENDS` with a branch in `database_url` that creates a scratch database.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from chatcore.store.db import create_engine, create_sessionmaker, migrate
from chatcore.store.repos import Repos

BACKENDS = ["sqlite"]


def sqlite_url(directory: Path) -> str:
    return f"sqlite+aiosqlite:///{directory / 'chatcore.db'}"


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a fresh, empty database."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path)
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
