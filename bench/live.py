"""Real `chatcore serve` processes and a WebSocket client for them (the resume and server suites).

A server runs in open mode on a free loopback port with CHATCORE_* settings from keyword
arguments; the bench's own settings (model, dtype, block size, threads) are passed on so the
server runs what the in-process suites run.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets

from chatcore.bench.common import Context
from chatcore.ops.processes import free_port, wait_http

TURN_TIMEOUT_S = 600
STARTUP_TIMEOUT_S = 300


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def ws_url(self) -> str:
        return self.base_url.replace("http://", "ws://") + "/v1/ws"

    def stop(self) -> None:
        """SIGTERM (the server drains and flushes the disk tier), then a kill after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def server_settings(ctx: Context, **extra: Any) -> dict[str, str]:
    """CHATCORE_* values for a server; a setting given as None is left to the server's default."""
    s = ctx.settings
    settings = {"model": s.model, "dtype": s.dtype, "block_size": s.block_size, "threads": ctx.threads,
                "cache_dir": s.cache_dir, "kv_cache_gb": 1.0, "max_turns_per_tenant": 64,
                "max_queue_wait_s": 600, "hot_window_s": 30}
    settings.update(extra)
    return {k: str(v) for k, v in settings.items() if v is not None}


def start(ctx: Context, data_dir: Path, **extra: Any) -> Server:
    """Start `chatcore serve` on `data_dir`; returns once /healthz answers."""
    port = free_port()
    env = {**os.environ, "CHATCORE_DATA_DIR": str(data_dir), "CHATCORE_PORT": str(port),
           "CHATCORE_HOST": "127.0.0.1"}
    env.update({f"CHATCORE_{k.upper()}": v for k, v in server_settings(ctx, **extra).items()})
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / f"server-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "chatcore.cli", "serve"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        wait_http(server.base_url + "/healthz", STARTUP_TIMEOUT_S, alive=lambda: proc.poll() is None)
    except (RuntimeError, TimeoutError) as exc:
        server.stop()
        raise RuntimeError(f"{exc}:\n{log_path.read_text(errors='replace')[-4000:]}") from exc
    return server


def start_many(ctx: Context, specs: dict[str, tuple[Path, dict[str, Any]]]) -> dict[str, Server]:
    """Start several servers at once (model loading overlaps); stops the started ones on failure."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(start, ctx, root, **extra) for name, (root, extra) in specs.items()}
    started, error = {}, None
    for name, future in futures.items():
        try:
            started[name] = future.result()
        except Exception as exc:
            error = exc
    if error is not None:
        for server in started.values():
            server.stop()
        raise error
    return started


def admin_cache(server: Server) -> dict[str, Any]:
    """`GET /v1/admin/cache` (open mode: the local tenant is admin): the audit and the tiers."""
    with urllib.request.urlopen(server.base_url + "/v1/admin/cache", timeout=60) as response:
        return json.loads(response.read())


def delete_session(server: Server, session_id: str) -> None:
    """`DELETE /v1/sessions/{id}`: the server drops the session's pin, its disk-tier entries and its rows."""
    request = urllib.request.Request(f"{server.base_url}/v1/sessions/{session_id}", method="DELETE")
    with urllib.request.urlopen(request, timeout=60):
        pass


@dataclass
class TurnResult:
    done: dict[str, Any]
    client_ttft_s: float | None
    sent_at: float
    done_at: float
    tokens_frames: int
    text: str = ""

    @property
    def usage(self) -> dict[str, Any]:
        return self.done.get("usage", {})

    @property
    def server_ttft_ms(self) -> float | None:
        return self.done.get("timing", {}).get("ttft_ms")


@dataclass
class ClientSession:
    ws: Any
    session_id: str
    resume_token: str
    turns: list[TurnResult] = field(default_factory=list)

    async def turn(self, content: str, max_tokens: int, ignore_eos: bool = False) -> TurnResult:
        frame = {"type": "user", "id": uuid.uuid4().hex, "content": content,
                 "params": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos}}
        sent = time.perf_counter()
        await self.ws.send(json.dumps(frame))
        first: float | None = None
        count = 0
        text = []

        async with asyncio.timeout(TURN_TIMEOUT_S):
            while True:
                msg = json.loads(await self.ws.recv())
                kind = msg.get("type")
                if kind == "token":
                    if first is None:
                        first = time.perf_counter()
                    count += 1
                    text.append(msg.get("text", ""))
                elif kind == "error":
                    raise RuntimeError(f"server error: {msg}")
                elif kind == "done":
                    result = TurnResult(msg, first - sent if first else None, sent, time.perf_counter(), count,
                                        "".join(text))
                    self.turns.append(result)
                    if msg.get("finish_reason") not in ("stop", "length"):
                        raise RuntimeError(f"turn ended with {msg.get('finish_reason')}: {msg}")
                    return result


async def connect(server: Server, system_prompt: str | None = None, session_id: str | None = None,
                  resume_token: str | None = None) -> ClientSession:
    ws = await websockets.connect(server.ws_url, max_size=None, open_timeout=60, ping_interval=None)
    await ws.send(json.dumps({"type": "hello", "session_id": session_id, "resume_token": resume_token,
                              "system_prompt": system_prompt, "last_seq": None}))
    msg = json.loads(await ws.recv())
    if msg.get("type") != "session":
        await ws.close()
        raise RuntimeError(f"hello failed: {msg}")
    return ClientSession(ws, msg["session_id"], msg["resume_token"] or resume_token or "")
