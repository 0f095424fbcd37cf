"""What one tenant's sockets may hold (issue 53, deliverable 3), against real keyed servers on loopback with
two tenants: alpha's idle authenticated sockets take at most its share of `max_connections`
(`max_connections_per_tenant`, by default half), so beta's requests and sockets are still served; a socket
with no frame and no turn is closed after `socket_idle_timeout_s`, naming it, and one that pings stays."""

from __future__ import annotations

import asyncio
import json
import os
import time
import types

import httpx
import pytest
import websockets

from tests.server_helpers import create_key, hello, recv_until, start_server

pytestmark = pytest.mark.model
MAX_CONNECTIONS = 30
IDLE_S = 2.0


def keyed_server(tmp_path_factory: pytest.TempPathFactory, name: str, **settings: object):
    data = tmp_path_factory.mktemp(name) / "data"
    data.mkdir()
    cli = types.SimpleNamespace(env={**os.environ, "CHATCORE_DATA_DIR": str(data)})
    keys = {tenant: create_key(cli, tenant) for tenant in ("alpha", "beta")}
    server = start_server(data, **settings)
    server.keys = keys
    return server


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    server = keyed_server(tmp_path_factory, "tenant-sockets", max_connections=MAX_CONNECTIONS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def idling(tmp_path_factory):
    server = keyed_server(tmp_path_factory, "idle-sockets", socket_idle_timeout_s=IDLE_S)
    yield server
    server.stop()


def bearer(server, tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.keys[tenant]}"}


async def answers_ping(ws) -> bool:
    """Whether the socket is served (a pong), or was refused (an error frame, then the close)."""
    try:
        await ws.send(json.dumps({"type": "ping"}))
    except websockets.ConnectionClosed:
        pass  # refused already: its error frame is still there to read
    frame = json.loads(await ws.recv())
    if frame["type"] == "pong":
        return True
    assert frame["code"] == "busy" and "max_connections_per_tenant" in frame["message"], frame
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    return False


async def test_one_tenants_idle_sockets_leave_another_tenant_served(capped):
    share = MAX_CONNECTIONS // 2  # max_connections_per_tenant's default
    sockets = [await websockets.connect(capped.ws_url, additional_headers=bearer(capped, "alpha"))
               for _ in range(MAX_CONNECTIONS - 1)]
    try:
        served = [await answers_ping(ws) for ws in sockets]  # which ones: as their key lookups ended
        assert served.count(True) == share, served
        over = httpx.post(capped.base_url + "/v1/sessions", json={}, headers=bearer(capped, "alpha"), timeout=60)
        assert over.status_code == 429 and "max_connections_per_tenant" in over.json()["error"]["message"]
        created = httpx.post(capped.base_url + "/v1/sessions", json={}, headers=bearer(capped, "beta"), timeout=60)
        assert created.status_code == 201, created.text
        async with websockets.connect(capped.ws_url, additional_headers=bearer(capped, "beta")) as ws:
            assert (await hello(ws))["type"] == "session"
    finally:
        for ws in sockets:
            await ws.close()
    async with asyncio.timeout(60):  # alpha's closes reach the server: its share is free again
        while httpx.get(capped.base_url + "/v1/sessions", headers=bearer(capped, "alpha"),
                        timeout=60).status_code != 200:
            await asyncio.sleep(0.05)  # polling a state with a deadline


async def test_an_idle_socket_is_closed_naming_the_setting_and_one_that_pings_stays(idling):
    headers = bearer(idling, "alpha")
    async with websockets.connect(idling.ws_url, additional_headers=headers) as idle, \
            websockets.connect(idling.ws_url, additional_headers=headers) as pinging:
        opened = time.monotonic()
        closing = asyncio.ensure_future(idle.recv())
        while not closing.done():  # the other pings a few times within each idle period
            await pinging.send(json.dumps({"type": "ping"}))
            assert json.loads(await pinging.recv())["type"] == "pong"
            await asyncio.wait({closing}, timeout=IDLE_S / 4)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            closing.result()
        assert time.monotonic() - opened >= IDLE_S
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4408
        assert "socket_idle_timeout_s" in closed.value.rcvd.reason
        for _ in range(4):  # well past the idle time of the closed one: still served
            await asyncio.sleep(IDLE_S / 2)  # the client's own ping interval, not a synchronisation
            await pinging.send(json.dumps({"type": "ping"}))
            assert json.loads(await pinging.recv())["type"] == "pong"


async def test_a_socket_that_only_reads_a_long_turn_is_not_idle(idling):
    async with websockets.connect(idling.ws_url, additional_headers=bearer(idling, "beta")) as ws:
        await hello(ws)
        started = time.monotonic()
        await ws.send(json.dumps({"type": "user", "id": "long", "content": "Tell me a long story.",
                                  "params": {"max_tokens": 400, "ignore_eos": True, "temperature": 0}}))
        done = (await recv_until(ws, "done"))[-1]
        assert done["finish_reason"] == "length" and time.monotonic() - started > IDLE_S
        await ws.send(json.dumps({"type": "ping"}))  # the turn's end restarted the idle time: still open
        assert json.loads(await ws.recv())["type"] == "pong"
