"""Client text is tokenized off the event loop (issue 15, item 4): while the largest message the
limits allow is being tokenized, the server keeps answering. Driven on the real app in the test's
event loop: the tokenizer is held, on the text that carries a marker, until the test lets it go."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import httpx
import pytest

from chatcore.config import Settings
from chatcore.engine.request import SamplingParams
from chatcore.sessions.errors import Busy
from tests.inprocess_server import InProcessServer, serve
from tests.server_helpers import hello

pytestmark = pytest.mark.model
MARKER = "Zanzibar-marker-7f3c"
FRAME_BYTES = Settings().max_frame_bytes  # the WebSocket frame limit; an HTTP body may hold 16 frames
PARAMS = {"temperature": 0, "max_tokens": 2}
GREEDY = SamplingParams(max_tokens=2, temperature=0.0)


def _mentions_marker(text_or_messages: Any) -> bool:
    if isinstance(text_or_messages, str):
        return MARKER in text_or_messages
    return any(MARKER in m["content"] for m in text_or_messages)


class TokenizerGate:
    """Wraps the shared tokenizer's `encode` and `apply_chat_template`. A call on text with the marker
    records its thread and, unless it runs on the loop's thread (where nothing could let it go),
    waits until `release` is set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tokenizer: Any) -> None:
        self.loop_thread = threading.current_thread()
        self.threads: list[threading.Thread] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        for name in ("encode", "apply_chat_template"):
            monkeypatch.setattr(tokenizer, name, self._gated(getattr(tokenizer, name)))

    def _gated(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def gated(text_or_messages: Any, *args: Any, **kwargs: Any) -> Any:
            if _mentions_marker(text_or_messages):
                self.threads.append(threading.current_thread())
                self.entered.set()
                if threading.current_thread() is not self.loop_thread:
                    assert self.release.wait(timeout=120)
            return call(text_or_messages, *args, **kwargs)

        return gated


async def _ws_message(server: InProcessServer, http: httpx.AsyncClient) -> str:
    """A WebSocket turn whose user message is as large as a frame allows."""
    async with server.connect() as ws:
        await hello(ws)
        frame = {"type": "user", "id": "big", "content": "", "params": PARAMS}
        filler = FRAME_BYTES - len(json.dumps(frame)) - len(MARKER) - 64
        await ws.send(json.dumps({**frame, "content": MARKER + " pear" * (filler // 5)}))
        return json.loads(await ws.recv())["code"]


async def _ws_system_prompt(server: InProcessServer, http: httpx.AsyncClient) -> str:
    """A hello with a system prompt as large as a frame allows: rendering it, to check that it leaves room
    for a turn in the context, is the work (it leaves none: refused at the hello, issue 47)."""
    async with server.connect() as ws:
        await ws.send(json.dumps({"type": "hello", "session_id": None,
                                  "system_prompt": MARKER + " pear" * (FRAME_BYTES // 6)}))
        return json.loads(await ws.recv())["code"]


def _big_body(server: InProcessServer) -> dict[str, Any]:
    """One user message as large as can still be tokenized: just under the character bound of a message
    (max_message_tokens at the vocabulary's longest token; past it, text is refused untokenized)."""
    sessions = server.services.sessions
    chars = sessions.settings.max_message_tokens * sessions.token_chars
    return {"messages": [{"role": "user", "content": MARKER + " pear" * ((chars - 64) // 5)}], "max_tokens": 2}


async def _x_session_id(server: InProcessServer, http: httpx.AsyncClient) -> str:
    created = (await http.post("/v1/sessions", json={})).json()
    resp = await http.post("/v1/chat/completions", json=_big_body(server), headers={"X-Session-Id": created["id"]})
    assert resp.status_code == 413, resp.text
    return resp.json()["error"]["code"]


async def _stateless(server: InProcessServer, http: httpx.AsyncClient) -> str:
    await http.get("/healthz")  # the app has started: its services exist
    resp = await http.post("/v1/chat/completions", json=_big_body(server))
    assert resp.status_code == 413, resp.text
    return resp.json()["error"]["code"]


@pytest.mark.parametrize("send", [_ws_message, _ws_system_prompt, _x_session_id, _stateless],
                         ids=["websocket-message", "websocket-system-prompt", "x-session-id", "stateless"])
async def test_the_loop_serves_while_a_large_message_is_tokenized(
        tmp_path, loaded_fp32, monkeypatch, send: Callable[[InProcessServer, httpx.AsyncClient], Awaitable[str]],
) -> None:
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=128, kv_disk_gb=0)
    gate = TokenizerGate(monkeypatch, loaded_fp32.tokenizer)
    async with serve(settings, loaded_fp32) as server, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as http:
        big = asyncio.create_task(send(server, http))
        try:
            assert await asyncio.to_thread(gate.entered.wait, 120)
            assert gate.threads and gate.loop_thread not in gate.threads, "tokenized on the event loop"
            assert all(t.name.startswith("chatcore-tokenize") for t in gate.threads), gate.threads
            # The tokenizer thread holds the large message; the loop answers meanwhile.
            assert (await http.get("/healthz")).json() == {"status": "ok"}
            assert (await http.get("/v1/models")).status_code == 200
            assert not big.done()
        finally:
            gate.release.set()
        assert await big == "too_large"  # the limits still apply, to a count made off the loop
        assert len(set(gate.threads)) == 1 and gate.loop_thread not in gate.threads


async def test_a_turn_being_tokenized_holds_its_tenant_slot(tmp_path, loaded_fp32, monkeypatch) -> None:
    """The per-tenant bound, in sequences, is taken before the tokenizer is awaited: while one turn of the
    tenant is being tokenized, another session's turn and a stateless request of the tenant that would
    pass the bound (two sequences each) are refused, naming it. In open mode the bound is the engine's
    capacity plus its queue (here 1 + 1)."""
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=128, kv_disk_gb=0, max_num_seqs=1,
                        max_waiting_requests=1)
    gate = TokenizerGate(monkeypatch, loaded_fp32.tokenizer)
    async with serve(settings, loaded_fp32) as server, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as http:
        await http.get("/healthz")  # the app has started: its services exist
        manager, turns = server.services.sessions, server.services.turns
        tenant = server.services.local_tenant_id
        a, _ = await manager.create(tenant)
        b, _ = await manager.create(tenant)
        first = asyncio.create_task(turns.start(a, f"{MARKER} Say hello.", GREEDY))
        try:
            assert await asyncio.to_thread(gate.entered.wait, 120)
            assert gate.loop_thread not in gate.threads, "tokenized on the event loop"
            assert manager.slots.held(tenant) == 1
            with pytest.raises(Busy, match="max_num_seqs=1 \\+ max_waiting_requests=1"):
                await turns.start(b, "Say hi.", replace(GREEDY, n=2))
            resp = await http.post("/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2})
            assert resp.status_code == 429 and resp.json()["error"]["code"] == "busy"
            assert "max_waiting_requests" in resp.json()["error"]["message"]
            assert not first.done()
        finally:
            gate.release.set()
        frames = await first
        await frames.finished.wait()
        assert frames.done_frame is not None and frames.done_frame["finish_reason"] in ("stop", "length")
        assert manager.slots.held(tenant) == 0


async def test_text_past_the_character_bound_is_refused_untokenized(tmp_path, loaded_fp32, monkeypatch) -> None:
    """Text longer than its token bound times the vocabulary's longest token cannot fit: it gets today's
    too-long refusal (413 too_large) without a moment of the tokenizer thread, which every tenant shares."""
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=128, kv_disk_gb=0)
    gate = TokenizerGate(monkeypatch, loaded_fp32.tokenizer)
    async with serve(settings, loaded_fp32) as server, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as http:
        created = (await http.post("/v1/sessions", json={})).json()
        sessions = server.services.sessions
        context_chars = server.services.engine.info.max_context * sessions.token_chars
        message_chars = settings.max_message_tokens * sessions.token_chars
        for body, headers in (
                ({"messages": [{"role": "user", "content": MARKER + "x" * context_chars}], "max_tokens": 2}, {}),
                ({"prompt": MARKER + "x" * context_chars, "max_tokens": 2}, {}),
                ({"messages": [{"role": "user", "content": MARKER + "x" * message_chars}], "max_tokens": 2},
                 {"X-Session-Id": created["id"]})):
            path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
            resp = await http.post(path, json=body, headers=headers)
            assert resp.status_code == 413, resp.text
            error = resp.json()["error"]
            assert error["code"] == "too_large" and "characters" in error["message"], error
        assert not gate.entered.is_set(), "text past the bound was tokenized"
        assert sessions.slots.held(server.services.local_tenant_id) == 0
