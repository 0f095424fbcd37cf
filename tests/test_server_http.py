"""Sessions REST, HTTP bad input, and the limits (frame size, message tokens, max_tokens, sessions and
turns per tenant, WebSocket Origin), against real server processes."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest
import websockets

from tests.server_helpers import hello, recv_until, start_server, turn, until_tokens

pytestmark = pytest.mark.model
FRAME_LIMIT = 1024
MESSAGE_TOKEN_LIMIT = 64
MAX_TOKENS_LIMIT = 200
SESSION_LIMIT = 4
ALLOWED_ORIGIN = "http://example.test"
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def limits(tmp_path_factory):
    """An open-mode server with small limits, two sequences in flight for its tenant (the engine's capacity,
    one, plus its queue, one: open mode's bound), and one allowed origin."""
    server = start_server(tmp_path_factory.mktemp("limits-server"), max_frame_bytes=FRAME_LIMIT,
                          max_message_tokens=MESSAGE_TOKEN_LIMIT, max_tokens_limit=MAX_TOKENS_LIMIT,
                          max_sessions_per_tenant=SESSION_LIMIT, max_num_seqs=1, max_waiting_requests=1,
                          allowed_origins=json.dumps([ALLOWED_ORIGIN]))
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def audit_after(request, live_server):
    yield
    servers = [live_server]
    if "limits" in request.fixturenames:
        limits = request.getfixturevalue("limits")
        # Each limits test starts from no sessions (the session limit counts them).
        status, sessions = limits.get("/v1/sessions")
        assert status == 200
        for s in sessions:
            assert limits.request("DELETE", f"/v1/sessions/{s['id']}")[0] == 204
        servers.append(limits)
    for server in servers:
        status, body = server.get("/v1/admin/cache")
        assert status == 200 and body["audit"]["ok"], body["audit"]


async def expect_error(ws, payload: dict | str, code: str) -> dict:
    await ws.send(payload if isinstance(payload, str) else json.dumps(payload))
    frame = json.loads(await ws.recv())
    assert frame["type"] == "error" and frame["code"] == code and frame["message"], frame
    return frame


async def still_open(ws) -> None:
    await ws.send(json.dumps({"type": "ping"}))
    assert json.loads(await ws.recv()) == {"type": "pong"}


def raw(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> httpx.Response:
    return httpx.request(method, server.base_url + path, content=body, timeout=60,
                         headers={"Content-Type": "application/json", **(headers or {})})


def assert_error(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and "Traceback" not in body["error"]["message"]


def blocks_of(server, session_id: str) -> list[dict]:
    status, cache = server.get("/v1/admin/cache")
    assert status == 200 and cache["audit"]["ok"], cache["audit"]
    return [b for b in cache["blocks"] if session_id in b["sessions"]] + [
        s for s in cache["sessions"] if s["id"] == session_id]


# ----- sessions REST (the shared open-mode server) -------------------------------------------------

def test_session_create_list_rename_delete(live_server) -> None:
    status, created = live_server.request("POST", "/v1/sessions", {"title": "notes", "system_prompt": "Be brief."})
    assert status == 201
    assert set(created) == {"id", "resume_token", "title", "system_prompt"}
    assert created["title"] == "notes" and created["system_prompt"] == "Be brief." and created["resume_token"]
    sid = created["id"]
    status, listed = live_server.get("/v1/sessions")
    assert status == 200
    mine = [s for s in listed if s["id"] == sid]
    assert len(mine) == 1
    assert set(mine[0]) == {"id", "title", "state", "created_at", "last_active_at", "turns"}
    assert mine[0]["title"] == "notes" and mine[0]["turns"] == 0
    status, renamed = live_server.request("PATCH", f"/v1/sessions/{sid}", {"title": "renamed"})
    assert status == 200 and renamed["title"] == "renamed"
    status, detail = live_server.get(f"/v1/sessions/{sid}")
    assert status == 200
    assert detail["title"] == "renamed" and detail["system_prompt"] == "Be brief." and detail["history"] == []
    assert set(detail["cache"]) == {"history_tokens", "device_blocks", "cached_tokens"}
    assert [s["title"] for s in live_server.get("/v1/sessions")[1] if s["id"] == sid] == ["renamed"]
    assert live_server.request("DELETE", f"/v1/sessions/{sid}")[0] == 204
    assert live_server.get(f"/v1/sessions/{sid}")[0] == 404
    assert live_server.request("DELETE", f"/v1/sessions/{sid}")[1]["error"]["code"] == "not_found"
    assert live_server.request("PATCH", f"/v1/sessions/{sid}", {"title": "x"})[0] == 404
    assert all(s["id"] != sid for s in live_server.get("/v1/sessions")[1])


async def test_list_counts_turns(live_server) -> None:
    async with live_server.connect() as ws:
        session = await hello(ws)
        await turn(ws, "Say yes.", {"temperature": 0, "max_tokens": 2})
        await turn(ws, "Say no.", {"temperature": 0, "max_tokens": 2})
    listed = {s["id"]: s for s in live_server.get("/v1/sessions")[1]}
    assert listed[session["session_id"]]["turns"] == 2
    assert live_server.request("DELETE", f"/v1/sessions/{session['session_id']}")[0] == 204


async def test_rotated_token_replaces_the_old_one(live_server) -> None:
    status, created = live_server.request("POST", "/v1/sessions", {"title": "rotate"})
    assert status == 201
    sid, old = created["id"], created["resume_token"]
    status, rotated = live_server.request("POST", f"/v1/sessions/{sid}/token")
    assert status == 200 and rotated["id"] == sid and rotated["resume_token"] not in ("", old)
    async with live_server.connect() as ws:
        await ws.send(json.dumps({"type": "hello", "session_id": sid, "resume_token": old}))
        frame = json.loads(await ws.recv())
        assert frame["code"] == "unauthorized"
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1008
    async with live_server.connect() as ws:
        session = await hello(ws, session_id=sid, resume_token=rotated["resume_token"])
        assert session["session_id"] == sid and session["title"] == "rotate"
    assert live_server.request("DELETE", f"/v1/sessions/{sid}")[0] == 204


async def test_delete_releases_blocks_and_rows(live_server) -> None:
    async with live_server.connect() as ws:
        session = await hello(ws, system_prompt=f"Session {uuid.uuid4().hex}. Answer in one short sentence.")
        sid = session["session_id"]
        await turn(ws, "What is the capital of France?", GREEDY)
    # The finished turn's chain is pinned for the hot window: the map shows its blocks.
    assert blocks_of(live_server, sid)
    assert live_server.get(f"/v1/sessions/{sid}")[1]["cache"]["device_blocks"] > 0
    assert live_server.request("DELETE", f"/v1/sessions/{sid}")[0] == 204
    assert blocks_of(live_server, sid) == []
    assert live_server.get(f"/v1/sessions/{sid}")[0] == 404
    async with live_server.connect() as ws:
        await expect_error(ws, {"type": "hello", "session_id": sid, "resume_token": session["resume_token"]},
                           "not_found")


async def test_a_socket_on_a_deleted_session_gets_not_found(live_server) -> None:
    async with live_server.connect() as ws:
        session = await hello(ws)
        sid = session["session_id"]
        await turn(ws, "Say yes.", {"temperature": 0, "max_tokens": 2})
        assert live_server.request("DELETE", f"/v1/sessions/{sid}")[0] == 204
        await expect_error(ws, {"type": "user", "id": "after", "content": "Hello?", "params": GREEDY}, "not_found")
        await still_open(ws)
    assert live_server.get(f"/v1/sessions/{sid}")[0] == 404
    assert blocks_of(live_server, sid) == []


# ----- bad input over HTTP: 4xx with a JSON error body, never 500 ---------------------------------

MSG = [{"role": "user", "content": "hi"}]
BAD_COMPLETIONS = [
    b"{bad json", b"[1, 2]", b"null", b"", b'"text"', json.dumps({}).encode(),
    json.dumps({"messages": 5}).encode(), json.dumps({"messages": []}).encode(),
    json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(),
    json.dumps({"messages": [{"role": "robot", "content": "hi"}]}).encode(),
    json.dumps({"messages": [{"content": "hi"}]}).encode(), json.dumps({"messages": ["hi"]}).encode(),
    json.dumps({"messages": MSG, "bogus": 1}).encode(),
    json.dumps({"messages": MSG, "temperature": -1}).encode(),
    json.dumps({"messages": MSG, "temperature": "hot"}).encode(),
    json.dumps({"messages": MSG, "temperature": float("nan")}).encode(),  # NaN is not JSON
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e999}',
    json.dumps({"messages": MSG, "max_tokens": -5}).encode(), json.dumps({"messages": MSG, "max_tokens": 0}).encode(),
    json.dumps({"messages": MSG, "max_tokens": 1.5}).encode(),
    json.dumps({"messages": MSG, "max_tokens": "9"}).encode(),
    json.dumps({"messages": MSG, "max_tokens": True}).encode(), json.dumps({"messages": MSG, "top_p": 0}).encode(),
    json.dumps({"messages": MSG, "top_p": -0.5}).encode(), json.dumps({"messages": MSG, "n": 0}).encode(),
    json.dumps({"messages": MSG, "n": 9}).encode(), json.dumps({"messages": MSG, "seed": "x"}).encode(),
    json.dumps({"messages": MSG, "stop": 5}).encode(), json.dumps({"messages": MSG, "stop": [""]}).encode(),
    json.dumps({"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}).encode(),
    json.dumps({"messages": MSG, "stream": "yes"}).encode(), json.dumps({"messages": MSG, "user": 5}).encode(),
    json.dumps({"messages": MSG, "top_k": -1}).encode(),
]


@pytest.mark.parametrize("body", BAD_COMPLETIONS, ids=range(len(BAD_COMPLETIONS)))
def test_bad_completion_bodies_get_bad_request(live_server, body: bytes) -> None:
    assert_error(raw(live_server, "POST", "/v1/chat/completions", body), 400, "bad_request")


def test_bad_session_bodies_get_bad_request(live_server) -> None:
    for body in [b"{bad json", b"[1]", b'"x"', json.dumps({"title": 5}).encode(), json.dumps({"x": 1}).encode(),
                 json.dumps({"title": "t" * 201}).encode(), json.dumps({"system_prompt": 7}).encode()]:
        assert_error(raw(live_server, "POST", "/v1/sessions", body), 400, "bad_request")
    status, created = live_server.request("POST", "/v1/sessions", {"title": "patch me"})
    assert status == 201
    path = f"/v1/sessions/{created['id']}"
    for body in [b"{bad json", b"[1]", b"", json.dumps({}).encode(), json.dumps({"title": 5}).encode(),
                 json.dumps({"title": None}).encode(), json.dumps({"title": "a", "x": 1}).encode()]:
        assert_error(raw(live_server, "PATCH", path, body), 400, "bad_request")
    assert live_server.get(path)[1]["title"] == "patch me"
    assert_error(raw(live_server, "PUT", "/v1/sessions", b"{}"), 405, "bad_request")
    assert_error(raw(live_server, "GET", "/v1/sessions/no-such-id"), 404, "not_found")
    assert_error(raw(live_server, "GET", "/v1/no-such-route"), 404, "not_found")
    assert_error(raw(live_server, "POST", "/v1/chat/completions", json.dumps({"messages": MSG}).encode(),
                     {"X-Session-Id": "no-such-id"}), 404, "not_found")
    assert live_server.request("DELETE", path)[0] == 204


# ----- limits (own server) -------------------------------------------------------------------------

async def test_frame_size_limit(limits) -> None:
    async with limits.connect() as ws:
        big_but_fine = '{"type": "ping"' + " " * (FRAME_LIMIT - 100) + "}"  # a ping has no field to pad
        assert len(big_but_fine) <= FRAME_LIMIT
        await ws.send(big_but_fine)
        assert json.loads(await ws.recv()) == {"type": "pong"}
        await expect_error(ws, {"type": "ping", "pad": "x" * (FRAME_LIMIT + 100)}, "too_large")
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd.code == 1009
    # HTTP bodies are bounded too (16 frames' worth).
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (FRAME_LIMIT * 17)}]}).encode()
    assert_error(raw(limits, "POST", "/v1/chat/completions", body), 413, "too_large")


async def test_message_token_limit(limits) -> None:
    long_message = "Please tell me everything about " + "apples and pears and plums, " * 12
    async with limits.connect() as ws:
        session = await hello(ws)
        await expect_error(ws, {"type": "user", "id": "long", "content": long_message, "params": GREEDY},
                           "too_large")
        await still_open(ws)
        text, done = await turn(ws, "Hi!", {"temperature": 0, "max_tokens": 2})
        assert done["finish_reason"] in ("stop", "length") and text
    resp = raw(limits, "POST", "/v1/chat/completions",
               json.dumps({"messages": [{"role": "user", "content": long_message}], "max_tokens": 2}).encode(),
               {"X-Session-Id": session["session_id"]})
    assert_error(resp, 413, "too_large")
    # Only complete exchanges count: the rejected messages left no trace.
    assert len(limits.get(f"/v1/sessions/{session['session_id']}")[1]["history"]) == 2


async def test_message_token_limit_counts_the_message_not_the_system_prompt(limits) -> None:
    system = "You are Atlas, the support assistant of the Northwind travel agency. " * 10  # ~150 tokens
    status, created = limits.request("POST", "/v1/sessions", {"system_prompt": system})
    assert status == 201
    async with limits.connect() as ws:
        await hello(ws, session_id=created["id"], resume_token=created["resume_token"])
        await ws.send(json.dumps({"type": "user", "id": "hi", "content": "Hi!",
                                  "params": {"temperature": 0, "max_tokens": 2}}))
        frame = json.loads(await ws.recv())
        if frame["type"] == "start":
            await recv_until(ws, "done")
        assert frame["type"] == "start", frame


async def test_max_tokens_limit(limits) -> None:
    async with limits.connect() as ws:
        await hello(ws)
        await expect_error(ws, {"type": "user", "id": "m", "content": "Hi",
                                "params": {"max_tokens": MAX_TOKENS_LIMIT + 1}}, "too_large")
        await still_open(ws)
    client = openai.OpenAI(base_url=limits.base_url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="m", messages=MSG, max_tokens=MAX_TOKENS_LIMIT + 1)
    assert err.value.status_code == 413 and err.value.response.json()["error"]["code"] == "too_large"
    ok = client.chat.completions.create(model="m", messages=MSG, max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens <= 2


async def test_sessions_per_tenant_limit(limits) -> None:
    assert limits.get("/v1/sessions")[1] == []
    ids = []
    for i in range(SESSION_LIMIT):
        status, created = limits.request("POST", "/v1/sessions", {"title": f"s{i}"})
        assert status == 201
        ids.append(created["id"])
    status, body = limits.request("POST", "/v1/sessions", {"title": "one too many"})
    assert status == 429 and body["error"]["code"] == "busy"
    async with limits.connect() as ws:
        await expect_error(ws, {"type": "hello", "session_id": None, "resume_token": None}, "busy")
        await still_open(ws)
        # Existing sessions still open; deleting one makes room for a new one.
        assert limits.request("DELETE", f"/v1/sessions/{ids[0]}")[0] == 204
        await hello(ws)
    assert len(limits.get("/v1/sessions")[1]) == SESSION_LIMIT


async def test_concurrent_turns_per_tenant_limit(limits) -> None:
    async with limits.connect() as a, limits.connect() as b:
        await hello(a)
        session_b = await hello(b)
        await a.send(json.dumps({"type": "user", "id": "long", "content": "Count from 1 to 300, one per line.",
                                 "params": {"temperature": 0, "max_tokens": MAX_TOKENS_LIMIT,
                                            "ignore_eos": True}}))
        await until_tokens(a, 1)  # A's turn is running, in the engine's one slot
        # Open mode queues B's turn (the second of its bound of two) rather than refusing it.
        await b.send(json.dumps({"type": "user", "id": "b1", "content": "Hi", "params": GREEDY}))
        await recv_until(b, "start")
        resp = raw(limits, "POST", "/v1/chat/completions",
                   json.dumps({"messages": MSG, "max_tokens": 2}).encode(), {"X-Session-Id": session_b["session_id"]})
        assert_error(resp, 429, "busy")  # B's session runs a turn already
        resp = raw(limits, "POST", "/v1/chat/completions", json.dumps({"messages": MSG, "max_tokens": 2}).encode())
        assert_error(resp, 429, "busy")  # a stateless request counts against the tenant's bound too
        assert "max_num_seqs=1 + max_waiting_requests=1" in resp.json()["error"]["message"]
        assert resp.headers["retry-after"] == "1"  # what OpenAI clients wait before retrying
        await a.send(json.dumps({"type": "cancel"}))
        done = (await recv_until(a, "done"))[-1]
        assert done["finish_reason"] == "cancelled"  # so A was still running when the third was refused
        # With A done, B's queued turn runs.
        done_b = (await recv_until(b, "done"))[-1]
        assert done_b["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("origin, allowed", [
    ("http://evil.test", False),
    ("null", False),
    (ALLOWED_ORIGIN + ".evil.test", False),
    (None, True),  # not a browser
    ("self", True),
    (ALLOWED_ORIGIN, True),
])
async def test_websocket_origin_check(limits, origin: str | None, allowed: bool) -> None:
    if origin == "self":
        origin = limits.base_url
    kwargs = {"origin": origin} if origin else {}
    if not allowed:
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with limits.connect(**kwargs):
                pass
        assert refused.value.response.status_code == 403
        return
    async with limits.connect(**kwargs) as ws:
        await still_open(ws)
