"""Tenants and their API keys."""

from __future__ import annotations

import uuid

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from chatcore.store import tokens
from chatcore.store.models import ApiKey, Tenant
from chatcore.store.types import utcnow


class TenantRepo:
    def __init__(self, db: AsyncSession) -> None:
        self.db = db

    async def get_tenant(self, name: str) -> Tenant | None:
        return await self.db.scalar(select(Tenant).where(Tenant.name == name))

    async def get_or_create_tenant(self, name: str) -> Tenant:
        """The tenant called `name`, created (and flushed) when missing."""
        tenant = await self.get_tenant(name)
        if tenant is None:
            tenant = Tenant(id=uuid.uuid4().hex, name=name)
            self.db.add(tenant)
            await self.db.flush()
        return tenant


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

    async def authenticate(self, key: str) -> tuple[Tenant, bool] | None:
        """The key's tenant and whether the key is an admin key; None for unknown or revoked keys."""
        key_hash = tokens.digest(key)
        row = (
            await self.db.execute(
                select(Tenant, ApiKey.key_hash, ApiKey.is_admin)
                .join(ApiKey, ApiKey.tenant_id == Tenant.id)
                .where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
            )
        ).one_or_none()
        if row is None or not tokens.matches(key, row.key_hash):
            return None
        return row.Tenant, row.is_admin

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
