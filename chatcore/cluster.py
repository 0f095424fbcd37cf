"""`chatcore cluster up|down`: PostgreSQL (if asked), N replicas and nginx, on loopback, for local use.

Nothing here is a router or a database of our own: it starts Debian's PostgreSQL and nginx
binaries and `chatcore serve` processes, and writes what it started (pids, ports, paths) to
`<data dir>/cluster/cluster.json` so that `cluster down` can stop exactly those processes.

Layout under `<data dir>/cluster/`: `cluster.json`; `nginx/` (the conf rendered from
`deploy/nginx.conf`, its logs and pid); `replica-<i>/` (each replica's data dir and log);
`postgres/` (the PostgreSQL cluster, when `--postgres`; see `postgres_home` for root).
Every replica shares the database and the disk tier (`CHATCORE_KV_DISK_DIR`, by default
`<data dir>/kv`).

A part that fails to start (PostgreSQL, a replica, nginx) raises `ClusterError` with its exit
code and the tail of its log; `chatcore cluster up` prints that and exits 1, without a traceback.

The same helpers start the throw-away PostgreSQL and nginx of the tests.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from chatcore.config import Settings
from chatcore.resources import NGINX_TEMPLATE

PG_USER = "chatcore"
PG_OS_USER = "postgres"  # PostgreSQL refuses to run as root; when we are root, it runs as this user
LOG_TAIL_LINES = 40


class ClusterError(RuntimeError):
    """A part of the cluster could not be set up or started; the message says which and why."""


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def write_private(path: Path, text: str, owner: tuple[int, int] | None = None) -> None:
    """Replace `path` with a new file holding `text`, readable by its owner only (0600), given to
    `owner` (uid, gid) when one is named.

    The file is created under a fresh name in `path`'s folder (mkstemp: O_CREAT|O_EXCL|O_NOFOLLOW,
    mode 0600, whatever the umask), given away with `fchown` on its descriptor, and renamed over
    `path`: a symbolic or hard link planted at `path` is replaced, never followed or written through."""
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            if owner is not None:
                os.fchown(out.fileno(), *owner)
            out.write(text)
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise


def read_no_link(path: Path) -> str:
    """`path`'s text, refusing a symbolic link in its place (O_NOFOLLOW): run as root, chatcore must
    not read a file someone else pointed it at. FileNotFoundError when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ClusterError(f"{path} is a symbolic link, which chatcore does not follow: someone else may have "
                               f"made it; remove it and run again") from None
        raise
    with os.fdopen(fd) as src:
        return src.read()


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


def wait_started(what: str, url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """`wait_http` for a process we started; when it exits first, or never answers, a
    `ClusterError` with its exit code and the tail of `log`."""
    try:
        wait_http(url, timeout_s, alive=lambda: proc.poll() is None)
    except (RuntimeError, TimeoutError):
        code = proc.poll()
        how = f"exited with code {code}" if code is not None else f"did not answer {url} within {timeout_s:.0f} s"
        raise ClusterError(f"{what} {how}; the last {LOG_TAIL_LINES} lines of {log}:\n{log_tail(log)}") from None


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


def _pg_os_owner() -> tuple[int, int] | None:
    """(uid, gid) of PostgreSQL's OS user when we are root (what we give its files to), else None."""
    if os.geteuid() != 0:
        return None
    user = pwd.getpwnam(PG_OS_USER)
    return user.pw_uid, user.pw_gid


def _give_to_pg_os_user(path: Path) -> None:
    """chown `path` to PostgreSQL's OS user when we are root, through a descriptor opened without
    following a link (`fchown`), so a link planted at `path` gives nothing away."""
    owner = _pg_os_owner()
    if owner is not None:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fchown(fd, *owner)
        finally:
            os.close(fd)


def make_private_folder(root: Path) -> None:
    """Create `root` (mode 0700), or accept an existing one only where it is safe to write into.

    Run as root, `root` is in /var/tmp (`postgres_home`), where anyone can make it first, with a
    link inside pointing at a file of root's: `password` written through it would hand that file
    to PostgreSQL's user. So an existing `root` must be a real folder (lstat: not a link), owned by
    us or by PostgreSQL's OS user, and writable by no one else (no group or other write bit);
    otherwise a `ClusterError` says why, before anything is written or given away."""
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(root, 0o700)
        return
    except FileExistsError:
        pass
    info = os.lstat(root)
    owners = {os.geteuid()} | {owner[0] for owner in [_pg_os_owner()] if owner is not None}
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a folder (a symbolic link or a file)"
    elif info.st_uid not in owners:
        problem = f"is owned by uid {info.st_uid}, not by {' or '.join(str(uid) for uid in sorted(owners))}"
    elif info.st_mode & 0o022:
        problem = f"is writable by others than its owner (mode {stat.S_IMODE(info.st_mode):o})"
    else:
        return
    raise ClusterError(f"{root} {problem}: someone else may have made it, and chatcore will not use it; "
                       f"remove it and run again")


def _run(what: str, cmd: list[str], stdin: str | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run one of PostgreSQL's tools; its failure is a `ClusterError` with its exit code and output."""
    result = subprocess.run(cmd, check=False, input=stdin, env=env, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        output = "\n".join((result.stdout + result.stderr).splitlines()[-LOG_TAIL_LINES:])
        raise ClusterError(f"{what} exited with code {result.returncode}:\n{output}")
    return result


def postgres_home(data_dir: Path) -> Path:
    """Where `cluster up --postgres` keeps its PostgreSQL cluster. As root, PostgreSQL runs as
    the `postgres` user, which cannot enter root's home: the cluster then lives in /var/tmp, at a
    name anyone can predict, which `make_private_folder` checks before using it."""
    if os.geteuid() != 0:
        return data_dir / "cluster" / "postgres"
    digest = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]
    return Path("/var/tmp") / f"chatcore-pg-{digest}"


# A pg_hba.conf rule (not a comment) whose method is `trust`: what `initdb -A trust` wrote.
TRUST_RULE = re.compile(r"^(\s*[^#\s].*\s)trust(\s*)$", re.MULTILINE)


@dataclass
class Postgres:
    """A PostgreSQL cluster of our own in `root`, listening on 127.0.0.1:`port` only (and on a
    socket in `root`). The `chatcore` role signs in with scram-sha-256 on both: no connection
    gets in without the password, which is generated at initdb and kept in `root/password`
    (mode 0600; owned by PostgreSQL's OS user when we are root, since initdb reads it). Every
    URL and psql call here carries it."""

    root: Path
    port: int
    bin_dir: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def password_file(self) -> Path:
        return self.root / "password"

    @property
    def password(self) -> str:
        try:
            return read_no_link(self.password_file).strip()
        except FileNotFoundError:
            raise ClusterError(f"the PostgreSQL cluster in {self.root} has lost its password file "
                               f"{self.password_file}") from None

    def url(self, database: str = "chatcore") -> str:
        password = urllib.parse.quote(self.password, safe="")
        return f"postgresql+asyncpg://{PG_USER}:{password}@127.0.0.1:{self.port}/{database}"

    @classmethod
    def create(cls, root: Path, port: int | None = None, *, throwaway: bool = False) -> Postgres:
        """initdb (if `root` holds no cluster yet) and start; `throwaway` turns durability off.
        A cluster an older chatcore made with trust authentication is moved to the password."""
        bin_dir = pg_bin_dir()
        if bin_dir is None:
            raise ClusterError("PostgreSQL is not installed: apt-get install postgresql (or `make services`)")
        pg = cls(root, port or free_port(), bin_dir)
        make_private_folder(root)
        _give_to_pg_os_user(root)
        if not (pg.data / "PG_VERSION").exists():
            pg.initdb(throwaway=throwaway)
        pg.start(throwaway=throwaway)
        try:
            if pg.trusts():
                pg.require_password()
            pg.create_database("chatcore")
        except BaseException:
            pg.stop()
            raise
        return pg

    def initdb(self, *, throwaway: bool) -> None:
        self._write_password_file()
        cmd = [str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", PG_USER, "-A", "scram-sha-256",
               f"--pwfile={self.password_file}", "-E", "UTF8", "--locale=C", "--no-instructions"]
        _run("initdb", _as_pg_os_user(cmd + (["--no-sync"] if throwaway else [])))

    def _write_password_file(self) -> None:
        """A new password, or the one an interrupted initdb or `require_password` already chose."""
        try:
            old = read_no_link(self.password_file).strip()
        except FileNotFoundError:
            old = ""
        write_private(self.password_file, (old or secrets.token_urlsafe(32)) + "\n", _pg_os_owner())

    def trusts(self) -> bool:
        """Whether pg_hba.conf lets connections in without a password."""
        return TRUST_RULE.search(read_no_link(self.data / "pg_hba.conf")) is not None

    def require_password(self) -> None:
        """Move a running cluster initdb'ed with `-A trust` to scram-sha-256: set the role's
        password (over trust, one last time), then rewrite pg_hba.conf and reload. Each step can
        be repeated, so a run interrupted between them is finished by the next."""
        self._write_password_file()
        quoted = self.password.replace("'", "''")
        # Before PostgreSQL 14 the default hash is md5, which a scram-sha-256 rule refuses.
        self._psql("postgres", f"SET password_encryption = 'scram-sha-256'; ALTER ROLE {PG_USER} PASSWORD '{quoted}'")
        hba = self.data / "pg_hba.conf"
        write_private(hba, TRUST_RULE.sub(r"\1scram-sha-256\2", read_no_link(hba)), _pg_os_owner())
        self._psql("postgres", "SELECT pg_reload_conf()")

    def start(self, *, throwaway: bool = False) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c max_connections=200"
        if throwaway:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        log = self.root / "postgres.log"
        cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(log), "-o", options, "-w", "-t", "60",
               "start"]
        result = subprocess.run(_as_pg_os_user(cmd), capture_output=True, text=True, timeout=90)
        if result.returncode != 0:
            raise ClusterError(f"PostgreSQL (pg_ctl start) exited with code {result.returncode}: "
                               f"{result.stderr.strip()}; the last {LOG_TAIL_LINES} lines of {log}:\n{log_tail(log)}")

    def stop(self) -> None:
        cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"]
        subprocess.run(_as_pg_os_user(cmd), capture_output=True, timeout=90)

    def _psql(self, database: str, sql: str) -> str:
        """`sql` as the `chatcore` role over TCP; on stdin, and the password in the environment,
        so that neither shows on a command line."""
        cmd = [str(self.bin_dir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", PG_USER, "-d", database,
               "-w", "-tA", "-v", "ON_ERROR_STOP=1"]
        return _run("psql", cmd, sql, env={**os.environ, "PGPASSWORD": self.password}).stdout.strip()

    def create_database(self, name: str) -> str:
        """Create database `name` if missing; returns its URL."""
        if self._psql("postgres", f"SELECT 1 FROM pg_database WHERE datname = '{name}'") != "1":
            self._psql("postgres", f'CREATE DATABASE "{name}"')
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
        raise ClusterError("nginx is not installed: apt-get install nginx (or `make services`)")
    (prefix / "tmp").mkdir(parents=True, exist_ok=True)
    conf = prefix / "nginx.conf"
    conf.write_text(render_nginx_conf(prefix, f"127.0.0.1:{port}", upstreams))
    base = [binary, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)]
    check = subprocess.run([*base, "-t"], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise ClusterError(f"nginx rejected {conf}:\n{check.stderr}")
    with (prefix / "stderr.log").open("ab") as log:
        proc = subprocess.Popen([*base, "-g", "daemon off;"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_started("nginx", f"http://127.0.0.1:{port}/healthz", proc, prefix / "error.log", 60)
    except ClusterError:
        proc.kill()
        proc.wait()
        raise
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
        database_url = pg.url()
    else:
        database_url = settings.resolved_database_url
    ports = replica_ports or [port + 1 + i for i in range(replicas)]
    started: list[Replica] = []
    procs: dict[int, subprocess.Popen[bytes]] = {}
    kv_dir = settings.resolved_kv_disk_dir
    nginx: subprocess.Popen[bytes] | None = None
    replica_env = {"CHATCORE_CACHE_DIR": str(settings.cache_dir), **(env or {})}
    try:
        prepare_shared_state(settings, database_url)
        for i in range(replicas):
            replica, proc = start_replica(f"replica-{i + 1}", ports[i], base / f"replica-{i + 1}", database_url,
                                          kv_dir, replica_env)
            started.append(replica)
            procs[replica.pid] = proc
        for replica in started:
            wait_started(replica.id, replica.url + "/healthz", procs[replica.pid], Path(replica.log),
                         startup_timeout_s)
        nginx = start_nginx(base / "nginx", port, [f"127.0.0.1:{r.port}" for r in started])
        procs[nginx.pid] = nginx
        state = ClusterState(f"http://127.0.0.1:{port}", database_url, str(kv_dir), started, nginx.pid,
                             str(base / "nginx"),
                             {"root": str(pg.root), "port": pg.port, "bin_dir": str(pg.bin_dir)} if pg else None,
                             procs)
        write_private(state_path(settings.data_dir), state.to_json())  # its database URL has the password
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
    from chatcore.store.commands import masked_url

    action = getattr(args, "cluster_command")
    if action == "down":
        state = cluster_down(settings)
        print("no cluster recorded" if state is None else f"stopped nginx, {len(state.replicas)} replicas"
              + (" and PostgreSQL" if state.postgres else ""))
        return 0
    try:
        state = cluster_up(settings, getattr(args, "replicas"), port=settings.port,
                           postgres=getattr(args, "postgres"))
    except ClusterError as exc:
        print(f"chatcore cluster up: {exc}", file=sys.stderr)
        return 1
    for replica in state.replicas:
        print(f"{replica.id}: {replica.url} (pid {replica.pid}, log {replica.log})")
    print(f"database: {masked_url(state.database_url)}\ndisk tier: {state.kv_disk_dir}")
    print(f"chatcore cluster listening on {state.url}")
    return 0
