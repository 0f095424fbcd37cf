"""A WebSocket client for real `chatcore serve` processes (the resume and server suites).

Servers are started with `tests.server_helpers.start_server` (a free loopback port, open mode,
CHATCORE_* settings from keyword arguments); the bench's own settings (model, dtype, block
size, threads) are passed on so the server runs what the in-process suites run.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import websockets

from bench.common import Context

TURN_TIMEOUT_S = 600


def server_settings(ctx: Context, **extra: Any) -> dict[str, str]:
    s = ctx.settings
    settings = {"model": s.model, "dtype": s.dtype, "block_size": s.block_size, "threads": ctx.threads,
                "cache_dir": s.cache_dir, "kv_cache_gb": 1.0, "max_turns_per_tenant": 64,
                "max_queue_wait_s": 600, "hot_window_s": 30}
    settings.update(extra)
    return {k: str(v) for k, v in settings.items()}


def start(ctx: Context, data_dir: Path, **extra: Any) -> Any:
    from tests.server_helpers import start_server

    return start_server(data_dir, **server_settings(ctx, **extra))


def start_many(ctx: Context, specs: dict[str, tuple[Path, dict[str, Any]]]) -> dict[str, Any]:
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
        import asyncio

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


async def connect(server: Any, system_prompt: str | None = None, session_id: str | None = None,
                  resume_token: str | None = None) -> ClientSession:
    ws = await websockets.connect(server.ws_url, max_size=None, open_timeout=60, ping_interval=None)
    await ws.send(json.dumps({"type": "hello", "session_id": session_id, "resume_token": resume_token,
                              "system_prompt": system_prompt, "last_seq": None}))
    msg = json.loads(await ws.recv())
    if msg.get("type") != "session":
        await ws.close()
        raise RuntimeError(f"hello failed: {msg}")
    return ClientSession(ws, msg["session_id"], msg["resume_token"] or resume_token or "")
