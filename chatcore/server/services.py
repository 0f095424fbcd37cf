"""Everything a running server holds, started and stopped in order.

Start: migrate the database, load the model, start the engine thread and warm it up (one real
generation: a failure stops the start, chatcore/engine/warmup.py), mark the turns a crash left open
as interrupted, then start the session manager and its eviction policy.
Stop: the reverse, waiting for background disk writes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from chatcore.config import Settings
from chatcore.engine.commands import NumBlocks
from chatcore.engine.engine import InferenceEngine
from chatcore.engine.warmup import NotReady, Readiness, warm_up
from chatcore.kv.sizing import describe, disk_budget_bytes, holds
from chatcore.metrics import Metrics
from chatcore.models.loader import LoadedModel, load_model
from chatcore.outcomes import FinishReason
from chatcore.sessions.disk_tier import DiskTier
from chatcore.sessions.manager import SessionManager
from chatcore.sessions.policy import EvictionPolicy
from chatcore.sessions.residency import Residency
from chatcore.sessions.turns import TurnRunner
from chatcore.store.db import create_engine, create_sessionmaker, migrate
from chatcore.store.repos import Repos

log = logging.getLogger(__name__)
LOCAL_TENANT = "local"


@dataclass
class Services:
    settings: Settings
    db: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    engine: InferenceEngine
    metrics: Metrics
    sessions: SessionManager
    turns: TurnRunner
    residency: Residency
    policy: EvictionPolicy
    disk: DiskTier | None
    local_tenant_id: str
    model_name: str
    tiers: dict[str, Any]  # what each KV tier holds (`kv_tiers`)
    readiness: Readiness
    # The WebSocket connection attached to each session (a `chatcore.server.ws.Connection`): one at a
    # time. Typed Any: dependency injection evaluates these annotations at run time, and ws imports this module.
    ws_attached: dict[str, Any] = field(default_factory=dict)
    imports_running: int = 0  # POST /v1/sessions/import requests in flight (`max_concurrent_imports`)

    @classmethod
    async def start(cls, settings: Settings, loaded: LoadedModel | None = None,
                    on_device_lost: Callable[[str], None] | None = None) -> Services:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        url = settings.resolved_database_url
        await migrate(url)
        db = create_engine(url, settings.sqlite_synchronous)
        sessionmaker = create_sessionmaker(db)
        async with sessionmaker() as session, session.begin():
            local = await Repos(session).tenants.get_or_create_tenant(LOCAL_TENANT)
        loaded = loaded or await asyncio.to_thread(load_model, settings)
        engine = await asyncio.to_thread(InferenceEngine.launch, settings, loaded)
        info = engine.info
        try:
            await warm_up(engine)
        except NotReady as exc:
            log.critical("not ready: the warm-up generation failed: %s", exc)
            engine.shutdown()
            await db.dispose()
            raise
        metrics = Metrics()
        disk = None
        disk_bytes = disk_budget_bytes(settings.kv_disk_gb, settings.resolved_kv_disk_dir)
        if disk_bytes > 0:
            disk = DiskTier(settings.resolved_kv_disk_dir, info.fingerprint, disk_bytes, sessionmaker,
                            quiet=engine.prefill_quiet)
            await disk.sweep()  # what a crash left behind, before the budget counts files
        tiers = await kv_tiers(engine, disk_bytes)
        log.info("engine: %s on %s in %s; KV tiers: %s; %s", info.model_name, info.device, info.model_dtype,
                 describe("device pool", tiers["device"]),
                 describe("disk tier", tiers["disk"]) if tiers["disk"] else "no disk tier")
        manager = SessionManager(engine, sessionmaker, settings, metrics, disk, open_tenant=local.id)
        interrupted = await manager.mark_interrupted()
        if interrupted:
            log.warning("%d turn(s) were interrupted by the last shutdown", interrupted)
        policy = EvictionPolicy(manager, engine, settings)
        policy.start()
        manager.leases.start()
        residency = Residency(manager, engine, disk)
        turns = TurnRunner(manager, engine, residency, settings, metrics)
        readiness = Readiness(engine)
        readiness.start(on_device_lost)  # a loss before this is replayed to it
        return cls(settings, db, sessionmaker, engine, metrics, manager, turns, residency, policy, disk, local.id,
                   info.model_name, tiers, readiness)

    def limits(self) -> dict[str, int]:
        """What a client may ask for: the largest `max_tokens`, the longest message and the context, in tokens."""
        return {"max_tokens": self.settings.max_tokens_limit, "max_message_tokens": self.settings.max_message_tokens,
                "context": self.engine.info.max_context}

    async def stop(self) -> None:
        await self.policy.stop()
        for state in list(self.sessions.live.values()):
            if state.turn_running:
                await self.turns.cancel(state, FinishReason.DISCONNECTED)
        running = [s.running for s in self.sessions.live.values() if s.running is not None]
        await asyncio.gather(*running, return_exceptions=True)
        await asyncio.gather(*self.turns.background, *self.residency.background, return_exceptions=True)
        # Prefetches read through the disk tier into the engine, both closed below.
        await asyncio.gather(*[s.prefetching for s in self.sessions.live.values() if s.prefetching is not None],
                             return_exceptions=True)
        await self.sessions.leases.stop()  # releases this replica's leases
        self.sessions.close()
        self.engine.shutdown()
        await self.readiness.stop()
        if self.disk is not None:
            self.disk.close()
        await self.db.dispose()


async def kv_tiers(engine: InferenceEngine, disk_bytes: int) -> dict[str, Any]:
    """Each KV tier's size in bytes, tokens and whole sessions of 1k and 4k tokens."""
    info = engine.info
    per_token = info.kv_bytes_per_token
    per_block = per_token * info.block_size
    num_blocks = await engine.send(NumBlocks())
    device = {"device": info.device, "model_dtype": info.model_dtype, "dtype": info.kv_dtype, "blocks": num_blocks,
              **holds(num_blocks * per_block, per_token)}
    return {"device": device, "disk": holds(disk_bytes, per_token) if disk_bytes > 0 else None}
