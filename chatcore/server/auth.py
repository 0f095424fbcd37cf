"""Who is calling: a tenant from an API key, or the local tenant in open mode.

Open mode means no API key exists: the server then binds to loopback by default and treats
every caller as the local tenant (admin), ignoring any Authorization header, since OpenAI
clients always send one. As soon as a key exists, every protected route needs one.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from litestar.connection import ASGIConnection

from chatcore.outcomes import ErrorCode
from chatcore.periodic import Periodic
from chatcore.server.errors import ApiError
from chatcore.server.services import Services
from chatcore.store.repos import Repos

OPEN_MODE_RECHECK_S = 2.0
REVOKE_CHECK_S = 2.0
SCOPE_KEY = "chatcore.principal"


@dataclass(frozen=True, slots=True)
class Principal:
    tenant_id: str
    tenant_name: str
    is_admin: bool
    key_id: str | None = None  # None in open mode


class Authenticator:
    def __init__(self, services: Services) -> None:
        self.services = services
        self._open: bool | None = None
        self._checked_at = 0.0

    async def open_mode(self, key_presented: bool = False) -> bool:
        """No key configured. While open, re-checked every few seconds, and at once when a caller
        presents a key, so `keys create` takes effect live and the first keyed request is never
        served as the local tenant."""
        now = time.monotonic()
        if self._open is None or (self._open and (key_presented or now - self._checked_at > OPEN_MODE_RECHECK_S)):
            async with self.services.sessionmaker() as db:
                self._open = await Repos(db).keys.count_keys() == 0
            self._checked_at = now
        return self._open

    async def principal(self, connection: ASGIConnection) -> Principal:
        """The caller; looked up once per request (the route guard's answer is kept in the scope)."""
        scope = cast("dict[str, Any]", connection.scope)
        found = scope.get(SCOPE_KEY)
        if not isinstance(found, Principal):
            found = scope[SCOPE_KEY] = await self._lookup(connection)
        return found

    async def _lookup(self, connection: ASGIConnection) -> Principal:
        return await self.for_key(presented_key(connection))

    async def for_key(self, key: str | None) -> Principal:
        """The caller holding `key` (None: no key presented)."""
        if await self.open_mode(key_presented=key is not None):
            return Principal(self.services.local_tenant_id, "local", True)
        if not key:
            raise ApiError(ErrorCode.UNAUTHORIZED, "an API key is required (Authorization: Bearer, or api_key=)")
        async with self.services.sessionmaker() as db:
            found = await Repos(db).keys.authenticate(key)
        if found is None:
            raise ApiError(ErrorCode.UNAUTHORIZED, "invalid API key")
        tenant, is_admin, key_id = found
        return Principal(tenant.id, tenant.name, is_admin, key_id)


class RevocationWatch:
    """Ends what a revoked key still holds open: every `REVOKE_CHECK_S`, the keys of the open
    WebSockets are looked up in one query, and each socket whose key is revoked is closed (its
    `close` callback). An HTTP request is authenticated anew each time, so it needs nothing."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self._open: dict[int, tuple[str, Callable[[], None]]] = {}
        self._next = 0
        self._periodic = Periodic("checking for revoked keys", REVOKE_CHECK_S, self.check)

    def register(self, key_id: str, close: Callable[[], None]) -> int:
        self._next += 1
        self._open[self._next] = (key_id, close)
        return self._next

    def unregister(self, handle: int) -> None:
        self._open.pop(handle, None)

    def start(self) -> None:
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()

    async def check(self) -> int:
        """Close the sockets of revoked keys now; returns how many."""
        if not self._open:
            return 0
        async with self.services.sessionmaker() as db:
            revoked = await Repos(db).keys.revoked_among(sorted({key for key, _ in self._open.values()}))
        closing = [handle for handle, (key, _) in self._open.items() if key in revoked]
        for handle in closing:
            _, close = self._open.pop(handle)
            close()
        return len(closing)


def presented_key(connection: ASGIConnection) -> str | None:
    return _bearer(connection.headers.get("authorization")) or connection.query_params.get("api_key")


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() or None if scheme.lower() == "bearer" else None


def _is_loopback_name(hostname: str) -> bool:
    if hostname == "localhost" or hostname.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False


async def host_allowed(connection: ASGIConnection, auth: Authenticator, allowed_hosts: list[str]) -> bool:
    """Open mode answers only to loopback names (or `CHATCORE_ALLOWED_HOSTS`).

    Without this, a web page on a name that resolves to 127.0.0.1 (DNS rebinding) would be
    "same origin" with the local server and could read every session. Keyed mode needs a key
    the page does not have, so any Host is fine there.
    """
    if not await auth.open_mode():
        return True
    host = connection.headers.get("host", "")
    hostname = host[1:host.index("]")] if host.startswith("[") and "]" in host else host.rsplit(":", 1)[0]
    return _is_loopback_name(hostname.lower()) or hostname.lower() in {h.lower() for h in allowed_hosts} \
        or "*" in allowed_hosts
