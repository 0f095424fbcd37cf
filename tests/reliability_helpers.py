"""Shared pieces of the reliability suite (tests/test_reliability_*.py): sizes, a WebSocket chat client
that records every frame, a /healthz probe, metrics and audit readers, and the figures each test prints.

Every test runs against a real `chatcore serve` process on loopback (tests/server_helpers.py). The fast
sizes run in `make test`; the full sizes carry the `stress` marker and run in `make stress`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import statistics
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import websockets

from tests.server_helpers import LiveServer

STRESS = os.environ.get("CHATCORE_STRESS") == "1"
ERROR_CODES = {"bad_request", "unauthorized", "not_found", "too_large", "busy", "conflict", "internal"}
FINISH_REASONS = {"stop", "length", "cancelled", "disconnected", "error"}
GREEDY = {"temperature": 0}
SHARED_SYSTEM = ("You are Atlas, the support assistant of the Northwind travel agency. Always answer politely "
                 "and briefly. Our offices are open Monday to Friday from nine to five. Refunds are possible up "
                 "to fourteen days before departure, minus a handling fee of twenty euros.")
QUESTIONS = ["When are you open?", "Can I get a refund?", "What about luggage?", "Do you sell insurance?",
             "How do I change a booking?", "Thanks, anything else?", "Where is your office?"]
LONG_ANSWER = "Count from 1 to 1000, one number per line."  # with ignore_eos, runs to max_tokens
FIGURES_FILE = os.environ.get("CHATCORE_RELIABILITY_FIGURES")  # optional: append each test's figures (JSON lines)


def sizes(fast: Any, stress: Any) -> list[Any]:
    """Parameters for the fast run (`make test`) and the full one (`make stress`, marker `stress`)."""
    return [pytest.param(fast, id="fast"), pytest.param(stress, id="stress", marks=pytest.mark.stress)]


def private_system(tag: str) -> str:
    """A system prompt no other session shares (its first block is unique)."""
    digest = hashlib.sha256(tag.encode()).hexdigest()[:16]  # deterministic: reruns see the same prompts
    return f"Session {tag} {digest}. You are a helpful assistant who follows instructions exactly."


# ----- figures -------------------------------------------------------------------------------------

def report(capsys: pytest.CaptureFixture[str], name: str, figures: dict[str, Any]) -> None:
    """Print a test's figures to the terminal (even without -s) and optionally append them to a file."""
    width = max(len(k) for k in figures)
    lines = [f"\n[reliability] {name}"] + [f"  {k:<{width}}  {_fmt(v)}" for k, v in figures.items()]
    with capsys.disabled():
        print("\n".join(lines), flush=True)
    if FIGURES_FILE:
        with open(FIGURES_FILE, "a") as fh:
            fh.write(json.dumps({"test": name, **figures}) + "\n")


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(q) - 1))]


# ----- server state ---------------------------------------------------------------------------------

def cache(server: LiveServer, key: str | None = None) -> dict[str, Any]:
    status, body = server.get("/v1/admin/cache", key=key or server.admin_key)
    assert status == 200, body
    return body


def metrics(server: LiveServer) -> dict[str, float]:
    """Prometheus samples by their full name with labels, e.g. 'chatcore_kv_blocks{state="used"}'."""
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def wait_for(check: Any, what: str, deadline_s: float, interval_s: float = 0.1) -> Any:
    """Poll `check()` (sync; run in a thread) until it returns something truthy, or fail at the deadline."""
    deadline = time.monotonic() + deadline_s
    while True:
        result = await asyncio.to_thread(check)
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {deadline_s:.0f} s waiting for {what}")
        await asyncio.sleep(interval_s)


async def wait_idle(server: LiveServer, deadline_s: float = 60, key: str | None = None) -> dict[str, Any]:
    """Wait until no block is in use (pins expired, turns ended); the audit must hold throughout."""
    def idle() -> dict[str, Any] | None:
        body = cache(server, key)
        assert body["audit"]["ok"], body["audit"]
        return body if body["audit"]["used"] == 0 else None

    body = await wait_for(idle, "used KV blocks to return to 0", deadline_s)
    assert body["audit"]["sum_refs"] == body["audit"]["sum_table_lens"] == 0, body["audit"]
    assert body["audit"]["free"] + body["audit"]["cached"] == body["audit"]["total"], body["audit"]
    return body


LOG_PROBLEMS = re.compile(r"^(ERROR|CRITICAL)\b|Traceback|CacheError|audit failed|invariant", re.MULTILINE)


def log_problems(server: LiveServer) -> list[str]:
    """Error lines and tracebacks in the server's log (a debug audit failure raises and is logged)."""
    return [m.group(0) + ": " + server.log()[m.start():m.start() + 200].splitlines()[0]
            for m in LOG_PROBLEMS.finditer(server.log())]


def history(server: LiveServer, session_id: str, key: str | None = None) -> list[dict[str, Any]]:
    status, body = server.get(f"/v1/sessions/{session_id}", key=key)
    assert status == 200, body
    return body["history"]


# ----- /healthz probe -------------------------------------------------------------------------------

class HealthProbe:
    """A thread that asks /healthz every `interval_s` and records each answer's latency."""

    def __init__(self, server: LiveServer, interval_s: float = 0.25) -> None:
        self.url = server.base_url + "/healthz"
        self.interval_s = interval_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="healthz-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=10) as resp:
                    ok = resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
                if not ok:
                    self.failures.append("bad answer")
            except OSError as exc:
                self.failures.append(repr(exc))
            self.latencies.append(time.monotonic() - start)
            self._stop.wait(self.interval_s)

    @property
    def worst_s(self) -> float:
        return max(self.latencies, default=0.0)


# ----- a WebSocket chat client that keeps every frame -------------------------------------------------

@dataclass
class Turn:
    client_id: str
    content: str
    frames: list[dict[str, Any]] = field(default_factory=list)
    frame_times: list[float] = field(default_factory=list)  # when each frame arrived (monotonic)
    sent_at: float = 0.0
    first_token_at: float | None = None
    done_at: float | None = None

    @property
    def text(self) -> str:
        return "".join(f["text"] for f in self.frames if f["type"] == "token" and f.get("index", 0) == 0)

    @property
    def done(self) -> dict[str, Any] | None:
        return next((f for f in self.frames if f["type"] == "done"), None)

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [f for f in self.frames if f["type"] == "error"]

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    @property
    def seqs(self) -> list[int]:
        return [f["seq"] for f in self.frames if "seq" in f]


class Chat:
    """One client socket on one session. `frames` are kept per turn; `last_seq` is the replay cursor."""

    def __init__(self, server: LiveServer, key: str | None = None) -> None:
        self.server = server
        self.key = key
        self.ws: Any = None
        self.session_id: str | None = None
        self.resume_token: str | None = None
        self.last_seq: int | None = None
        self.session_frame: dict[str, Any] | None = None

    async def connect(self) -> None:
        url = self.server.ws_url + (f"?api_key={self.key}" if self.key else "")
        self.ws = await websockets.connect(url, max_size=None, open_timeout=60, close_timeout=5)

    async def hello(self, *, system_prompt: str | None = None, title: str | None = None, resume: bool = False,
                    timeout: float = 60) -> dict[str, Any]:
        if self.ws is None:
            await self.connect()
        frame: dict[str, Any] = {"type": "hello", "session_id": None, "resume_token": None, "last_seq": None,
                                 "system_prompt": system_prompt, "title": title}
        if resume:
            frame.update(session_id=self.session_id, resume_token=self.resume_token, last_seq=self.last_seq)
        await self.ws.send(json.dumps(frame))
        async with asyncio.timeout(timeout):
            answer = json.loads(await self.ws.recv())
        assert answer["type"] == "session", answer
        self.session_id, self.resume_token = answer["session_id"], answer["resume_token"]
        self.session_frame = answer
        return answer

    async def send_user(self, content: str, params: dict[str, Any], client_id: str | None = None) -> Turn:
        turn = Turn(client_id or uuid.uuid4().hex, content)
        turn.sent_at = time.monotonic()
        await self.ws.send(json.dumps({"type": "user", "id": turn.client_id, "content": content,
                                       "params": params}))
        return turn

    async def recv(self, turn: Turn, timeout: float) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            frame = json.loads(await self.ws.recv())
        turn.frames.append(frame)
        turn.frame_times.append(time.monotonic())
        if "seq" in frame:
            self.last_seq = max(self.last_seq or 0, frame["seq"])
        if frame["type"] == "token" and turn.first_token_at is None:
            turn.first_token_at = time.monotonic()
        if frame["type"] == "done":
            turn.done_at = time.monotonic()
        return frame

    async def until_done(self, turn: Turn, timeout: float = 300) -> Turn:
        """Frames until `done` (an `error` before it is kept); fails, never hangs, after `timeout`."""
        deadline = time.monotonic() + timeout
        while turn.done is None:
            frame = await self.recv(turn, max(0.1, deadline - time.monotonic()))
            if frame["type"] == "error" and not any(f["type"] == "start" for f in turn.frames):
                return turn  # the frame was refused: no turn started
        return turn

    async def until_tokens(self, turn: Turn, count: int, timeout: float = 300) -> bool:
        """Frames until the turn has `count` token frames; False if it ended first."""
        deadline = time.monotonic() + timeout
        while sum(f["type"] == "token" for f in turn.frames) < count:
            frame = await self.recv(turn, max(0.1, deadline - time.monotonic()))
            if frame["type"] in ("done", "error"):
                return False
        return True

    async def turn(self, content: str, params: dict[str, Any], timeout: float = 300) -> Turn:
        return await self.until_done(await self.send_user(content, params), timeout)

    async def close(self) -> None:
        if self.ws is not None:
            try:
                await self.ws.close()
            except Exception:  # noqa: BLE001, S110 - already gone
                pass
            self.ws = None

    def drop(self) -> None:
        """Go away without a close frame (the TCP connection just ends)."""
        if self.ws is not None:
            self.ws.transport.abort()
            self.ws = None


def assert_contiguous(seqs: list[int], what: str) -> None:
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"{what}: gaps or duplicates by seq: {seqs}"


def data_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
