"""`chatcore migrate` and `chatcore keys create`, wired in `chatcore.cli`."""

from __future__ import annotations

import asyncio
import sys

from sqlalchemy.engine import make_url

from chatcore.config import Settings
from chatcore.store.db import create_engine, create_sessionmaker, run_migrations
from chatcore.store.repos import ApiKeyRepo


def masked_url(url: str) -> str:
    """`url` with any password replaced by `***`, safe to print."""
    return make_url(url).render_as_string(hide_password=True)


def migrate_command(settings: Settings) -> int:
    """Upgrade the configured database to the newest schema."""
    url = settings.resolved_database_url
    run_migrations(url)
    print(f"database {masked_url(url)} is at the newest schema")
    return 0


async def _create_key(url: str, tenant: str, admin: bool) -> str:
    engine = create_engine(url)
    try:
        async with create_sessionmaker(engine)() as db, db.begin():
            return await ApiKeyRepo(db).create_api_key(tenant, admin=admin)
    finally:
        await engine.dispose()


def keys_create_command(settings: Settings, tenant: str, admin: bool) -> int:
    """Migrate, create a key for `tenant` (creating the tenant if needed), and print it.

    The key alone goes to stdout, on its own line, so `KEY=$(chatcore keys create ...)`
    captures it; the reminder that it is shown only once goes to stderr.
    """
    url = settings.resolved_database_url
    run_migrations(url)
    key = asyncio.run(_create_key(url, tenant, admin))
    print(key)
    kind = "admin key" if admin else "key"
    print(f"new {kind} for tenant {tenant!r}; it is shown only once, store it now", file=sys.stderr)
    return 0
