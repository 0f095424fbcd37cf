"""`chatcore cluster up|down`: PostgreSQL (if asked), N replicas and nginx, on loopback, for local use.

Nothing here is a router or a database of our own: it starts Debian's PostgreSQL and nginx
binaries and `chatcore serve` processes, and writes what it started (pids, ports, paths) to
`<data dir>/cluster/cluster.json` so that `cluster down` can stop exactly those processes.

Layout under `<data dir>/cluster/`: `cluster.json`; `nginx/` (the conf rendered from
`deploy/nginx.conf`, its logs and pid); `replica-<i>/` (each replica's data dir and log);
`postgres/` (the PostgreSQL cluster, when `--postgres`; see `postgres_home` for root).
Every replica shares the database and the disk tier (`CHATCORE_KV_DISK_DIR`, by default
`<data dir>/kv`).

The same helpers start the throw-away PostgreSQL and nginx of the tests.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from chatcore.config import Settings

REPO_ROOT = Path(__file__).resolve().parents[1]
NGINX_TEMPLATE = REPO_ROOT / "deploy" / "nginx.conf"
PG_USER = "chatcore"
PG_OS_USER = "postgres"  # PostgreSQL refuses to run as root; when we are root, it runs as this user


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, alive: object = None) -> None:
    """Poll `url` until it answers 200, with a deadline; `alive()` False aborts early."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if callable(alive) and not alive():
            raise RuntimeError(f"the process behind {url} exited")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)  # polling a port that is not open yet
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


def stop_pid(pid: int, sig: int = signal.SIGTERM, timeout_s: float = 30.0, expect: str = "") -> bool:
    """Signal one process we started (checked against its command line), wait, then SIGKILL."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    if expect and expect not in cmdline:
        return False  # the pid was reused by something else
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)  # waiting for the process to exit, with a deadline
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return True


# ----- PostgreSQL ------------------------------------------------------------------------------
def pg_bin_dir() -> Path | None:
    """The directory of `initdb`, `pg_ctl` and `postgres`: on PATH, else Debian's newest
    /usr/lib/postgresql/<version>/bin; None when PostgreSQL is not installed."""
    found = shutil.which("initdb")
    if found:
        path = Path(found).resolve().parent
        if (path / "pg_ctl").exists() and (path / "postgres").exists():
            return path
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"),
                      key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)
    return versions[-1].parent if versions else None


def _as_pg_os_user(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", PG_OS_USER, "--", *cmd] if os.geteuid() == 0 else cmd


def postgres_home(data_dir: Path) -> Path:
    """Where `cluster up --postgres` keeps its PostgreSQL cluster. As root, PostgreSQL runs as
    the `postgres` user, which cannot enter root's home: the cluster then lives in /var/tmp."""
    if os.geteuid() != 0:
        return data_dir / "cluster" / "postgres"
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]
    return Path("/var/tmp") / f"chatcore-pg-{digest}"


@dataclass
class Postgres:
    """A PostgreSQL cluster of our own in `root`, listening on 127.0.0.1:`port` only, with
    trust authentication for the `chatcore` role (loopback, local use and tests)."""

    root: Path
    port: int
    bin_dir: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "chatcore") -> str:
        return f"postgresql+asyncpg://{PG_USER}@127.0.0.1:{self.port}/{database}"

    @classmethod
    def create(cls, root: Path, port: int | None = None, *, throwaway: bool = False) -> Postgres:
        """initdb (if `root` holds no cluster yet) and start; `throwaway` turns durability off."""
        bin_dir = pg_bin_dir()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL is not installed: apt-get install postgresql (or `make services`)")
        pg = cls(root, port or free_port(), bin_dir)
        root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            user = pwd.getpwnam(PG_OS_USER)
            os.chown(root, user.pw_uid, user.pw_gid)
        if not (pg.data / "PG_VERSION").exists():
            cmd = [str(bin_dir / "initdb"), "-D", str(pg.data), "-U", PG_USER, "-A", "trust", "-E", "UTF8",
                   "--locale=C", "--no-instructions"] + (["--no-sync"] if throwaway else [])
            subprocess.run(_as_pg_os_user(cmd), check=True, capture_output=True, timeout=120)
        pg.start(throwaway=throwaway)
        try:
            pg.create_database("chatcore")
        except BaseException:
            pg.stop()
            raise
        return pg

    def start(self, *, throwaway: bool = False) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c max_connections=200"
        if throwaway:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "postgres.log"),
               "-o", options, "-w", "-t", "60", "start"]
        result = subprocess.run(_as_pg_os_user(cmd), capture_output=True, text=True, timeout=90)
        if result.returncode != 0:
            log = (self.root / "postgres.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"PostgreSQL did not start: {result.stderr}\n{log}")

    def stop(self) -> None:
        cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"]
        subprocess.run(_as_pg_os_user(cmd), capture_output=True, timeout=90)

    def create_database(self, name: str) -> str:
        """Create database `name` if missing; returns its URL."""
        psql = [str(self.bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER, "-d",
                "postgres", "-tAc"]
        exists = subprocess.run([*psql, f"SELECT 1 FROM pg_database WHERE datname = '{name}'"],
                                capture_output=True, text=True, check=True, timeout=30)
        if exists.stdout.strip() != "1":
            subprocess.run([*psql, f'CREATE DATABASE "{name}"'], capture_output=True, check=True, timeout=30)
        return self.url(name)


def throwaway_postgres() -> Postgres:
    """A fresh cluster in a new temporary directory (the tests'); `Postgres.stop` and remove it after."""
    root = Path(tempfile.mkdtemp(prefix="chatcore-pg-"))
    return Postgres.create(root, throwaway=True)


# ----- nginx -----------------------------------------------------------------------------------
def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


def render_nginx_conf(prefix: Path, listen: str, upstreams: list[str], fail_timeout_s: int = 5) -> str:
    """deploy/nginx.conf with its markers replaced."""
    servers = "\n".join(f"        server {u} max_fails=1 fail_timeout={fail_timeout_s}s;" for u in upstreams)
    lines = []
    for line in NGINX_TEMPLATE.read_text().splitlines():
        if not line.lstrip().startswith("#"):  # the header's comments name the markers
            line = line.replace("@PREFIX@", str(prefix)).replace("@LISTEN@", listen)
            line = servers if line.strip() == "@SERVERS@" else line
        lines.append(line)
    return "\n".join(lines) + "\n"


def start_nginx(prefix: Path, port: int, upstreams: list[str]) -> subprocess.Popen[bytes]:
    """nginx in the foreground of its own process group, on 127.0.0.1:`port`; returns once it listens."""
    binary = nginx_binary()
    if binary is None:
        raise RuntimeError("nginx is not installed: apt-get install nginx (or `make services`)")
    (prefix / "tmp").mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(render_nginx_conf(prefix, f"127.0.0.1:{port}", upstreams))
    base = [binary, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)]
    check = subprocess.run([*base, "-t"], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise RuntimeError(f"nginx rejected {conf}:\n{check.stderr}")
    with (prefix / "stderr.log").open("ab") as log:
        proc = subprocess.Popen([*base, "-g", "daemon off;"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/healthz", 60, alive=lambda: proc.poll() is None)
    return proc


# ----- replicas and the whole cluster ------------------------------------------------------------
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


def cluster_up(settings: Settings, replicas: int, *, port: int, postgres: bool = False,
               replica_ports: list[int] | None = None, env: dict[str, str] | None = None,
               startup_timeout_s: float = 300.0, throwaway_postgres_dir: Path | None = None) -> ClusterState:
    """Start PostgreSQL (if asked), `replicas` replicas and nginx; write and return the state."""
    from chatcore.store.db import run_migrations

    base = settings.data_dir / "cluster"
    if state_path(settings.data_dir).exists():
        raise RuntimeError(f"a cluster is already recorded in {state_path(settings.data_dir)}; run `cluster down`")
    base.mkdir(parents=True, exist_ok=True)
    pg: Postgres | None = None
    if postgres:
        home = throwaway_postgres_dir or postgres_home(settings.data_dir)
        pg = Postgres.create(home, throwaway=throwaway_postgres_dir is not None)
        database_url = pg.url()
    else:
        database_url = settings.resolved_database_url
    ports = replica_ports or [port + 1 + i for i in range(replicas)]
    started: list[Replica] = []
    procs: dict[int, subprocess.Popen[bytes]] = {}
    kv_dir = settings.resolved_kv_disk_dir
    nginx: subprocess.Popen[bytes] | None = None
    try:
        run_migrations(database_url)  # once, before the replicas (their own migrate is then a no-op)
        for i in range(replicas):
            replica, proc = start_replica(f"replica-{i + 1}", ports[i], base / f"replica-{i + 1}", database_url,
                                          kv_dir, env)
            started.append(replica)
            procs[replica.pid] = proc
        for replica in started:
            proc = procs[replica.pid]
            wait_http(replica.url + "/healthz", startup_timeout_s, alive=lambda p=proc: p.poll() is None)
        nginx = start_nginx(base / "nginx", port, [f"127.0.0.1:{r.port}" for r in started])
        procs[nginx.pid] = nginx
        state = ClusterState(f"http://127.0.0.1:{port}", database_url, str(kv_dir), started, nginx.pid,
                             str(base / "nginx"),
                             {"root": str(pg.root), "port": pg.port, "bin_dir": str(pg.bin_dir)} if pg else None,
                             procs)
        state_path(settings.data_dir).write_text(state.to_json())
    except BaseException:
        if nginx is not None:
            stop_pid(nginx.pid, signal.SIGTERM, timeout_s=10, expect="nginx")
        for replica in started:
            stop_pid(replica.pid, signal.SIGKILL, expect="chatcore")
        if pg is not None:
            pg.stop()
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


def cluster_command(args: object, settings: Settings) -> int:
    action = getattr(args, "cluster_command")
    if action == "down":
        state = cluster_down(settings)
        print("no cluster recorded" if state is None else f"stopped nginx, {len(state.replicas)} replicas"
              + (" and PostgreSQL" if state.postgres else ""))
        return 0
    state = cluster_up(settings, getattr(args, "replicas"), port=settings.port, postgres=getattr(args, "postgres"))
    for replica in state.replicas:
        print(f"{replica.id}: {replica.url} (pid {replica.pid}, log {replica.log})")
    print(f"database: {state.database_url}\ndisk tier: {state.kv_disk_dir}")
    print(f"chatcore cluster listening on {state.url}")
    return 0
