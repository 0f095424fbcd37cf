"""`chatcore migrate` and `chatcore keys create`, wired in `chatcore.cli`."""

from __future__ import annotations

import asyncio
import re
import sys
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import TypeVar

from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, make_url

from chatcore.config import Settings
from chatcore.store.db import (
    alembic_config,
    create_engine,
    create_sessionmaker,
    run_migrations,
)
from chatcore.store.models import ApiKey
from chatcore.store.repos import ApiKeyRepo

T = TypeVar("T")


MASK = "***"
SECRET_QUERY = re.compile(r"pass|secret|token|key|credential", re.IGNORECASE)  # password=, sslpassword=, sslkey=...


def masked_url(url: str) -> str:
    """`url` safe to print, wherever chatcore prints one (`config show`, `migrate`, `cluster up`):
    the password and the value of every query parameter named like a secret become `***`.

    A password with an unescaped `@` splits the URL where no parser can tell: with more than one
    `@` before the query, everything up to the last is masked; an `@` still left in the user or the
    host (a password that also holds a `?`) masks the whole rest. Raises SQLAlchemy's
    `ArgumentError` for text that is no URL."""
    scheme, sep, rest = url.partition("://")
    authority_and_path, question, query = rest.partition("?")
    if sep and authority_and_path.count("@") > 1:
        url = f"{scheme}://{MASK}@{authority_and_path.rpartition('@')[2]}{question}{query}"
    parsed = make_url(url)
    if "@" in (parsed.username or "") + (parsed.host or ""):
        return f"{parsed.drivername}://{MASK}"
    shown = {name: MASK if SECRET_QUERY.search(name) else value for name, value in parsed.query.items()}
    rendered = parsed.set(query=shown).render_as_string(hide_password=True)
    return rendered.replace(urllib.parse.quote(MASK, safe=""), MASK)  # as `***`, not `%2A%2A%2A`


async def _revision(url: str) -> str | None:
    """The database's Alembic revision; None for a database without one (new or empty)."""
    def current(connection: Connection) -> str | None:
        return MigrationContext.configure(connection).get_current_revision()

    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(current)
    finally:
        await engine.dispose()


def migrate_command(settings: Settings) -> int:
    """Upgrade the configured database to the newest schema, saying from which revision to which, and each
    step's purpose."""
    url = settings.resolved_database_url
    scripts = ScriptDirectory.from_config(alembic_config(url))
    head = scripts.get_current_head()
    before = asyncio.run(_revision(url))
    if before == head:
        print(f"database {masked_url(url)} is at the newest schema ({head}); nothing to do")
        return 0
    print(f"database {masked_url(url)}: upgrading from {before or 'an empty database'} to {head}")
    for step in reversed(list(scripts.iterate_revisions(head, before or "base"))):
        print(f"  {step.revision}: {step.doc}", flush=True)
    run_migrations(url)
    print(f"database {masked_url(url)} is at the newest schema ({asyncio.run(_revision(url))})")
    return 0


async def _with_keys(url: str, use: Callable[[ApiKeyRepo], Awaitable[T]]) -> T:
    """`use` on the key repository, in one transaction on a short-lived engine."""
    engine = create_engine(url)
    try:
        async with create_sessionmaker(engine)() as db, db.begin():
            return await use(ApiKeyRepo(db))
    finally:
        await engine.dispose()


def keys_create_command(settings: Settings, tenant: str, admin: bool) -> int:
    """Migrate, create a key for `tenant` (creating the tenant if needed), and print it.

    The key alone goes to stdout, on its own line, so `KEY=$(chatcore keys create ...)`
    captures it; the reminder that it is shown only once goes to stderr.
    """
    url = settings.resolved_database_url
    run_migrations(url)
    key = asyncio.run(_with_keys(url, lambda keys: keys.create_api_key(tenant, admin=admin)))
    print(key)
    kind = "admin key" if admin else "key"
    print(f"new {kind} for tenant {tenant!r}; it is shown only once, store it now", file=sys.stderr)
    return 0


def _key_line(key: ApiKey, tenant: str) -> str:
    state = f"revoked {key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else "active"
    return (f"{key.id}  {tenant}  {key.prefix}...  {'admin' if key.is_admin else 'user'}  "
            f"created {key.created_at:%Y-%m-%d %H:%M}  {state}")


def keys_list_command(settings: Settings, tenant: str | None) -> int:
    """One line per key: id, tenant, the key's first characters, role, created, active or revoked.
    Keys themselves are never stored, so never shown."""
    url = settings.resolved_database_url
    run_migrations(url)
    for key, name in asyncio.run(_with_keys(url, lambda keys: keys.list_all(tenant))):
        print(_key_line(key, name))
    return 0


def keys_revoke_command(settings: Settings, key_id: str) -> int:
    """Revoke a key by its id (from `keys list`); its requests fail at once, and a running server
    closes its WebSockets within a few seconds. Exit 2 when no active key has that id."""
    url = settings.resolved_database_url
    run_migrations(url)
    if not asyncio.run(_with_keys(url, lambda keys: keys.revoke_api_key(key_id))):
        print(f"chatcore keys revoke: no active key with id {key_id!r} (see `chatcore keys list`)", file=sys.stderr)
        return 2
    print(f"key {key_id} revoked", file=sys.stderr)
    return 0
