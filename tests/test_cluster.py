"""Replicas behind nginx, for real: a throw-away PostgreSQL, Debian's nginx and three `chatcore serve`
processes on loopback, started by `chatcore.ops.cluster.cluster_up` (what `chatcore cluster up` runs).

What is checked: new sessions spread over the replicas and then stick to the one that made them
(WebSocket, OpenAI route and sessions REST alike); a session's second turn hits the prefix cache
of its replica; a replica never serves a session another replica owns (`conflict`); and when a
replica is SIGKILLed, its sessions resume on the others with every completed turn, the turn in
flight ending `disconnected`, and their history's KV read from the shared disk tier.

And how it starts: its PostgreSQL lets no connection in without the generated password (a cluster
an older chatcore made with trust authentication is moved to it); the database and the local
tenant are ready before any replica starts; a part that fails to start is reported with its exit
code and the tail of its log, on the command line without a traceback.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.pool import NullPool

import chatcore.ops.cluster
import chatcore.ops.postgres
from chatcore.config import Settings
from chatcore.ops.cluster import ClusterState, cluster_down, cluster_up, state_path
from chatcore.ops.errors import LOG_TAIL_LINES, ClusterError
from chatcore.ops.files import write_private
from chatcore.ops.nginx import nginx_binary, start_nginx
from chatcore.ops.postgres import Postgres, pg_bin_dir, postgres_home
from chatcore.ops.processes import free_port
from chatcore.ops.replicas import Replica
from chatcore.server.services import LOCAL_TENANT
from chatcore.store.db import create_sessionmaker
from chatcore.store.models import ChatSession, KvBlock, SessionChain, Tenant
from chatcore.store.packing import unpack_hashes, unpack_ids
from tests.pg_helpers import fresh_database_url
from tests.server_helpers import recv_until

pytestmark = pytest.mark.skipif(pg_bin_dir() is None or nginx_binary() is None,
                                reason="needs PostgreSQL and nginx (make services)")
LEASE_S = 3.0
SHORT = {"temperature": 0, "max_tokens": 12}
LONG = {"temperature": 0, "max_tokens": 2000, "ignore_eos": True}  # runs until cancelled or killed, on any CPU
QUESTIONS = ["Name three colours of the rainbow.", "Which of them is the warmest?"]
NAMES = ["Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald"]
COUNTING = "Continue the sequence forever: 1, 2, 3, 4, 5,"  # a long greedy answer: a turn that keeps running


# ----- the cluster -------------------------------------------------------------------------------
class Cluster:
    def __init__(self, state: ClusterState, settings: Settings) -> None:
        self.state = state
        self.settings = settings
        self.db = create_async_engine(state.database_url, poolclass=NullPool)  # any event loop may use it
        self.sessionmaker = create_sessionmaker(self.db)
        self.by_port = {r.port: r.id for r in state.replicas}
        self.killed: set[str] = set()

    @property
    def ws_url(self) -> str:
        return self.state.url.replace("http://", "ws://") + "/v1/ws"

    def replica(self, replica_id: str):  # type: ignore[no-untyped-def]
        return next(r for r in self.state.replicas if r.id == replica_id)

    def served_by(self, upstream: str | None) -> str:
        """The replica that answered, from nginx's `X-Chatcore-Upstream` (the last address tried)."""
        assert upstream, "nginx did not say which replica answered"
        return self.by_port[int(upstream.split(",")[-1].strip().rsplit(":", 1)[1])]

    def http(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
             base: str | None = None) -> tuple[int, Any, str | None]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request((base or self.state.url) + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                raw, status, upstream = resp.read(), resp.status, resp.headers.get("X-Chatcore-Upstream")
        except urllib.error.HTTPError as err:
            raw, status, upstream = err.read(), err.code, err.headers.get("X-Chatcore-Upstream")
        return status, json.loads(raw) if raw else None, upstream

    def connect(self, session_id: str | None = None, url: str | None = None) -> Any:
        query = f"?session_id={session_id}" if session_id else ""
        return websockets.connect((url or self.ws_url) + query, max_size=None, open_timeout=30)

    async def owner(self, session_id: str) -> str | None:
        async with self.sessionmaker() as db:
            return await db.scalar(select(ChatSession.owner_replica).where(ChatSession.id == session_id))

    async def on_disk(self, session_id: str) -> tuple[int, int]:
        """(full blocks of the session's history whose KV was computed, how many of those the
        disk tier has indexed). The last answer token and the end-of-turn tokens (`<|im_end|>`,
        `\\n`) close the history without their KV having been computed."""
        async with self.sessionmaker() as db:
            chain = await db.get(SessionChain, session_id)
            if chain is None:
                return 0, 0
            computed = (len(unpack_ids(chain.token_ids)) - 3) // chain.block_size
            hashes = [h.hex() for h in unpack_hashes(chain.block_hashes)][:computed]
            indexed = set(await db.scalars(select(KvBlock.hash).where(KvBlock.hash.in_(hashes)))) if hashes else set()
        return len(hashes), len(indexed)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path):  # type: ignore[no-untyped-def]
    data = tmp_path_factory.mktemp("cluster") / "data"
    settings = Settings(data_dir=data)
    pg_dir = Path(tempfile.mkdtemp(prefix="chatcore-pg-"))  # PostgreSQL's user must be able to enter it
    env = {"CHATCORE_KV_CACHE_GB": "0.1", "CHATCORE_KV_DISK_GB": "1", "CHATCORE_LEASE_S": str(LEASE_S),
           "CHATCORE_THREADS": "1", "CHATCORE_HOT_WINDOW_S": "120", "CHATCORE_MAX_TOKENS_LIMIT": "2048"}
    started = time.monotonic()
    state = cluster_up(settings, 3, port=free_port(), postgres=True, replica_ports=[free_port() for _ in range(3)],
                       env=env, throwaway_postgres_dir=pg_dir)
    print(f"\ncluster of 3 replicas up in {time.monotonic() - started:.1f} s")
    c = Cluster(state, settings)
    try:
        yield c
    finally:
        asyncio.run(c.db.dispose())
        cluster_down(settings)
        shutil.rmtree(pg_dir, ignore_errors=True)


async def _hello(ws: Any, session_id: str | None = None, token: str | None = None,
                 last_seq: int | None = None) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "hello", "session_id": session_id, "resume_token": token,
                              "last_seq": last_seq}))
    return json.loads(await asyncio.wait_for(ws.recv(), 60))


async def _turn(ws: Any, content: str, client_id: str, params: dict[str, Any] = SHORT) -> dict[str, Any]:
    await ws.send(json.dumps({"type": "user", "id": client_id, "content": content, "params": params}))
    frames = await recv_until(ws, "done")
    errors = [f for f in frames if f["type"] == "error"]
    assert not errors, errors
    return frames[-1]


def _upstream(ws: Any) -> str | None:
    return ws.response.headers.get("X-Chatcore-Upstream")


async def _until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)  # polling a condition with a deadline


# ----- the tests -------------------------------------------------------------------------------
@pytest.mark.model
def test_new_sessions_spread_then_stick(cluster: Cluster) -> None:
    """POST /v1/sessions has no session yet: nginx spreads them. Every later request naming the
    session, in the path, in X-Session-Id or in ?session_id=, reaches the replica that made it."""
    made: dict[str, str] = {}
    for _ in range(60):
        status, body, upstream = cluster.http("POST", "/v1/sessions", {"title": "spread"})
        assert status == 201, body
        made[body["id"]] = cluster.served_by(upstream)
    spread = Counter(made.values())
    print(f"60 new sessions per replica: {dict(spread)}")
    assert set(spread) == {r.id for r in cluster.state.replicas}
    assert min(spread.values()) >= 6, spread  # 20 each on average
    for sid, replica in made.items():
        assert asyncio.run(cluster.owner(sid)) == replica
        status, _, upstream = cluster.http("GET", f"/v1/sessions/{sid}")
        assert status == 200 and cluster.served_by(upstream) == replica
        status, _, upstream = cluster.http("GET", f"/healthz?session_id={sid}")
        assert status == 200 and cluster.served_by(upstream) == replica
    for sid, replica in list(made.items())[:5]:
        status, body, upstream = cluster.http("POST", "/v1/chat/completions",
                                              {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                               "temperature": 0}, headers={"X-Session-Id": sid})
        assert status == 200, body
        assert cluster.served_by(upstream) == replica
    for sid, replica in made.items():
        status, _, upstream = cluster.http("DELETE", f"/v1/sessions/{sid}")
        assert status == 204 and cluster.served_by(upstream) == replica


@pytest.mark.model
async def test_affinity_prefix_hits_and_single_owner(cluster: Cluster) -> None:
    """A WebSocket session keeps reaching its replica across reconnects, its second turn reuses
    the first's KV there, and another replica asked directly refuses it with `conflict`."""
    sessions = []
    for i in range(3):
        async with cluster.connect() as ws:
            hello = await _hello(ws)
            replica = cluster.served_by(_upstream(ws))
            first = await _turn(ws, QUESTIONS[0], "q0")
        assert await cluster.owner(hello["session_id"]) == replica
        sessions.append((hello, replica, first))
    for hello, replica, first in sessions:
        async with cluster.connect(hello["session_id"]) as ws:
            resumed = await _hello(ws, hello["session_id"], hello["resume_token"])
            assert cluster.served_by(_upstream(ws)) == replica
            assert [m["role"] for m in resumed["history"]] == ["user", "assistant"]
            second = await _turn(ws, QUESTIONS[1], "q1")
        history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
        assert second["usage"]["cached_device_tokens"] >= (history - 1) // 16 * 16, second["usage"]
        assert second["usage"]["cached_disk_tokens"] == 0
        assert await cluster.owner(hello["session_id"]) == replica

    # While a turn runs on its owner, another replica asked directly (past nginx) says conflict.
    async with cluster.connect() as ws:
        hello = await _hello(ws)
        owner = cluster.served_by(_upstream(ws))
        await ws.send(json.dumps({"type": "user", "id": "long", "content": COUNTING, "params": LONG}))
        await recv_until(ws, "token")
        other = next(r for r in cluster.state.replicas if r.id != owner)
        direct = other.url.replace("http://", "ws://") + "/v1/ws"
        async with cluster.connect(hello["session_id"], url=direct) as intruder:
            answer = await _hello(intruder, hello["session_id"], hello["resume_token"])
            assert answer["type"] == "error" and answer["code"] == "conflict", answer
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(intruder.recv(), 30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4409
        status, body, _ = cluster.http("POST", "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
                                       headers={"X-Session-Id": hello["session_id"]}, base=other.url)
        assert status == 409 and body["error"]["code"] == "conflict", body
        assert await cluster.owner(hello["session_id"]) == owner
        await ws.send(json.dumps({"type": "cancel"}))
        done = (await recv_until(ws, "done"))[-1]
        assert done["finish_reason"] == "cancelled"  # it ran all along


@pytest.mark.model
async def test_failover_resumes_from_the_shared_disk_tier(cluster: Cluster) -> None:
    """SIGKILL the replica owning the most sessions: each of its sessions resumes on another
    replica with every completed turn, the interrupted one ends `disconnected`, and the history's
    KV comes from the shared disk tier, not from recomputation."""
    sessions: dict[str, dict[str, Any]] = {}
    for name in NAMES:
        # A history of its own (past the default system prompt, which every replica's pool has).
        questions = [f"My name is {name}. {QUESTIONS[0]}", QUESTIONS[1]]
        async with cluster.connect() as ws:
            hello = await _hello(ws)
            sid = hello["session_id"]
            replica = cluster.served_by(_upstream(ws))
            dones = [await _turn(ws, q, f"q{n}") for n, q in enumerate(questions)]
        sessions[sid] = {"hello": hello, "replica": replica, "dones": dones}
    victim = Counter(s["replica"] for s in sessions.values()).most_common(1)[0][0]
    moved = [sid for sid, s in sessions.items() if s["replica"] == victim]
    stayed = [sid for sid in sessions if sid not in moved]

    async def all_on_disk() -> bool:
        counts = [await cluster.on_disk(sid) for sid in moved]
        return all(blocks > 0 and indexed == blocks for blocks, indexed in counts)

    await _until(all_on_disk, 60, "the disk tier to index the victim's sessions")

    # A turn is running on the victim when it dies.
    flying = moved[0]
    hello = sessions[flying]["hello"]
    ws = await cluster.connect(flying)
    await _hello(ws, flying, hello["resume_token"])
    await ws.send(json.dumps({"type": "user", "id": "story", "content": COUNTING, "params": LONG}))
    frames = await recv_until(ws, "token")
    last_seq = max(f["seq"] for f in frames if "seq" in f)
    os.kill(cluster.replica(victim).pid, signal.SIGKILL)
    cluster.killed.add(victim)
    with pytest.raises(websockets.ConnectionClosed):
        async with asyncio.timeout(30):
            while True:
                await ws.recv()

    resumed_ttft = []
    for sid in moved:
        s = sessions[sid]
        started = time.monotonic()
        async with cluster.connect(sid) as ws:
            back = await _hello(ws, sid, s["hello"]["resume_token"], last_seq if sid == flying else None)
            reconnect_s = time.monotonic() - started
            assert back["type"] == "session", back
            new_owner = cluster.served_by(_upstream(ws))
            assert new_owner != victim
            answers = [m["content"] for m in back["history"] if m["role"] == "assistant"]
            assert len(answers) == 2 and all(answers), back["history"]  # no completed turn lost
            if sid == flying:
                done = json.loads(await asyncio.wait_for(ws.recv(), 30))
                assert done["type"] == "done" and done["finish_reason"] == "disconnected", done
                assert done["seq"] > last_seq
            third = await _turn(ws, "Answer in one word: which colour is the sky?", "q-after")
        usage = s["dones"][-1]["usage"]
        history = usage["prompt_tokens"] + usage["completion_tokens"]
        got = third["usage"]
        assert got["cached_disk_tokens"] > 0, got
        assert got["cached_tokens"] >= (history - 1) // 16 * 16, (got, history)
        assert await cluster.owner(sid) == new_owner
        resumed_ttft.append((got["cached_disk_tokens"], got["recomputed_tokens"], third["timing"]["ttft_ms"]))
        print(f"session {sid[:8]} moved {victim} -> {new_owner} (hello after {reconnect_s:.2f} s): "
              f"prompt {got['prompt_tokens']}, from disk {got['cached_disk_tokens']}, "
              f"from the pool {got['cached_device_tokens']}, recomputed {got['recomputed_tokens']}, "
              f"TTFT {third['timing']['ttft_ms']:.0f} ms")
    status, detail, _ = cluster.http("GET", f"/v1/sessions/{flying}")
    assert status == 200 and detail["history"][5]["finish_reason"] == "interrupted"

    # The survivors' own sessions did not move, and still hit their replica's pool.
    for sid in stayed:
        s = sessions[sid]
        async with cluster.connect(sid) as ws:
            await _hello(ws, sid, s["hello"]["resume_token"])
            assert cluster.served_by(_upstream(ws)) == s["replica"]
            third = await _turn(ws, "And the coldest?", "q-after")
        assert third["usage"]["cached_device_tokens"] > 0
        assert await cluster.owner(sid) == s["replica"]
    print(f"failover: {len(moved)} session(s) moved off {victim}, 0 completed turns lost, "
          f"{len(stayed)} stayed put")


# ----- starting, and failing to start ------------------------------------------------------------
@pytest.fixture
def pg_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="chatcore-pg-"))  # PostgreSQL's user must be able to enter it
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _psql_without_password(pg: Postgres, host: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}  # no PGPASSWORD, no PGPASSFILE
    cmd = [str(pg.bin_dir / "psql"), "-h", host, "-p", str(pg.port), "-U", "chatcore", "-d", "chatcore", "-w",
           "-tAc", "SELECT 1"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=30, check=False)


async def _select_one(url: str) -> int:
    db = create_async_engine(url, poolclass=NullPool)
    try:
        async with db.connect() as conn:
            return (await conn.execute(text("SELECT 1"))).scalar_one()
    finally:
        await db.dispose()


def _assert_only_the_password_gets_in(pg: Postgres) -> None:
    assert stat.S_IMODE(pg.password_file.stat().st_mode) == 0o600
    for host in ("127.0.0.1", str(pg.root)):  # TCP, and the Unix socket in the cluster's root
        refused = _psql_without_password(pg, host)
        assert refused.returncode != 0 and "password" in refused.stderr, (host, refused)
    assert asyncio.run(_select_one(pg.url())) == 1


def test_its_postgres_lets_no_one_in_without_the_password(pg_root: Path) -> None:
    pg = Postgres.create(pg_root, throwaway=True)
    try:
        _assert_only_the_password_gets_in(pg)
        assert len(pg.password) >= 32
    finally:
        pg.stop()


def test_a_trust_cluster_of_an_older_chatcore_is_moved_to_a_password(pg_root: Path) -> None:
    """initdb -A trust, as `cluster up` did before; the password file of an interrupted earlier
    move (left world-readable, and with characters that SQL and a URL must escape) is kept."""
    bin_dir = pg_bin_dir()
    assert bin_dir is not None
    chatcore.ops.postgres._give_to_pg_os_user(pg_root)
    initdb = [str(bin_dir / "initdb"), "-D", str(pg_root / "data"), "-U", "chatcore", "-A", "trust", "--no-sync"]
    subprocess.run(chatcore.ops.postgres._as_pg_os_user(initdb), capture_output=True, check=True, timeout=120)
    assert Postgres(pg_root, 0, bin_dir).trusts()
    (pg_root / "password").write_text("p@ss:w/rd%'?#\n")
    os.chmod(pg_root / "password", 0o644)
    pg = Postgres.create(pg_root, throwaway=True)
    try:
        assert not pg.trusts() and pg.password == "p@ss:w/rd%'?#"
        _assert_only_the_password_gets_in(pg)
    finally:
        pg.stop()


# ----- run as root: a folder in /var/tmp that someone else made first ------------------------------
VICTIM_TEXT = "root's own file, not a password"


@pytest.fixture
def victim(tmp_path: Path) -> Iterator[Path]:
    """A file of the user running the tests (root, in the suite), which an attacker points a link at."""
    path = tmp_path / "victim"
    path.write_text(VICTIM_TEXT)
    path.chmod(0o644)
    yield path


def _assert_untouched(path: Path) -> None:
    info = path.lstat()
    assert (info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)) == (os.geteuid(), os.getegid(), 0o644)
    assert path.read_text() == VICTIM_TEXT


def _plant(home: Path, victim: Path, how: str) -> None:
    """What a local user could leave at `home` before root runs `cluster up --postgres`: their own
    world-writable folder, or a link to one, with `password` a link to the victim."""
    folder = home if how == "folder" else home.with_name(home.name + "-attacker")
    folder.mkdir()
    (folder / "password").symlink_to(victim)
    os.chown(folder, 65534, 65534)  # nobody
    folder.chmod(0o777)
    if how == "link":
        home.symlink_to(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="the attack needs the command to run as root")
@pytest.mark.parametrize("how", ["folder", "link"])
def test_cluster_up_as_root_refuses_a_postgres_folder_someone_else_made(tmp_path: Path, victim: Path,
                                                                          how: str) -> None:
    """`chatcore cluster up --postgres` as root keeps PostgreSQL in /var/tmp/chatcore-pg-<hash>, a
    name anyone can predict. A local user who made it first (or a link there), with `password`
    a link to one of root's files, got that file chowned to postgres, made 0600 and rewritten.
    Now the command refuses the folder, says why, and touches nothing."""
    data = tmp_path / "data"
    home = postgres_home(data)
    _plant(home, victim, how)
    env = {**os.environ, "CHATCORE_DATA_DIR": str(data)}
    try:
        result = subprocess.run([sys.executable, "-m", "chatcore.cli", "cluster", "up", "--postgres", "--replicas",
                                 "1", "--port", str(free_port())], env=env, capture_output=True, text=True,
                                timeout=300, check=False)
        _assert_untouched(victim)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result
        assert result.stderr.startswith(f"chatcore cluster up: {home} "), result.stderr
        assert "someone else may have made it" in result.stderr, result.stderr
        folder = home if how == "folder" else home.with_name(home.name + "-attacker")
        assert folder.lstat().st_uid == 65534 and not (folder / "data").exists()  # not given away, no initdb
        assert not state_path(data).exists()
    finally:
        shutil.rmtree(home.with_name(home.name + "-attacker"), ignore_errors=True)
        home.unlink() if home.is_symlink() else shutil.rmtree(home, ignore_errors=True)


def test_a_link_planted_in_the_postgres_folder_is_not_followed(pg_root: Path, victim: Path) -> None:
    """The same link inside a folder that is ours: `Postgres.create` refuses to read the password
    through it, and neither writes nor gives the victim away."""
    (pg_root / "password").symlink_to(victim)
    with pytest.raises(ClusterError, match="password is a symbolic link, which chatcore does not follow"):
        Postgres.create(pg_root, throwaway=True)
    _assert_untouched(victim)
    assert not (pg_root / "data").exists()


def test_the_password_file_replaces_whatever_was_at_its_name(pg_root: Path, victim: Path) -> None:
    """`write_private` never writes through what is at the path: a hard link to another file is
    replaced by a new 0600 file, and the other file keeps its text and mode."""
    target = pg_root / "password"
    os.link(victim, target)
    write_private(target, "new\n")
    _assert_untouched(victim)
    assert target.read_text() == "new\n" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in pg_root.iterdir()] == ["password"]  # no partial file left


@pytest.mark.model
def test_the_database_and_local_tenant_are_ready_before_any_replica_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
        default_model_dir: Path) -> None:
    """Two replicas starting at once on a fresh database both created the `local` tenant, and one
    exited on its unique name: `cluster up` failed once in six on a fresh database."""
    url = fresh_database_url(request.config, "cluster_up")
    seen: list[list[str]] = []

    async def tenants(database_url: str) -> list[str]:
        db = create_async_engine(database_url, poolclass=NullPool)
        try:
            async with create_sessionmaker(db)() as session:
                return list(await session.scalars(select(Tenant.name)))
        finally:
            await db.dispose()

    def start_replica(replica_id: str, port: int, data_dir: Path, database_url: str, *_: object) -> Replica:
        seen.append(asyncio.run(tenants(database_url)))
        raise ClusterError("stopped before starting a replica")

    monkeypatch.setattr(chatcore.ops.cluster, "start_replica", start_replica)
    with pytest.raises(ClusterError, match="stopped before"):
        cluster_up(Settings(data_dir=tmp_path / "data", database_url=url), 2, port=free_port())
    assert seen == [[LOCAL_TENANT]]


@pytest.mark.model
def test_a_replica_that_exits_at_start_is_reported_with_its_exit_code_and_log(
        tmp_path: Path, default_model_dir: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data")
    with pytest.raises(ClusterError) as failed:
        cluster_up(settings, 2, port=free_port(), replica_ports=[free_port(), free_port()],
                   env={"CHATCORE_BLOCK_SIZE": "banana"}, startup_timeout_s=120)
    message = str(failed.value)
    log = settings.data_dir / "cluster" / "replica-1" / "serve.log"
    assert message.startswith(f"replica-1 exited with code 2; the last {LOG_TAIL_LINES} lines of {log}:"), message
    tail = log.read_text().splitlines()[-LOG_TAIL_LINES:]
    assert message.endswith("\n".join(tail)) and "block_size (environment)" in message, message  # no value: it may be a secret
    assert not state_path(settings.data_dir).exists()


def _port_with_a_busy_next_one() -> tuple[int, socket.socket]:
    """A free port P whose P + 1 (the first replica's) we hold, listening."""
    while True:
        port = free_port()
        blocker = socket.socket()
        try:
            blocker.bind(("127.0.0.1", port + 1))
        except OSError:
            blocker.close()
            continue
        blocker.listen()
        return port, blocker


@pytest.mark.model
def test_cluster_up_says_why_a_replica_died_without_a_traceback(tmp_path: Path, default_model_dir: Path) -> None:
    """The command line, with the first replica's port taken: one message, exit 1."""
    port, blocker = _port_with_a_busy_next_one()
    env = {**os.environ, "CHATCORE_DATA_DIR": str(tmp_path / "data"), "CHATCORE_KV_CACHE_GB": "0.1",
           "CHATCORE_KV_DISK_GB": "0", "CHATCORE_THREADS": "1"}
    with blocker:
        result = subprocess.run([sys.executable, "-m", "chatcore.cli", "cluster", "up", "--replicas", "1", "--port",
                                 str(port)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 1, result
    assert "Traceback" not in result.stderr, result.stderr
    assert re.match(r"chatcore cluster up: replica-1 exited with code [1-9]\d*; the last 40 lines of ",
                    result.stderr), result.stderr
    assert "address already in use" in result.stderr.lower(), result.stderr


def test_nginx_that_cannot_listen_is_reported_with_its_exit_code_and_log(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ClusterError) as failed:
            start_nginx(tmp_path / "nginx", taken.getsockname()[1], ["127.0.0.1:9"])
    message = str(failed.value)
    assert message.startswith(f"nginx exited with code 1; the last {LOG_TAIL_LINES} lines of "), message
    assert "Address already in use" in message


def test_postgres_that_cannot_listen_is_reported_with_its_exit_code_and_log(pg_root: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ClusterError) as failed:
            Postgres.create(pg_root, taken.getsockname()[1], throwaway=True)
    message = str(failed.value)
    assert message.startswith("PostgreSQL (pg_ctl start) exited with code 1"), message
    assert "could not bind" in message and f"lines of {pg_root / 'postgres.log'}" in message, message


def test_nginx_logs_no_query_string(tmp_path: Path) -> None:
    """A query string may carry a key (`?api_key=`): nginx's access log keeps the path only."""

    class Upstream(http.server.BaseHTTPRequestHandler):  # answers 200 to anything, nginx's /healthz first
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    try:
        proc = start_nginx(tmp_path / "nginx", port, [f"127.0.0.1:{upstream.server_address[1]}"])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/sessions?api_key=cc-secret-in-url",
                                        timeout=30) as resp:
                assert resp.status == 200
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    finally:
        upstream.shutdown()
    logged = (tmp_path / "nginx" / "access.log").read_text()
    assert "GET /v1/sessions HTTP/1.1" in logged and "cc-secret-in-url" not in logged
