"""The whole cluster: PostgreSQL (if asked), the replicas and nginx, started in that order and
stopped in reverse, and the record of what was started.

`cluster_up` writes what it started (pids, ports, paths) to `<data dir>/cluster/cluster.json`,
so that `cluster_down` stops exactly those processes. Layout under `<data dir>/cluster/`:
`cluster.json`; `nginx/` (the conf rendered from deploy/nginx.conf, its logs and pid);
`replica-<i>/` (each replica's data dir and log); `postgres/` (the PostgreSQL cluster, when
`--postgres`; see `postgres_home` for root). Every replica shares the database and the disk
tier (`CHATCORE_KV_DISK_DIR`, by default `<data dir>/kv`).

A part that fails to start (PostgreSQL, a replica, nginx) raises `ClusterError` with its exit
code and the tail of its log, after what had started is stopped again.
"""

from __future__ import annotations

import json
import signal
import subprocess
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from chatcore.config import Settings
from chatcore.ops.errors import ClusterError
from chatcore.ops.files import write_private
from chatcore.ops.nginx import start_nginx
from chatcore.ops.postgres import Postgres, postgres_home
from chatcore.ops.processes import stop_pid, wait_started
from chatcore.ops.replicas import Replica, prepare_shared_state, start_replica


@dataclass
class ClusterState:
    url: str
    database_url: str
    kv_disk_dir: str
    replicas: list[Replica]
    nginx_pid: int
    nginx_prefix: str
    postgres: dict[str, object] | None = None
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)

    def to_json(self) -> str:
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "procs"}
        data["replicas"] = [asdict(r) for r in self.replicas]
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ClusterState:
        data = json.loads(text)
        data["replicas"] = [Replica(**r) for r in data["replicas"]]
        return cls(**data)


def state_path(data_dir: Path) -> Path:
    return data_dir / "cluster" / "cluster.json"


@dataclass
class _Started:
    """What `cluster_up` has started so far, to stop again when a later part fails."""

    pg: Postgres | None
    replicas: list[Replica] = field(default_factory=list)
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    nginx: subprocess.Popen[bytes] | None = None

    def start_replicas(self, count: int, ports: list[int], base: Path, database_url: str, kv_dir: Path,
                       env: dict[str, str], startup_timeout_s: float) -> None:
        """Start `count` replicas at once, then wait until each answers its health URL."""
        for i in range(count):
            replica, proc = start_replica(f"replica-{i + 1}", ports[i], base / f"replica-{i + 1}", database_url,
                                          kv_dir, env)
            self.replicas.append(replica)
            self.procs[replica.pid] = proc
        for replica in self.replicas:
            wait_started(replica.id, replica.url + "/healthz", self.procs[replica.pid], Path(replica.log),
                         startup_timeout_s)

    def start_nginx(self, prefix: Path, port: int) -> subprocess.Popen[bytes]:
        self.nginx = start_nginx(prefix, port, [f"127.0.0.1:{r.port}" for r in self.replicas])
        self.procs[self.nginx.pid] = self.nginx
        return self.nginx

    def stop(self) -> None:
        if self.nginx is not None:
            stop_pid(self.nginx.pid, signal.SIGTERM, timeout_s=10, expect="nginx")
        for replica in self.replicas:
            stop_pid(replica.pid, signal.SIGKILL, expect="chatcore")
        if self.pg is not None:
            self.pg.stop()


def cluster_up(settings: Settings, replicas: int, *, port: int, postgres: bool = False,
               replica_ports: list[int] | None = None, env: dict[str, str] | None = None,
               startup_timeout_s: float = 300.0, throwaway_postgres_dir: Path | None = None) -> ClusterState:
    """Start PostgreSQL (if asked), `replicas` replicas and nginx; write and return the state.
    The replicas get the cluster's cache directory, where the model was prepared, and `env`."""
    base = settings.data_dir / "cluster"
    if state_path(settings.data_dir).exists():
        raise ClusterError(f"a cluster is already recorded in {state_path(settings.data_dir)}; run `cluster down`")
    base.mkdir(parents=True, exist_ok=True)
    pg: Postgres | None = None
    if postgres:
        home = throwaway_postgres_dir or postgres_home(settings.data_dir)
        pg = Postgres.create(home, throwaway=throwaway_postgres_dir is not None)
    database_url = pg.url() if pg is not None else settings.resolved_database_url
    started = _Started(pg)
    kv_dir = settings.resolved_kv_disk_dir
    try:
        prepare_shared_state(settings, database_url)
        started.start_replicas(replicas, replica_ports or [port + 1 + i for i in range(replicas)], base,
                               database_url, kv_dir, {"CHATCORE_CACHE_DIR": str(settings.cache_dir), **(env or {})},
                               startup_timeout_s)
        nginx = started.start_nginx(base / "nginx", port)
        state = ClusterState(f"http://127.0.0.1:{port}", database_url, str(kv_dir), started.replicas, nginx.pid,
                             str(base / "nginx"),
                             {"root": str(pg.root), "port": pg.port, "bin_dir": str(pg.bin_dir)} if pg else None,
                             started.procs)
        write_private(state_path(settings.data_dir), state.to_json())  # its database URL has the password
    except BaseException:
        started.stop()
        raise
    return state


def cluster_down(settings: Settings) -> ClusterState | None:
    """Stop what `cluster up` recorded: nginx, the replicas (SIGTERM: they release their
    leases), then PostgreSQL. Returns the state it stopped, or None when nothing was recorded."""
    path = state_path(settings.data_dir)
    if not path.exists():
        return None
    state = ClusterState.from_json(path.read_text())
    stop_pid(state.nginx_pid, signal.SIGQUIT, expect="nginx")
    for replica in state.replicas:
        stop_pid(replica.pid, signal.SIGTERM, timeout_s=30, expect="chatcore")
    if state.postgres is not None:
        pg = state.postgres
        Postgres(Path(str(pg["root"])), int(str(pg["port"])), Path(str(pg["bin_dir"]))).stop()
    path.unlink()
    return state
