"""This replica's session leases (docs/deploy.md): take, renew, fence, release.

A session is owned by one replica at a time: the one whose lease in the `sessions` row is
live. The manager takes the lease when it creates or opens a session and before each turn;
this keeper renews the leases of sessions with a turn running (every `lease_s / 3`), closes
turns left running by replicas that died (their leases lapsed), and releases everything at
shutdown. A replica that dies simply stops renewing: its leases lapse after `lease_s`, and
whichever replica nginx sends the session to next takes it over.

One process on one machine is a cluster of one: the same code runs, and its replica id is
stable across restarts (hostname and data dir), so a restarted server recovers its own
sessions at once.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from chatcore.config import Settings
from chatcore.store.repos import Repos
from chatcore.store.repos.leases import LeaseResult
from chatcore.store.types import utcnow

log = logging.getLogger(__name__)


class LeaseLost(Exception):
    """Another replica took the session while this one was working on it: write nothing."""


def resolve_replica_id(settings: Settings) -> tuple[str, int | None]:
    """`settings.replica_id`, or `<hostname>-<hash of data_dir>` guarded by a lock file in the
    data dir: if another live process holds it (two servers on one data dir), this one gets a
    random suffix instead of sharing an identity. Returns the id and the lock's descriptor."""
    if settings.replica_id:
        return settings.replica_id, None
    data_dir = settings.data_dir.resolve()
    digest = hashlib.sha256(str(data_dir).encode()).hexdigest()[:8]
    replica = f"{socket.gethostname()}-{digest}"
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / "replica.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        replica = f"{replica}-{secrets.token_hex(4)}"
        log.warning("another server uses %s; this one is replica %s (set CHATCORE_REPLICA_ID)", data_dir, replica)
        return replica, None
    return replica, fd


class LeaseKeeper:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], settings: Settings,
                 running: Callable[[], list[str]]) -> None:
        self.sessionmaker = sessionmaker
        self.lease_s = settings.lease_s
        self.replica_id, self._lock_fd = resolve_replica_id(settings)
        self._running = running
        self._task: asyncio.Task[None] | None = None
        self.lost = 0

    async def acquire(self, session_id: str, tenant_id: str | None = None, *, wait: bool = True) -> LeaseResult:
        """Take (or renew) the session's lease. When another replica holds it, wait for it to
        lapse if it will within `lease_s` (a dead replica's lease); a live owner keeps renewing,
        so the result is then not acquired (the caller answers `conflict`)."""
        deadline = time.monotonic() + self.lease_s + 1.0
        while True:
            async with self.sessionmaker() as db, db.begin():
                result = await Repos(db).leases.acquire(session_id, self.replica_id, self.lease_s,
                                                        tenant_id=tenant_id)
            if result.acquired or not result.found or not wait or result.expires_at is None:
                return result
            lapses_in = (result.expires_at - utcnow()).total_seconds()
            if time.monotonic() + lapses_in > deadline:
                return result
            await asyncio.sleep(min(max(lapses_in, 0.02), 0.25))  # re-check until the lease lapses

    async def fence(self, repos: Repos, session_id: str) -> None:
        """Inside a transaction about to write the session: renew the lease or raise `LeaseLost`.
        The row stays locked (PostgreSQL) or the database stays locked (SQLite) until commit,
        so no replica can take the session between this check and the writes."""
        if session_id not in await repos.leases.renew(self.replica_id, [session_id], self.lease_s):
            raise LeaseLost(session_id)

    async def release(self, session_ids: list[str] | None = None) -> int:
        async with self.sessionmaker() as db, db.begin():
            return await Repos(db).leases.release(self.replica_id, session_ids)

    async def recover(self) -> int:
        """At start-up: close the turns that no live replica runs (this replica's previous run's
        included) and drop this replica's old leases. Returns how many turns were closed."""
        async with self.sessionmaker() as db, db.begin():
            repos = Repos(db)
            closed = await repos.leases.interrupt_orphans(self.replica_id, include_own=True)
            await repos.leases.release(self.replica_id)
        return closed

    # ----- the renewal loop ----------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="session-leases")

    async def stop(self) -> None:
        """Stop renewing and release every lease this replica holds (at shutdown)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self.release()
        except Exception:
            log.exception("releasing the session leases failed; they lapse in %.0f s", self.lease_s)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def _loop(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(self.lease_s / 3)
            ticks += 1
            try:
                await self.renew_running()
                if ticks % 3 == 0:
                    await self.sweep()
            except Exception:
                log.exception("lease renewal failed")

    async def renew_running(self) -> set[str]:
        ids = self._running()
        if not ids:
            return set()
        async with self.sessionmaker() as db, db.begin():
            renewed = await Repos(db).leases.renew(self.replica_id, ids, self.lease_s)
        for session_id in set(ids) - renewed:
            self.lost += 1
            log.error("lost the lease of session %s to another replica; its running turn will not be saved",
                      session_id)
        return renewed

    async def sweep(self) -> int:
        """Close the turns of replicas whose leases lapsed (they died mid-turn)."""
        async with self.sessionmaker() as db, db.begin():
            closed = await Repos(db).leases.interrupt_orphans(self.replica_id, include_own=False)
        if closed:
            log.warning("closed %d turn(s) left running by a replica that stopped", closed)
        return closed
