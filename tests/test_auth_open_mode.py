"""Open mode's cached answer, on a real database: the first key takes effect at once for a caller
that presents a key, and within `OPEN_MODE_RECHECK_S` for everyone else."""

from __future__ import annotations

from types import SimpleNamespace

from chatcore.server.auth import Authenticator
from chatcore.store.repos import Repos
from tests.test_store_support import database_url, engine, sessionmaker  # noqa: F401  (fixtures)


async def test_a_presented_key_rechecks_open_mode_at_once(sessionmaker) -> None:  # noqa: F811
    auth = Authenticator(SimpleNamespace(sessionmaker=sessionmaker, local_tenant_id="local"))
    assert await auth.open_mode() is True
    async with sessionmaker() as db, db.begin():
        await Repos(db).keys.create_api_key("carol")
    assert await auth.open_mode() is True  # the cached answer, for keyless callers
    assert await auth.open_mode(key_presented=True) is False  # never served as the local tenant
    assert await auth.open_mode() is False  # and keyed from then on
