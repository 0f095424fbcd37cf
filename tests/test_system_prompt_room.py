"""A system prompt within the 100,000-character cap but too large for the context (issue 47): the session it
would make could run no turn, each one `too_large`. It is refused when the session would be created (a
WebSocket `hello`, `POST /v1/sessions`, `POST /v1/sessions/import`) with `too_large` naming the context and
the system prompt's tokens, and nothing is stored. A system prompt that leaves exactly the smallest turn (a
one-character message, one token of answer) is taken, and that turn runs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from chatcore.config import Settings
from chatcore.sessions.template import ChatTemplate
from tests.inprocess_server import InProcessServer, http_client, serve
from tests.server_helpers import hello, recv_until

pytestmark = pytest.mark.model
CONTEXT = 256


def system(words: int) -> str:
    return "You are terse." + " word" * words


def smallest_turn(template: ChatTemplate, words: int) -> int:
    """Tokens of the smallest turn's prompt after `system(words)`: a one-character message."""
    return len(template.first_turn(system(words), "x"))


def tightest(template: ChatTemplate, context: int) -> int:
    """The most words whose smallest turn leaves exactly one token of answer in `context`."""
    words = next(n for n in range(context) if smallest_turn(template, n) + 1 >= context)
    assert smallest_turn(template, words) == context - 1, "one word is one token: the boundary is exact"
    return words


@pytest.fixture(scope="module")
async def server(tmp_path_factory, loaded_fp32) -> AsyncIterator[InProcessServer]:
    settings = Settings(data_dir=tmp_path_factory.mktemp("system-prompt"), dtype="float32", num_blocks=128,
                        kv_disk_gb=0, max_context=CONTEXT)
    async with serve(settings, loaded_fp32) as running:
        yield running


@pytest.fixture
async def http(server: InProcessServer) -> AsyncIterator[httpx.AsyncClient]:
    async with http_client(server) as client:
        yield client


async def stored_sessions(server: InProcessServer) -> set[str]:
    """The sessions the (open mode) tenant lists, and those in memory."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as client:
        listed = await client.get("/v1/sessions")
    assert listed.status_code == 200, listed.text
    return {s["id"] for s in listed.json()} | set(server.services.sessions.live)


async def test_a_system_prompt_that_leaves_no_turn_is_refused_at_hello_and_the_tightest_one_runs_a_turn(
        server: InProcessServer) -> None:
    before = await stored_sessions(server)  # (the app has started: `services` exists)
    template = server.services.sessions.template
    words = tightest(template, CONTEXT)
    own = len(template.render([{"role": "system", "content": system(words + 1)}], generation_prompt=False))
    async with server.connect() as ws:
        await ws.send(json.dumps({"type": "hello", "session_id": None, "system_prompt": system(words + 1)}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "too_large", error
        assert f"the system prompt takes {own} tokens" in error["message"]
        assert f"the model's context is {CONTEXT} tokens (max_context)" in error["message"]
        assert await stored_sessions(server) == before  # no session was made
        # The same socket may still open a session, with a system prompt that leaves the smallest turn.
        session = await hello(ws, system_prompt=system(words))
        await ws.send(json.dumps({"type": "user", "id": "x", "content": "x",
                                  "params": {"temperature": 0, "ignore_eos": True}}))
        done = (await recv_until(ws, "done"))[-1]
    assert done["finish_reason"] == "length", done
    assert done["usage"]["prompt_tokens"] == CONTEXT - 1 and done["usage"]["completion_tokens"] == 1
    assert await stored_sessions(server) == before | {session["session_id"]}


@pytest.mark.parametrize("route", ["/v1/sessions", "/v1/sessions/import"])
async def test_the_session_routes_refuse_it_with_413_and_store_nothing(server: InProcessServer,
                                                                       http: httpx.AsyncClient, route: str) -> None:
    words = tightest(server.services.sessions.template, CONTEXT)
    body = {"title": "too big", "system_prompt": system(words + 1)}
    if route.endswith("import"):
        body["messages"] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    before = await stored_sessions(server)
    resp = await http.post(route, json=body)
    assert resp.status_code == 413, resp.text
    error = resp.json()["error"]
    assert error["code"] == "too_large" and f"context is {CONTEXT} tokens (max_context)" in error["message"]
    assert await stored_sessions(server) == before
    body["system_prompt"] = system(words)
    made = await http.post(route, json=body)
    assert made.status_code == 201, made.text
    await http.delete(f"/v1/sessions/{made.json()['id']}")


async def test_a_system_prompt_the_kv_pool_cannot_hold_is_refused_naming_the_pool(tmp_path, loaded_fp32) -> None:
    """A context the pool is smaller than: the smallest turn fits the context, not the pool's admission."""
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=8, kv_disk_gb=0, max_context=CONTEXT)
    async with serve(settings, loaded_fp32) as server, server.connect() as ws:
        await ws.send(json.dumps({"type": "hello", "session_id": None, "system_prompt": system(150)}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "too_large", error
        assert "the KV pool cannot hold it (the prompt needs" in error["message"], error
        assert await stored_sessions(server) == set()
