"""Operator routes: health, Prometheus metrics, and the cache audit with its block map."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sqlalchemy import func, select

from chatcore.cache import audit
from chatcore.engine.core import EngineCore
from chatcore.server.errors import ApiError
from chatcore.server.services import Services
from chatcore.store.models import ChatSession


@get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/metrics", media_type=CONTENT_TYPE_LATEST)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    services: Services = request.app.state.services
    m = services.metrics
    stats = services.engine.core.pool.stats()
    m.kv_blocks.labels("free").set(stats.free)
    m.kv_blocks.labels("cached").set(stats.cached)
    m.kv_blocks.labels("used").set(stats.used)
    counts = services.sessions.counts()
    async with services.sessionmaker() as db:
        total = await db.scalar(select(func.count()).select_from(ChatSession)) or 0
    m.sessions.labels("hot").set(counts["hot"])
    m.sessions.labels("warm").set(counts["warm"])
    m.sessions.labels("cold").set(max(0, total - counts["hot"] - counts["warm"]))
    seen = services.extra.get("preemptions_seen", 0)
    now = services.engine.core.scheduler.preemptions
    if now > seen:
        m.preemptions.inc(now - seen)
        services.extra["preemptions_seen"] = now
    rejected = services.disk.rejected if services.disk is not None else 0
    seen = services.extra.get("disk_rejected_seen", 0)
    if rejected > seen:  # corrupt, truncated or foreign block files the disk tier refused to use
        m.disk_blocks_rejected.inc(rejected - seen)
        services.extra["disk_rejected_seen"] = rejected
    return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)


def block_map(core: EngineCore, request_sessions: dict[str, str]) -> dict[str, Any]:
    """Runs on the engine thread: the audit plus which sessions map which blocks."""
    report = audit(core.pool)
    owners: dict[int, set[str]] = {}
    per_session: dict[str, dict[int, None]] = {}
    for table in core.pool.tables:
        owner = table.owner
        if owner.startswith("session:"):
            session = owner.removeprefix("session:")
        else:
            session = request_sessions.get(owner.split("/")[0], "")
        for block_id in table.block_ids:
            if session:
                owners.setdefault(block_id, set()).add(session)
        if session:
            per_session.setdefault(session, {}).update(dict.fromkeys(table.block_ids))
    blocks = []
    for block in core.pool.blocks:
        state = "used" if block.ref > 0 else "cached" if core.pool.is_cached(block.id) else "free"
        if state != "free":
            blocks.append({"id": block.id, "state": state, "ref": block.ref,
                           "sessions": sorted(owners.get(block.id, ()))})
    return {
        "block_size": core.pool.block_size,
        "audit": {"ok": report.ok, "violations": report.violations, "total": report.total, "free": report.free,
                  "cached": report.cached, "used": report.used, "sum_refs": report.sum_refs,
                  "sum_table_lens": report.sum_table_lens},
        "blocks": blocks,
        "sessions": [{"id": sid, "blocks": list(ids)} for sid, ids in per_session.items()],
    }


@get("/v1/admin/cache")
async def admin_cache(request: Request[Any, Any, Any]) -> dict[str, Any]:
    services: Services = request.app.state.services
    principal = await request.app.state.auth.principal(request)
    if not principal.is_admin:
        raise ApiError("unauthorized", "the admin routes need an admin key")
    live = services.sessions.live
    request_sessions = {s.request_id: s.id for s in live.values() if s.request_id}
    result = await services.engine.call(lambda core: block_map(core, request_sessions))
    titles = {s.id: s.title for s in live.values()}
    for item in result["sessions"]:
        item["title"] = titles.get(item["id"], "")
    result["tiers"] = services.tiers
    return result
