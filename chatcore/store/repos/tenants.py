"""Tenants and their API keys."""

from __future__ import annotations

import uuid

from sqlalchemy import func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from chatcore.store import tokens
from chatcore.store.models import ApiKey, Tenant
from chatcore.store.types import utcnow

# The dialects whose INSERT takes `ON CONFLICT DO NOTHING`: every backend chatcore runs on.
_INSERTS = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}


class TenantRepo:
    def __init__(self, db: AsyncSession) -> None:
        self.db = db

    async def get_tenant(self, name: str) -> Tenant | None:
        return await self.db.scalar(select(Tenant).where(Tenant.name == name))

    async def get_or_create_tenant(self, name: str) -> Tenant:
        """The tenant called `name`, created when missing.

        Safe against concurrent callers on other connections (replicas starting together on a
        fresh database): the insert is `ON CONFLICT (name) DO NOTHING`, so a caller that lost the
        race inserts nothing instead of failing on `uq_tenants_name`, and then reads the winner's
        row. The conflicting insert waits until the winner's transaction ends (PostgreSQL's row
        lock, SQLite's write lock), and the re-read sees the committed row under READ COMMITTED
        (PostgreSQL's default) and on SQLite, whose snapshot starts with that insert. Under
        REPEATABLE READ or SERIALIZABLE, PostgreSQL raises a serialization failure instead.
        """
        tenant = await self.get_tenant(name)
        if tenant is not None:
            return tenant
        await self._insert_if_missing(name)
        tenant = await self.get_tenant(name)
        assert tenant is not None, "inserted or conflicting, the row exists"
        return tenant

    async def _insert_if_missing(self, name: str) -> None:
        insert = _INSERTS[self.db.get_bind().dialect.name]
        statement = (
            insert(Tenant)
            .values(id=uuid.uuid4().hex, name=name)
            .on_conflict_do_nothing(index_elements=[Tenant.name])
        )
        await self.db.execute(statement)


class ApiKeyRepo:
    """API keys. Only sha256 digests are stored; the plaintext exists once, in `create_api_key`'s result.

    A revoked key still counts in `count_keys`: revoking every key locks the server
    rather than returning it to open mode.
    """

    def __init__(self, db: AsyncSession) -> None:
        self.db = db

    async def create_api_key(self, tenant_name: str, admin: bool = False) -> str:
        """Create a key for `tenant_name` (creating the tenant if needed); returns the plaintext key."""
        tenant = await TenantRepo(self.db).get_or_create_tenant(tenant_name)
        key = tokens.new_api_key()
        self.db.add(
            ApiKey(
                id=uuid.uuid4().hex,
                tenant_id=tenant.id,
                key_hash=tokens.digest(key),
                prefix=key[:8],
                is_admin=admin,
            )
        )
        await self.db.flush()
        return key

    async def authenticate(self, key: str) -> tuple[Tenant, bool, str] | None:
        """The key's tenant, whether it is an admin key, and the key's id; None for unknown or
        revoked keys."""
        key_hash = tokens.digest(key)
        row = (
            await self.db.execute(
                select(Tenant, ApiKey.key_hash, ApiKey.is_admin, ApiKey.id)
                .join(ApiKey, ApiKey.tenant_id == Tenant.id)
                .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
            )
        ).one_or_none()
        if row is None or not tokens.matches(key, row.key_hash):
            return None
        return row.Tenant, row.is_admin, row.id

    async def list_all(self, tenant_name: str | None = None) -> list[tuple[ApiKey, str]]:
        """Every key (revoked ones included) with its tenant's name, oldest first."""
        query = select(ApiKey, Tenant.name).join(Tenant, ApiKey.tenant_id == Tenant.id)
        if tenant_name is not None:
            query = query.where(Tenant.name == tenant_name)
        rows = await self.db.execute(query.order_by(ApiKey.created_at, ApiKey.id))
        return [(row.ApiKey, row.name) for row in rows]

    async def revoked_among(self, key_ids: list[str]) -> set[str]:
        """Which of `key_ids` are revoked (or gone)."""
        if not key_ids:
            return set()
        live = await self.db.scalars(select(ApiKey.id).where(ApiKey.id.in_(key_ids), ApiKey.revoked_at.is_(None)))
        return set(key_ids) - set(live)

    async def list_api_keys(self, tenant_id: str) -> list[ApiKey]:
        """The tenant's keys (revoked ones included), oldest first."""
        result = await self.db.scalars(
            select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.created_at, ApiKey.id)
        )
        return list(result)

    async def revoke_api_key(self, key_id: str) -> bool:
        """Revoke a key; False when no such key exists or it was already revoked."""
        key = await self.db.get(ApiKey, key_id)
        if key is None or key.revoked_at is not None:
            return False
        key.revoked_at = utcnow()
        await self.db.flush()
        return True

    async def count_keys(self) -> int:
        """All keys ever created, revoked ones included. Zero means the server runs in open mode."""
        return await self.db.scalar(select(func.count()).select_from(ApiKey)) or 0
