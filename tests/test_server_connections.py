"""What a client may hold open, and what a `hello` may cost (issue 38, items 6 and 7; issue 47, item 2),
against a real keyed server on loopback: the connection bound (HTTP and WebSocket upgrades), the header
and body deadlines, the per-address bound on sockets waiting for their `auth` frame, and the history
pages and their rate."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import types

import httpx
import pytest
import websockets
import websockets.sync.client

from tests.server_helpers import create_key, recv_until, start_server

pytestmark = pytest.mark.model
MAX_CONNECTIONS = 24
HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 3.0
PENDING_PER_ADDRESS = 3
READS_PER_MINUTE = 5
PAGE = 4


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    data = tmp_path_factory.mktemp("connections") / "data"
    data.mkdir()
    cli = types.SimpleNamespace(env={**os.environ, "CHATCORE_DATA_DIR": str(data)})
    key = create_key(cli, "alpha")
    server = start_server(data, max_connections=MAX_CONNECTIONS, max_connections_per_tenant=MAX_CONNECTIONS,
                          header_timeout_s=HEADER_TIMEOUT_S,
                          body_timeout_s=BODY_TIMEOUT_S,
                          max_unauthenticated_sockets_per_address=PENDING_PER_ADDRESS,
                          max_history_reads_per_minute=READS_PER_MINUTE, history_page_messages=PAGE)
    server.keys = {"alpha": key}
    yield server
    server.stop()


def healthz(server) -> int:
    return httpx.get(server.base_url + "/healthz", timeout=30).status_code


def raw_connection(server, data: bytes) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=30)
    conn.sendall(data)
    return conn


def test_a_connection_with_half_its_headers_is_closed_within_the_header_timeout(guarded):
    partial = [raw_connection(guarded, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ") for _ in range(5)]
    started = time.monotonic()
    try:
        for conn in partial:
            conn.settimeout(HEADER_TIMEOUT_S + 20)
            assert conn.recv(1024) == b""  # closed by the server, with nothing answered
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 20
    finally:
        for conn in partial:
            conn.close()
    # A whole request on a connection of its own is served, and the connection kept alive meanwhile.
    with httpx.Client(base_url=guarded.base_url, timeout=30) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/healthz").status_code == 200


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def body_head(server, path: str, length: int, *extra: bytes) -> bytes:
    """A keyed POST's complete headers, announcing a JSON body of `length` bytes."""
    lines = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: 127.0.0.1",
             b"Authorization: Bearer " + server.keys["alpha"].encode(), b"Content-Type: application/json",
             b"Content-Length: " + str(length).encode(), *extra]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def read_answer(conn: socket.socket, timeout: float) -> tuple[int, dict[str, str], dict]:
    """The status, headers and JSON body of the next HTTP/1.1 answer (with a Content-Length) on `conn`;
    fails (socket.timeout) if none comes within `timeout`."""
    conn.settimeout(timeout)
    received = b""
    while True:
        head, blank, body = received.partition(b"\r\n\r\n")
        if blank:
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            headers = {name.lower(): value.strip() for name, _, value in (h.partition(":") for h in header_lines)}
            if len(body) >= int(headers["content-length"]):
                return int(status_line.split()[1]), headers, json.loads(body)
        chunk = conn.recv(65536)
        assert chunk, f"closed before a whole answer: {received!r}"
        received += chunk


def recv_exactly(conn: socket.socket, size: int, timeout: float) -> bytes:
    conn.settimeout(timeout)
    received = b""
    while len(received) < size and (chunk := conn.recv(size - len(received))):
        received += chunk
    return received


def closed_by_server(conn: socket.socket, timeout: float) -> bool:
    conn.settimeout(timeout)
    return conn.recv(1024) == b""


def test_a_body_that_stops_arriving_gets_408_naming_body_timeout_s_and_the_connection_closes(guarded):
    key = guarded.keys["alpha"]
    # A WebSocket opened before the trickle: its connection outlives the body deadline untouched.
    with websockets.sync.client.connect(guarded.ws_url, additional_headers={"Authorization": f"Bearer {key}"},
                                        open_timeout=30) as ws:
        ws.send(json.dumps({"type": "hello"}))
        assert json.loads(ws.recv(timeout=30))["type"] == "session"
        started = time.monotonic()
        trickle = raw_connection(guarded, body_head(guarded, "/v1/sessions", 1000) + b"{")
        try:
            # Meanwhile a whole request on another connection is answered, the trickle not yet.
            created = httpx.post(guarded.base_url + "/v1/sessions", json={"title": "on time"}, timeout=30,
                                 headers={"Authorization": f"Bearer {key}"})
            assert created.status_code == 201, created.text
            trickle.setblocking(False)
            with pytest.raises(BlockingIOError):
                trickle.recv(1)
            status, headers, body = read_answer(trickle, BODY_TIMEOUT_S + 20)
            waited = time.monotonic() - started
            assert closed_by_server(trickle, 30)
        finally:
            trickle.close()
        assert status == 408 and headers["connection"] == "close"
        assert body["error"]["code"] == "bad_request" and "body_timeout_s" in body["error"]["message"], body
        assert waited >= BODY_TIMEOUT_S - 0.05  # the deadline, not an earlier refusal
        ws.send(json.dumps({"type": "ping"}))
        assert json.loads(ws.recv(timeout=30)) == {"type": "pong"}


def test_a_large_body_that_arrives_in_pieces_within_body_timeout_s_is_served(guarded):
    messages = [m for i in range(200) for m in ({"role": "user", "content": f"question {i} " + "q" * 200},
                                                 {"role": "assistant", "content": f"answer {i} " + "a" * 200})]
    body = json.dumps({"title": "in pieces", "messages": messages}).encode()
    half = len(body) // 2
    conn = raw_connection(guarded, body_head(guarded, "/v1/sessions/import", len(body)) + body[:half])
    try:
        assert healthz(guarded) == 200  # another connection answered while this body is half sent
        conn.sendall(body[half:])
        status, _, imported = read_answer(conn, 120)
    finally:
        conn.close()
    assert status == 201 and imported["turns"] == 200, imported


def test_trickled_bodies_on_every_connection_free_healthz_at_the_body_deadline(guarded):
    # `Expect: 100-continue` makes the server say when its handler starts reading each body: then every
    # one of these connections is open and counted, with no sleep to wait for it.
    trickles = [raw_connection(guarded, body_head(guarded, "/v1/sessions", 1000, b"Expect: 100-continue") + b"{")
                for _ in range(MAX_CONNECTIONS - 1)]
    try:
        for conn in trickles:
            assert recv_exactly(conn, len(CONTINUE), 30) == CONTINUE
        assert healthz(guarded) == 503  # the last place is /healthz's own connection: the server is full
        for conn in trickles:
            status, _, body = read_answer(conn, BODY_TIMEOUT_S + 20)
            assert status == 408 and "body_timeout_s" in body["error"]["message"], body
            assert closed_by_server(conn, 30)
    finally:
        for conn in trickles:
            conn.close()
    assert healthz(guarded) == 200


async def test_connections_past_max_connections_get_503_http_and_websocket(guarded):
    key = guarded.keys["alpha"]
    headers = {"Authorization": f"Bearer {key}"}
    held = []
    try:
        while len(held) < MAX_CONNECTIONS:  # authenticated sockets: each one holds a connection
            try:
                held.append(await websockets.connect(guarded.ws_url, additional_headers=headers))
            except websockets.InvalidStatus as refused:
                assert refused.response.status_code == 503
                break
        assert MAX_CONNECTIONS // 2 <= len(held) < MAX_CONNECTIONS
        assert healthz(guarded) == 503
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(guarded.ws_url, additional_headers=headers)
        assert refused.value.response.status_code == 503
    finally:
        for ws in held:
            await ws.close()
    async with asyncio.timeout(30):
        while healthz(guarded) != 200:  # the closes reach the server
            await asyncio.sleep(0.05)  # polling a state with a deadline
    async with websockets.connect(guarded.ws_url, additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "hello"}))
        assert json.loads(await ws.recv())["type"] == "session"


async def test_sockets_waiting_for_their_auth_frame_are_bounded_per_address(guarded):
    key = guarded.keys["alpha"]
    waiting = [await websockets.connect(guarded.ws_url) for _ in range(PENDING_PER_ADDRESS + 1)]
    try:
        # One of them (the last counted) is refused at once; the others wait for their auth frame.
        receivers = {asyncio.ensure_future(ws.recv()): ws for ws in waiting}
        done, pending = await asyncio.wait(receivers, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1
        refused_task = done.pop()
        frame = json.loads(refused_task.result())
        assert frame["code"] == "busy" and "max_unauthenticated_sockets_per_address" in frame["message"], frame
        refused = receivers.pop(refused_task)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await refused.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

        # A client whose upgrade carries its key waits for nothing: served from the same address.
        async with websockets.connect(guarded.ws_url, additional_headers={"Authorization": f"Bearer {key}"}) as ws:
            await ws.send(json.dumps({"type": "hello"}))
            assert json.loads(await ws.recv())["type"] == "session"

        # The waiting ones authenticate and are served; that frees the address's places.
        others = list(receivers.values())
        for ws in others:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            await ws.send(json.dumps({"type": "hello"}))
            assert json.loads(await ws.recv())["type"] == "session"
        async with websockets.connect(guarded.ws_url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            await ws.send(json.dumps({"type": "hello"}))
            assert json.loads(await ws.recv())["type"] == "session"
    finally:
        for ws in waiting:
            await ws.close()


def import_exchanges(server, count: int) -> dict:
    messages = [m for i in range(count) for m in ({"role": "user", "content": f"question {i}"},
                                                   {"role": "assistant", "content": f"answer {i}"})]
    resp = httpx.post(server.base_url + "/v1/sessions/import", json={"messages": messages}, timeout=120,
                      headers={"Authorization": f"Bearer {server.keys['alpha']}"})
    assert resp.status_code == 201, resp.text
    return resp.json()


async def test_hello_sends_the_last_page_of_a_long_history_and_history_frames_the_earlier_ones(guarded):
    key = guarded.keys["alpha"]
    body = import_exchanges(guarded, 5)
    whole = [m for i in range(5) for m in ({"role": "user", "content": f"question {i}"},
                                           {"role": "assistant", "content": f"answer {i}"})]
    async with guarded.connect(key) as ws:
        await ws.send(json.dumps({"type": "history", "before": 0}))
        frame = json.loads(await ws.recv())
        assert frame["code"] == "bad_request" and "hello" in frame["message"], frame
        await ws.send(json.dumps({"type": "hello", "session_id": body["id"], "resume_token": body["resume_token"]}))
        session = json.loads(await ws.recv())
        assert session["type"] == "session"
        assert session["history"] == whole[6:] and session["history_start"] == 6
        pages = [session["history"]]
        start = session["history_start"]
        while start > 0:
            await ws.send(json.dumps({"type": "history", "before": start}))
            page = json.loads(await ws.recv())
            assert page["type"] == "history" and 0 < len(page["history"]) <= PAGE, page
            assert page["history_start"] == start - len(page["history"])
            pages.insert(0, page["history"])
            start = page["history_start"]
        assert [m for page in pages for m in page] == whole
        for bad in ({"type": "history", "before": 11}, {"type": "history", "before": -1},
                    {"type": "history", "before": 2, "after": 0}, {"type": "history"}):
            await ws.send(json.dumps(bad))
            frame = json.loads(await ws.recv())
            assert frame["type"] == "error" and frame["code"] == "bad_request", (bad, frame)
        # hello, then two pages: three reads of five this minute. Two more, then busy, and the socket stays.
        for _ in range(2):
            await ws.send(json.dumps({"type": "history", "before": 10}))
            assert json.loads(await ws.recv())["type"] == "history"
        for kind in ({"type": "history", "before": 10},
                     {"type": "hello", "session_id": body["id"], "resume_token": body["resume_token"]}):
            await ws.send(json.dumps(kind))
            frame = json.loads(await ws.recv())
            assert frame["code"] == "busy" and "max_history_reads_per_minute" in frame["message"], frame
            assert str(READS_PER_MINUTE) in frame["message"]
        await ws.send(json.dumps({"type": "ping"}))
        assert (await recv_until(ws, "pong"))[-1] == {"type": "pong"}
