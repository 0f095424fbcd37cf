"""Operator routes: health, Prometheus metrics, and the cache audit with its block map."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

from litestar import Response, get
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sqlalchemy import func, select

from chatcore.engine.commands import BlockMap
from chatcore.engine.warmup import NotReady
from chatcore.outcomes import ErrorCode
from chatcore.periodic import Periodic
from chatcore.server.auth import Principal
from chatcore.server.errors import ApiError, not_ready
from chatcore.server.services import Services
from chatcore.store.models import ChatSession

log = logging.getLogger(__name__)
GAUGE_REFRESH_S = 5.0


READY_TIMEOUT_S = 5.0


@get("/healthz")
async def healthz() -> dict[str, str]:
    """Liveness: the event loop answers."""
    return {"status": "ok"}


@get("/readyz")
async def readyz(services: Services) -> Response[dict[str, Any]]:
    """Readiness, each check within `READY_TIMEOUT_S`: the engine (its thread answers between two
    steps and, while its last step failed, a short generation succeeds again: chatcore/engine/warmup.py)
    and the database (a query). 503 names the failing checks, with the engine's cause."""

    async def database() -> None:
        async with services.sessionmaker() as db:
            await db.execute(select(1))

    causes = {"engine": await _cause(services.readiness.check()), "database": await _cause(database())}
    checks = {name: "ok" if cause is None else "failing" for name, cause in causes.items()}
    failing = {name: cause for name, cause in causes.items() if cause is not None}
    return not_ready(checks, failing) if failing else Response({"status": "ready", "checks": checks})


async def _cause(check: Awaitable[object]) -> str | None:
    """None when `check` succeeds in time; else why not, in a line: the engine's cause as it is, and
    for anything else the exception's type alone (a database error's text can name hosts and users)."""
    try:
        await asyncio.wait_for(check, READY_TIMEOUT_S)
    except NotReady as exc:
        return str(exc)
    except TimeoutError:
        return f"no answer within {READY_TIMEOUT_S:g} s"
    except Exception as exc:  # any failure: not ready; the whole story is the operator's, in the log
        log.warning("readiness check failed", exc_info=True)
        return type(exc).__name__
    return None


async def metrics_guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """`metrics_auth=key`: the caller's key, as on the other keyed routes (open mode has none to ask for)."""
    if connection.app.state.services.settings.metrics_auth == "key":
        await connection.app.state.auth.principal(connection)


@get("/metrics", media_type=CONTENT_TYPE_LATEST, guards=[metrics_guard])
async def metrics(services: Services) -> Response[bytes]:
    """O(1): the counters catch up with two running totals; the gauges are `GaugeRefresher`'s."""
    m = services.metrics
    m.catch_up(m.preemptions, services.engine.state.preemptions)
    # Corrupt, truncated or foreign block files the disk tier refused to use.
    m.catch_up(m.disk_blocks_rejected, services.disk.rejected if services.disk is not None else 0)
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


class GaugeRefresher:
    """Sets the gauges that cost work to read, every `GAUGE_REFRESH_S`: KV blocks by state (read on the
    engine thread, where the pool lives) and sessions by state (the cold ones need a count of every
    session row). A scrape then never touches the database or walks the pool."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self._periodic = Periodic("refreshing the metrics gauges", GAUGE_REFRESH_S, self.refresh)

    async def start(self) -> None:
        await self.refresh()
        self._periodic.start()

    async def stop(self) -> None:
        await self._periodic.stop()

    async def refresh(self) -> None:
        services = self.services
        stats = await services.engine.stats()
        services.metrics.set_kv_blocks(stats.free, stats.cached, stats.used)
        async with services.sessionmaker() as db:
            total = await db.scalar(select(func.count()).select_from(ChatSession)) or 0
        counts = services.sessions.counts()
        services.metrics.set_sessions(counts["hot"], counts["warm"], total)


@get("/v1/admin/cache")
async def admin_cache(services: Services, principal: Principal) -> dict[str, Any]:
    if not principal.is_admin:
        raise ApiError(ErrorCode.UNAUTHORIZED, "the admin routes need an admin key")
    live = services.sessions.live
    request_sessions = {s.request_id: s.id for s in live.values() if s.request_id}
    result = await services.engine.send(BlockMap(request_sessions))
    titles = {s.id: s.title for s in live.values()}
    for item in result["sessions"]:
        item["title"] = titles.get(item["id"], "")
    result["tiers"] = services.tiers
    return result
