"""A real `chatcore serve` process on a free loopback port, for tests that speak HTTP and WebSocket."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets

STARTUP_TIMEOUT_S = 120
GREEDY = {"temperature": 0, "max_tokens": 40}
SYSTEM = ("You are Atlas, the support assistant of the Northwind travel agency. Always answer politely and "
          "briefly. Our offices are open Monday to Friday from nine to five. Refunds are possible up to fourteen "
          "days before departure, minus a handling fee of twenty euros. Bookings can be changed online or by "
          "phone. Luggage rules depend on the airline. Travel insurance is optional but recommended.")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    base_url: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    env: dict[str, str]
    log_path: Path
    admin_key: str | None = None
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://") + "/v1/ws"

    def get(self, path: str, key: str | None = None) -> tuple[int, Any]:
        return self.request("GET", path, key=key)

    def request(self, method: str, path: str, body: Any = None, key: str | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as err:
            raw, status = err.read(), err.code
        text = raw.decode()
        try:
            return status, json.loads(text) if text else None
        except ValueError:
            return status, text

    def connect(self, key: str | None = None, **kwargs: Any) -> Any:
        url = self.ws_url + (f"?api_key={key}" if key else "")
        return websockets.connect(url, max_size=None, **kwargs)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def start_server(data_dir: Path, *, command: tuple[str, ...] = ("-m", "chatcore.cli"), **settings: str) -> LiveServer:
    """Start `chatcore serve` (`command`: the Python arguments before `serve`) with CHATCORE_* settings;
    returns once /healthz answers."""
    port = free_port()
    env = {**os.environ, "CHATCORE_DATA_DIR": str(data_dir), "CHATCORE_PORT": str(port),
           "CHATCORE_HOST": "127.0.0.1", "CHATCORE_KV_CACHE_GB": "0.25"}
    env.update({f"CHATCORE_{k.upper()}": str(v) for k, v in settings.items()})
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / f"server-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, *command, "serve"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    server = LiveServer(f"http://127.0.0.1:{port}", data_dir, proc, env, log_path)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"chatcore serve exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.base_url + "/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return server
        except OSError:
            time.sleep(0.2)  # polling for the port to open, not synchronising on work
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"chatcore serve did not answer /healthz in time:\n{server.log()}")


def create_key(server: LiveServer, tenant: str, admin: bool = False) -> str:
    args = [sys.executable, "-m", "chatcore.cli", "keys", "create", "--tenant", tenant] + (["--admin"] if admin else [])
    out = subprocess.run(args, env=server.env, capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.strip().splitlines()[-1]


def wait_for_status(server: LiveServer, path: str, status: int, deadline_s: float) -> None:
    """Poll GET `path` until it answers `status`: a state the server reaches on its own clock."""
    deadline = time.monotonic() + deadline_s
    seen = None
    while time.monotonic() < deadline:
        seen = server.get(path)[0]
        if seen == status:
            return
        time.sleep(0.1)  # polling a state with a deadline, not synchronising on work
    raise AssertionError(f"GET {path} still answered {seen}, not {status}, after {deadline_s:g} s")


async def recv_until(ws: Any, kind: str, timeout: float = 120) -> list[dict[str, Any]]:
    """Frames up to and including the first of type `kind`."""
    frames = []
    async with asyncio.timeout(timeout):
        while True:
            frame = json.loads(await ws.recv())
            frames.append(frame)
            if frame["type"] == kind:
                return frames


async def until_tokens(ws: Any, count: int, timeout: float = 120) -> list[dict]:
    """Frames up to the `count`-th token of a running turn; fails (never hangs) if the turn ends first."""
    frames: list[dict] = []
    async with asyncio.timeout(timeout):
        while sum(f["type"] == "token" for f in frames) < count:
            frame = json.loads(await ws.recv())
            assert frame["type"] not in ("done", "error"), f"the turn ended before {count} tokens: {frames + [frame]}"
            frames.append(frame)
    return frames


async def hello(ws: Any, **fields: Any) -> dict[str, Any]:
    """Send `hello` (a new session unless `session_id` is given) and return the `session` frame."""
    await ws.send(json.dumps({"type": "hello", "session_id": None, "resume_token": None, "last_seq": None,
                              "system_prompt": None, **fields}))
    frame = json.loads(await ws.recv())
    assert frame["type"] == "session", frame
    return frame


async def turn(ws: Any, content: str, params: dict[str, Any] | None = None,
               client_id: str | None = None) -> tuple[str, dict[str, Any]]:
    """One user turn; returns the streamed text and the `done` frame."""
    import uuid

    await ws.send(json.dumps({"type": "user", "id": client_id or uuid.uuid4().hex, "content": content,
                              "params": params or GREEDY}))
    frames = await recv_until(ws, "done")
    return "".join(f["text"] for f in frames if f["type"] == "token"), frames[-1]
