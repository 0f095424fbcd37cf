"""Keyed mode, tenant isolation on every route and on the WebSocket, open mode, and the cache scope,
against real server processes (keys are made with `chatcore keys create` before each server starts)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import types
import uuid

import httpx
import openai
import pytest
import websockets

from tests.server_helpers import SYSTEM, create_key, hello, recv_until, start_server

pytestmark = pytest.mark.model
BLOCK = 16
MSG = [{"role": "user", "content": "Hi"}]


def keyed_server(data_dir, **settings):
    """A server whose database holds keys for tenants `ops` (admin), `alpha` and `beta` before it starts,
    so it is in keyed mode from its first request."""
    data_dir.mkdir(parents=True, exist_ok=True)
    cli = types.SimpleNamespace(env={**os.environ, "CHATCORE_DATA_DIR": str(data_dir)})
    keys = {"ops": create_key(cli, "ops", admin=True), "alpha": create_key(cli, "alpha"),
            "beta": create_key(cli, "beta")}
    server = start_server(data_dir, **settings)
    server.keys = keys
    server.admin_key = keys["ops"]
    return server


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """Keyed mode with the default cache scope: per tenant."""
    server = keyed_server(tmp_path_factory.mktemp("keyed-tenant-scope"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed_global(tmp_path_factory):
    """Keyed mode with the prefix cache shared across tenants (an explicit choice)."""
    server = keyed_server(tmp_path_factory.mktemp("keyed-global-scope"), cache_scope="global")
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def audit_after(request):
    yield
    for name in ("keyed", "keyed_global", "live_server"):
        if name in request.fixturenames:
            server = request.getfixturevalue(name)
            status, body = server.get("/v1/admin/cache", key=server.admin_key)
            assert status == 200 and body["audit"]["ok"], body["audit"]


def call(server, method: str, path: str, body=None, headers: dict | None = None) -> httpx.Response:
    return httpx.request(method, server.base_url + path, json=body, headers=headers or {}, timeout=60)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.json()["error"]["code"] == code, resp.text




async def first_turn(server, key: str, system: str, question: str) -> dict:
    async with server.connect(key) as ws:
        await hello(ws, system_prompt=system)
        await ws.send(json.dumps({"type": "user", "id": "q", "content": question,
                                  "params": {"temperature": 0, "max_tokens": 2}}))
        return (await recv_until(ws, "done"))[-1]["usage"]


async def expect_unauthorized_close(ws) -> None:
    frame = json.loads(await ws.recv())
    assert frame["type"] == "error" and frame["code"] == "unauthorized", frame
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await ws.recv()
    assert closed.value.rcvd.code == 1008


def create_session(server, key: str, title: str) -> dict:
    resp = call(server, "POST", "/v1/sessions", {"title": title}, bearer(key))
    assert resp.status_code == 201, resp.text
    return resp.json()


# ----- keyed mode ----------------------------------------------------------------------------------

def test_every_protected_route_needs_a_valid_key(keyed) -> None:
    session = create_session(keyed, keyed.keys["alpha"], "alpha's")
    sid = session["id"]
    routes = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 1}),
              ("GET", "/v1/sessions", None), ("POST", "/v1/sessions", {"title": "intruder"}),
              ("GET", f"/v1/sessions/{sid}", None), ("PATCH", f"/v1/sessions/{sid}", {"title": "hijacked"}),
              ("POST", f"/v1/sessions/{sid}/token", None), ("DELETE", f"/v1/sessions/{sid}", None),
              ("GET", "/v1/admin/cache", None), ("GET", "/schema/openapi.json", None)]
    wrong = [{}, bearer("cc-not-a-real-key"), {"Authorization": "Bearer"},
             {"Authorization": f"Basic {keyed.keys['alpha']}"}, {"Authorization": keyed.keys["alpha"]}]
    for method, path, body in routes:
        for headers in wrong:
            assert_error(call(keyed, method, path, body, headers), 401, "unauthorized")
        assert_error(call(keyed, method, path + "?api_key=cc-not-a-real-key", body), 401, "unauthorized")
    # The key is checked before the body is read: a bad or oversized body without a key is still 401.
    for path in ("/v1/chat/completions", "/v1/sessions"):
        for body in (b"{bad json", b"[1]", b"x" * (2 << 20)):
            resp = httpx.post(keyed.base_url + path, content=body, headers={"Content-Type": "application/json"})
            assert_error(resp, 401, "unauthorized")
    # Nothing happened to the session.
    resp = call(keyed, "GET", f"/v1/sessions/{sid}", headers=bearer(keyed.keys["alpha"]))
    assert resp.status_code == 200 and resp.json()["title"] == "alpha's"
    assert [s["title"] for s in call(keyed, "GET", "/v1/sessions", headers=bearer(keyed.keys["alpha"])).json()
            if s["title"] == "intruder"] == []
    # The query parameter is accepted over HTTP too, and the open routes stay open.
    resp = call(keyed, "GET", f"/v1/sessions/{sid}?api_key={keyed.keys['alpha']}")
    assert resp.status_code == 200 and resp.json()["id"] == sid
    for path in ("/healthz", "/"):
        assert call(keyed, "GET", path).status_code == 200, path
    assert_error(call(keyed, "GET", "/metrics"), 401, "unauthorized")  # metrics_auth=key, the default
    schema = call(keyed, "GET", "/schema/openapi.json", headers=bearer(keyed.keys["beta"]))
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]
    assert call(keyed, "DELETE", f"/v1/sessions/{sid}", headers=bearer(keyed.keys["alpha"])).status_code == 204


def test_openai_client_needs_the_key(keyed) -> None:
    bad = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key="anything", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.chat.completions.create(model="m", messages=MSG, max_tokens=1)
    assert err.value.status_code == 401 and err.value.response.json()["error"]["code"] == "unauthorized"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=keyed.base_url + "/v1", api_key=keyed.keys["beta"], max_retries=0)
    answer = good.chat.completions.create(model="m", messages=MSG, max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens <= 2 and answer.choices[0].message.content
    assert len(good.models.list().data) == 1


async def test_websocket_needs_a_key(keyed) -> None:
    async with keyed.connect("cc-not-a-real-key") as ws:
        await expect_unauthorized_close(ws)
    async with keyed.connect(None) as ws:  # no key on the upgrade: the first frame must be `auth`
        await ws.send(json.dumps({"type": "hello"}))
        await expect_unauthorized_close(ws)
    async with keyed.connect(key=None, additional_headers=bearer("cc-not-a-real-key")) as ws:
        await expect_unauthorized_close(ws)
    async with keyed.connect(keyed.keys["alpha"]) as ws:  # ?api_key=
        session = await hello(ws, title="ws")
    async with keyed.connect(key=None, additional_headers=bearer(keyed.keys["alpha"])) as ws:
        resumed = await hello(ws, session_id=session["session_id"], resume_token=session["resume_token"])
        assert resumed["title"] == "ws"
    assert call(keyed, "DELETE", f"/v1/sessions/{session['session_id']}",
                headers=bearer(keyed.keys["alpha"])).status_code == 204


def test_tenant_isolation_over_http(keyed) -> None:
    alpha, beta = bearer(keyed.keys["alpha"]), bearer(keyed.keys["beta"])
    session = create_session(keyed, keyed.keys["alpha"], "alpha only")
    sid = session["id"]
    own = create_session(keyed, keyed.keys["beta"], "beta's own")
    assert_error(call(keyed, "GET", f"/v1/sessions/{sid}", headers=beta), 404, "not_found")
    assert_error(call(keyed, "PATCH", f"/v1/sessions/{sid}", {"title": "mine now"}, beta), 404, "not_found")
    assert_error(call(keyed, "POST", f"/v1/sessions/{sid}/token", headers=beta), 404, "not_found")
    assert_error(call(keyed, "DELETE", f"/v1/sessions/{sid}", headers=beta), 404, "not_found")
    assert_error(call(keyed, "POST", "/v1/chat/completions", {"messages": MSG, "max_tokens": 1},
                      {**beta, "X-Session-Id": sid}), 404, "not_found")
    listed = call(keyed, "GET", "/v1/sessions", headers=beta).json()
    assert own["id"] in [s["id"] for s in listed] and sid not in [s["id"] for s in listed]
    assert own["id"] not in [s["id"] for s in call(keyed, "GET", "/v1/sessions", headers=alpha).json()]
    # Alpha's session is untouched: same title, no turn, and its resume token still works.
    detail = call(keyed, "GET", f"/v1/sessions/{sid}", headers=alpha).json()
    assert detail["title"] == "alpha only" and detail["history"] == []
    for key, item in ((alpha, sid), (beta, own["id"])):
        assert call(keyed, "DELETE", f"/v1/sessions/{item}", headers=key).status_code == 204


async def test_tenant_isolation_on_the_websocket(keyed) -> None:
    async with keyed.connect(keyed.keys["alpha"]) as alpha_ws:
        session = await hello(alpha_ws, title="alpha ws")
        async with keyed.connect(keyed.keys["beta"]) as beta_ws:
            await beta_ws.send(json.dumps({"type": "hello", "session_id": session["session_id"],
                                           "resume_token": session["resume_token"], "last_seq": 0}))
            frame = json.loads(await beta_ws.recv())
            assert frame["type"] == "error" and frame["code"] == "not_found", frame
            await beta_ws.send(json.dumps({"type": "ping"}))
            assert json.loads(await beta_ws.recv()) == {"type": "pong"}  # the socket stays open
        # Alpha was not taken over: its socket still holds the session and runs turns.
        await alpha_ws.send(json.dumps({"type": "user", "id": "a", "content": "Hi",
                                        "params": {"temperature": 0, "max_tokens": 2}}))
        frames = await recv_until(alpha_ws, "done")
        assert all(f["type"] != "error" for f in frames) and frames[-1]["finish_reason"] in ("stop", "length")
    assert call(keyed, "DELETE", f"/v1/sessions/{session['session_id']}",
                headers=bearer(keyed.keys["alpha"])).status_code == 204


def test_admin_routes_need_an_admin_key(keyed) -> None:
    for tenant in ("alpha", "beta"):
        assert_error(call(keyed, "GET", "/v1/admin/cache", headers=bearer(keyed.keys[tenant])), 401, "unauthorized")
    resp = call(keyed, "GET", "/v1/admin/cache", headers=bearer(keyed.admin_key))
    assert resp.status_code == 200 and resp.json()["audit"]["ok"]
    pool = resp.json()["tiers"]["device"]  # the engine's device, dtype and pool size, as the startup line says
    assert pool["device"] == "cpu" and pool["model_dtype"] in ("float32", "bfloat16") and pool["blocks"] > 0
    assert f"on cpu in {pool['model_dtype']}; KV tiers: device pool" in keyed.log()


# ----- cache scope ---------------------------------------------------------------------------------

async def test_tenant_scope_keeps_prefix_caches_apart(keyed) -> None:
    system = f"Conversation {uuid.uuid4().hex}. {SYSTEM}"
    first = await first_turn(keyed, keyed.keys["alpha"], system, "When are you open?")
    again = await first_turn(keyed, keyed.keys["alpha"], system, "Can I get a refund?")
    other = await first_turn(keyed, keyed.keys["beta"], system, "When are you open?")
    system_blocks = (first["prompt_tokens"] - 20) // BLOCK
    assert first["cached_tokens"] == 0
    assert again["cached_tokens"] >= system_blocks * BLOCK > 0  # the same tenant's second session hits
    assert other["cached_tokens"] == 0  # another tenant's identical prompt does not
    assert other["prompt_tokens"] == first["prompt_tokens"]


async def test_global_scope_shares_across_tenants(keyed_global) -> None:
    system = f"Conversation {uuid.uuid4().hex}. {SYSTEM}"
    first = await first_turn(keyed_global, keyed_global.keys["alpha"], system, "When are you open?")
    other = await first_turn(keyed_global, keyed_global.keys["beta"], system, "Can I get a refund?")
    assert first["cached_tokens"] == 0
    assert other["cached_tokens"] >= ((first["prompt_tokens"] - 20) // BLOCK) * BLOCK > 0


# ----- open mode (the shared server has no keys) ---------------------------------------------------

async def test_a_browser_sends_its_key_in_a_first_frame_not_the_url(keyed) -> None:
    alpha = keyed.keys["alpha"]
    async with keyed.connect(None) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": alpha}))
        session = await hello(ws, title="first frame")
        await ws.send(json.dumps({"type": "auth", "api_key": alpha}))  # only as the first frame
        assert json.loads(await ws.recv())["code"] == "bad_request"
    for frame in ({"type": "auth", "api_key": "cc-not-a-real-key"}, {"type": "auth"}, {"type": "auth", "api_key": 7},
                  {"type": "auth", "api_key": "x" * 300}, "not json"):
        async with keyed.connect(None) as ws:
            await ws.send(frame if isinstance(frame, str) else json.dumps(frame))
            await expect_unauthorized_close(ws)
    async with keyed.connect(None) as ws:  # the session is the tenant's: another tenant's key finds nothing
        await ws.send(json.dumps({"type": "auth", "api_key": keyed.keys["beta"]}))
        await ws.send(json.dumps({"type": "hello", "session_id": session["session_id"],
                                  "resume_token": session["resume_token"]}))
        assert json.loads(await ws.recv())["code"] == "not_found"
    assert call(keyed, "DELETE", f"/v1/sessions/{session['session_id']}", headers=bearer(alpha)).status_code == 204


async def test_open_mode_ignores_any_key(live_server) -> None:
    for headers in (bearer("anything"), {"Authorization": "Basic Zm9vOmJhcg=="}, {}):
        resp = call(live_server, "GET", "/v1/sessions", headers=headers)
        assert resp.status_code == 200 and isinstance(resp.json(), list)
    assert call(live_server, "GET", "/v1/admin/cache?api_key=garbage").status_code == 200  # local is admin
    client = openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="anything", max_retries=0)
    assert client.chat.completions.create(model="m", messages=MSG, max_tokens=1, temperature=0).choices
    async with live_server.connect("garbage") as ws:
        session = await hello(ws)
    async with live_server.connect() as ws:  # a UI that keeps a key from elsewhere sends it anyway
        await ws.send(json.dumps({"type": "auth", "api_key": "garbage"}))
        assert (await hello(ws, session_id=session["session_id"], resume_token=session["resume_token"]))["title"] == ""
    assert live_server.request("DELETE", f"/v1/sessions/{session['session_id']}")[0] == 204


def test_the_first_key_switches_a_running_server_to_keyed_mode(tmp_path) -> None:
    """`chatcore keys create` on a running open-mode server: a request that presents the new key is
    served as its tenant at once (never as the local tenant), and keyless requests are refused once
    the server re-checks (every `OPEN_MODE_RECHECK_S`)."""
    from chatcore.server.auth import OPEN_MODE_RECHECK_S
    from tests.server_helpers import wait_for_status

    server = start_server(tmp_path / "switch")
    try:
        assert call(server, "GET", "/v1/sessions").status_code == 200  # open: caches the answer
        carol = create_key(server, "carol")
        created = call(server, "POST", "/v1/sessions", {"title": "carol's"}, headers=bearer(carol))
        assert created.status_code == 201
        mine = call(server, "GET", "/v1/sessions", headers=bearer(carol)).json()
        assert [s["id"] for s in mine] == [created.json()["id"]]
        wait_for_status(server, "/v1/sessions", 401, deadline_s=OPEN_MODE_RECHECK_S + 10)
    finally:
        server.stop()


async def test_a_revoked_key_loses_its_open_websockets_and_its_requests(keyed) -> None:
    from chatcore.server.auth import REVOKE_CHECK_S

    key = create_key(keyed, "gamma")
    async with keyed.connect(key) as ws:
        await hello(ws, title="soon revoked")
        listed = subprocess.run([sys.executable, "-m", "chatcore.cli", "keys", "list", "--tenant", "gamma"],
                                env=keyed.env, capture_output=True, text=True, check=True, timeout=60)
        key_id = listed.stdout.split()[0]
        subprocess.run([sys.executable, "-m", "chatcore.cli", "keys", "revoke", key_id], env=keyed.env,
                       capture_output=True, text=True, check=True, timeout=60)
        # The server notices on its own clock: the socket gets `unauthorized`, then 1008.
        frame = json.loads(await asyncio.wait_for(ws.recv(), timeout=REVOKE_CHECK_S * 5))
        assert frame["type"] == "error" and frame["code"] == "unauthorized", frame
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), timeout=REVOKE_CHECK_S * 5)
        assert closed.value.rcvd.code == 1008
    assert call(keyed, "GET", "/v1/sessions", headers=bearer(key)).status_code == 401
