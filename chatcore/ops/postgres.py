"""A PostgreSQL cluster of our own (`Postgres`), for `chatcore cluster up --postgres` and the tests.

It runs Debian's binaries (`pg_bin_dir`) in a folder of its own (`postgres_home`: under the data
dir, or /var/tmp as root), listening on 127.0.0.1 only, and its `chatcore` role signs in with a
password generated at initdb. As root, PostgreSQL runs as the `postgres` OS user, which is given
exactly the files it needs, through descriptors that follow no link.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from chatcore.ops.errors import LOG_TAIL_LINES, ClusterError, log_tail
from chatcore.ops.files import read_no_link, write_private
from chatcore.ops.processes import free_port

PG_USER = "chatcore"
PG_OS_USER = "postgres"  # PostgreSQL refuses to run as root; when we are root, it runs as this user


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
        result = subprocess.run(_as_pg_os_user(cmd), check=False, capture_output=True, text=True, timeout=90)
        if result.returncode != 0:
            raise ClusterError(f"PostgreSQL (pg_ctl start) exited with code {result.returncode}: "
                               f"{result.stderr.strip()}; the last {LOG_TAIL_LINES} lines of {log}:\n{log_tail(log)}")

    def stop(self) -> None:
        cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", "60", "stop"]
        subprocess.run(_as_pg_os_user(cmd), check=False, capture_output=True, timeout=90)

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
