"""One replica: a `chatcore serve` process in its own session (it outlives `cluster up`), with
its own data dir and log, sharing the database and the disk tier with the others; and the state
they share, prepared once before any of them starts."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from chatcore.config import Settings
from chatcore.ops.errors import ClusterError


@dataclass
class Replica:
    id: str
    port: int
    pid: int
    data_dir: str
    log: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_replica(replica_id: str, port: int, data_dir: Path, database_url: str, kv_disk_dir: Path,
                  env: dict[str, str] | None = None) -> tuple[Replica, subprocess.Popen[bytes]]:
    """`chatcore serve` for one replica, in its own session (it outlives `cluster up`)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **(env or {}), "CHATCORE_HOST": "127.0.0.1", "CHATCORE_PORT": str(port),
                "CHATCORE_REPLICA_ID": replica_id, "CHATCORE_DATA_DIR": str(data_dir),
                "CHATCORE_DATABASE_URL": database_url, "CHATCORE_KV_DISK_DIR": str(kv_disk_dir)}
    log = data_dir / "serve.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "chatcore.cli", "serve"], env=full_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Replica(replica_id, port, proc.pid, str(data_dir), str(log)), proc


def prepare_shared_state(settings: Settings, database_url: str) -> None:
    """Once, before any replica starts, what each replica would otherwise do at the same moment
    at its own start: migrate the database, create the local tenant, and convert the default
    model if needed. Each step is also safe when replicas race on it (`get_or_create_tenant`
    inserts ON CONFLICT DO NOTHING; the conversion holds a file lock): doing them here first keeps
    a replica's start to loading, and reports a failure once, as `cluster up`'s own. The race on
    `local` was the `cluster up` that failed once and passed on a rerun."""
    from chatcore.models.loader import resolve_model_path
    from chatcore.store.db import run_migrations

    run_migrations(database_url)
    asyncio.run(_create_local_tenant(database_url))
    try:
        resolve_model_path(settings)
    except FileNotFoundError as exc:
        raise ClusterError(str(exc)) from None


async def _create_local_tenant(database_url: str) -> None:
    from chatcore.server.services import LOCAL_TENANT
    from chatcore.store.db import create_engine, create_sessionmaker
    from chatcore.store.repos import Repos

    db = create_engine(database_url)
    try:
        async with create_sessionmaker(db)() as session, session.begin():
            await Repos(session).tenants.get_or_create_tenant(LOCAL_TENANT)
    finally:
        await db.dispose()
