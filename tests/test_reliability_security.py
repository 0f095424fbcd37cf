"""Security checks (issue 9, item 6), against a keyed server (tenants `ops` (admin), `alpha`, `beta`) with the
prefix cache scoped per tenant (the default) and the disk tier on.

Beyond tests/test_server_auth.py (fixed route list, one isolation case each): every route the OpenAPI schema
lists needs a key; nothing of one tenant (sessions, titles, block map entries, metric labels, prefix hits)
reaches another; resume tokens are long, random, bound to their session, and die on rotation; the Origin
check refuses look-alikes, on the WebSocket and (cross-site requests) over HTTP; no secret reaches the server
log; and no input steers a disk-tier file path.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import sqlite3
import types
import urllib.parse
import uuid

import httpx
import pytest
import websockets

from tests.reliability_helpers import (
    GREEDY,
    SHARED_SYSTEM,
    Chat,
    cache,
    log_problems,
    report,
    wait_for,
)
from tests.server_helpers import create_key, start_server

pytestmark = pytest.mark.model
ALLOWED_ORIGIN = "https://chat.example.com"
OPEN_ROUTES = {"/healthz", "/readyz"}  # /metrics needs a key in keyed mode (metrics_auth=key, the default)
TOKEN_CHARS = re.compile(r"^[A-Za-z0-9_-]{43,}$")  # url-safe base64 of at least 256 bits
BLOCK_FILE = re.compile(r"^kv/[0-9a-f]{2}/[0-9a-f]{32}\.kvb$")
FIGURES: dict[str, object] = {}


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    root = tmp_path_factory.mktemp("secure")
    data = root / "data"
    data.mkdir()
    cli = types.SimpleNamespace(env={**os.environ, "CHATCORE_DATA_DIR": str(data)})
    keys = {"ops": create_key(cli, "ops", admin=True), "alpha": create_key(cli, "alpha"),
            "beta": create_key(cli, "beta")}
    server = start_server(data, allowed_origins=json.dumps([ALLOWED_ORIGIN]),  # the default cache scope
                          hot_window_s=600, max_tokens_limit=64)
    server.keys, server.admin_key = keys, keys["ops"]
    server.root = root
    yield server
    server.stop()


def call(server, method: str, path: str, key: str | None = None, body=None, headers=None) -> httpx.Response:
    headers = dict(headers or {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=120)


def assert_error(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.json()["error"]["code"] == code, resp.text


async def ws_frames(server, hello: dict, key: str | None = None, **connect) -> tuple[list[dict], int | None]:
    """The answer to one `hello` (and the close code, if the server closed the socket)."""
    url = server.ws_url + (f"?api_key={key}" if key else "")
    frames: list[dict] = []
    async with websockets.connect(url, max_size=None, **connect) as ws:
        try:
            await ws.send(json.dumps({"type": "hello", "session_id": None, "resume_token": None, **hello}))
        except websockets.ConnectionClosed:
            pass  # an unauthorized socket may be closed already; its error frame is still to be read
        try:
            async with asyncio.timeout(60):
                frames.append(json.loads(await ws.recv()))
                await ws.send(json.dumps({"type": "ping"}))
                frames.append(json.loads(await ws.recv()))
        except websockets.ConnectionClosed as closed:
            return frames, closed.rcvd.code if closed.rcvd else None
    return frames, None


# ----- keys on every route ---------------------------------------------------------------------------

def test_every_route_in_the_schema_needs_a_key(secure) -> None:
    sid = call(secure, "POST", "/v1/sessions", secure.keys["alpha"], {"title": "alpha keyed"}).json()["id"]
    schema = call(secure, "GET", "/schema/openapi.json", secure.keys["beta"]).json()
    wrong = [{}, {"Authorization": "Bearer cc_" + secrets.token_urlsafe(32)}, {"Authorization": "Bearer"},
             {"Authorization": f"Basic {secure.keys['alpha']}"}, {"Authorization": secure.keys["alpha"]},
             {"Authorization": f"Bearer {secure.keys['alpha']}x"},
             {"Authorization": f"Bearer {secure.keys['alpha'][:-1]}"}]
    checked = 0
    for path, methods in schema["paths"].items():
        if path in OPEN_ROUTES:
            continue
        concrete = path.replace("{session_id}", sid).replace("{path}", "openapi.json")
        for method in methods:
            for headers in wrong:
                body = {"title": "x"} if method in ("post", "patch") else None
                assert_error(call(secure, method.upper(), concrete, body=body, headers=headers), 401, "unauthorized")
                checked += 1
            assert_error(call(secure, method.upper(), concrete + "?api_key=nope"), 401, "unauthorized")
    for tenant in ("alpha", "beta"):
        assert_error(call(secure, "GET", "/v1/admin/cache", secure.keys[tenant]), 401, "unauthorized")
    # The session was not touched by any of it.
    detail = call(secure, "GET", f"/v1/sessions/{sid}", secure.keys["alpha"]).json()
    assert detail["title"] == "alpha keyed" and detail["history"] == []
    FIGURES["route x credential refusals"] = checked
    FIGURES["schema routes checked"] = sum(len(m) for p, m in schema["paths"].items() if p not in OPEN_ROUTES)


# ----- tenant isolation ------------------------------------------------------------------------------

async def test_no_tenant_sees_anything_of_another(secure) -> None:
    marker = uuid.uuid4().hex
    system = f"{SHARED_SYSTEM} Case {marker}."
    sessions: dict[str, list[Chat]] = {"alpha": [], "beta": []}
    first_cached: dict[str, list[int]] = {"alpha": [], "beta": []}
    for tenant in ("alpha", "alpha", "beta", "beta"):
        chat = Chat(secure, secure.keys[tenant])
        await chat.hello(system_prompt=system, title=f"{tenant}-secret-title-{marker}")
        turn = await chat.turn(f"{tenant} asks: when are you open?", {**GREEDY, "max_tokens": 4})
        assert turn.done and turn.done["finish_reason"] in ("stop", "length"), turn.frames
        first_cached[tenant].append(turn.done["usage"]["cached_tokens"])
        sessions[tenant].append(chat)
    # The tenant scope: a tenant's second session hits its own cached prompt; the other tenant's first one
    # gets nothing from the identical prompt another tenant cached.
    assert first_cached["alpha"][0] == 0 and first_cached["alpha"][1] > 0, first_cached
    assert first_cached["beta"][0] == 0 and first_cached["beta"][1] > 0, first_cached
    alpha_ids = {c.session_id for c in sessions["alpha"]}
    beta_ids = {c.session_id for c in sessions["beta"]}
    beta_key, alpha_key = secure.keys["beta"], secure.keys["alpha"]
    # Every session route, as beta, on alpha's sessions: not_found, with nothing of alpha's in the answer.
    for sid in alpha_ids:
        for method, path, body in (("GET", f"/v1/sessions/{sid}", None), ("PATCH", f"/v1/sessions/{sid}",
                                   {"title": "mine"}), ("POST", f"/v1/sessions/{sid}/token", None),
                                   ("DELETE", f"/v1/sessions/{sid}", None)):
            resp = call(secure, method, path, beta_key, body)
            assert_error(resp, 404, "not_found")
            assert marker not in resp.text and "alpha" not in resp.text
        resp = call(secure, "POST", "/v1/chat/completions", beta_key, {"messages": [{"role": "user", "content": "hi"}],
                                                                       "max_tokens": 1}, {"X-Session-Id": sid})
        assert_error(resp, 404, "not_found")
        chat = next(c for c in sessions["alpha"] if c.session_id == sid)
        frames, _ = await ws_frames(secure, {"session_id": sid, "resume_token": chat.resume_token, "last_seq": 0},
                                    key=beta_key)
        assert frames[0]["type"] == "error" and frames[0]["code"] == "not_found", frames
        assert marker not in json.dumps(frames)
    listed = call(secure, "GET", "/v1/sessions", beta_key).json()
    assert {s["id"] for s in listed} >= beta_ids and not {s["id"] for s in listed} & alpha_ids
    assert marker not in json.dumps([s for s in listed if s["id"] not in beta_ids])
    # Alpha's sessions are intact (nobody renamed, rotated or deleted them).
    for chat in sessions["alpha"]:
        detail = call(secure, "GET", f"/v1/sessions/{chat.session_id}", alpha_key).json()
        assert detail["title"].startswith("alpha-secret-title") and len(detail["history"]) == 2
    # The block map (admin): no block is mapped by sessions of two tenants.
    owner = {sid: "alpha" for sid in alpha_ids} | {sid: "beta" for sid in beta_ids}
    block_map = cache(secure)
    shared = [b for b in block_map["blocks"] if len({owner.get(s, s) for s in b["sessions"]}) > 1]
    assert not shared, shared[:5]
    per_tenant = {t: {b for s in block_map["sessions"] if owner.get(s["id"]) == t for b in s["blocks"]}
                  for t in ("alpha", "beta")}
    assert per_tenant["alpha"] and per_tenant["beta"] and not per_tenant["alpha"] & per_tenant["beta"]
    # /metrics (any tenant's key may scrape it): its labels say nothing of tenants, sessions, titles or prompts.
    scraped = await asyncio.to_thread(call, secure, "GET", "/metrics", beta_key)
    assert scraped.status_code == 200, scraped.text
    text = scraped.text
    for secret in [marker, "alpha", "beta", *alpha_ids, *beta_ids, *secure.keys.values()]:
        assert secret not in text, secret
    labels = set(re.findall(r"[{,]([a-zA-Z_]+)=", text))
    assert labels <= {"tier", "state", "finish_reason", "le"}, labels
    for chat in sessions["alpha"] + sessions["beta"]:
        await chat.close()
    FIGURES["cross-tenant probes (http + ws)"] = len(alpha_ids) * 6
    FIGURES["cross-tenant prefix hits"] = 0
    FIGURES["blocks shared across tenants"] = len(shared)


# ----- resume tokens ---------------------------------------------------------------------------------

async def test_resume_tokens_cannot_be_guessed_or_reused(secure) -> None:
    alpha = secure.keys["alpha"]
    created = [call(secure, "POST", "/v1/sessions", alpha, {"title": f"t{i}"}).json() for i in range(20)]
    tokens = [c["resume_token"] for c in created]
    assert len(set(tokens)) == len(tokens) and all(TOKEN_CHARS.match(t) for t in tokens), tokens[:3]
    a, b = created[0], created[1]
    token = a["resume_token"]
    flipped = token[:5] + ("A" if token[5] != "A" else "B") + token[6:]
    attempts = [b["resume_token"], token[:-1], token + "x", flipped, token.swapcase(), "", " " + token,
                hashlib.sha256(token.encode()).hexdigest(), None] + [secrets.token_urlsafe(32) for _ in range(50)]
    for guess in attempts:
        frames, code = await ws_frames(secure, {"session_id": a["id"], "resume_token": guess}, key=alpha)
        assert frames and frames[0]["type"] == "error" and frames[0]["code"] == "unauthorized", (guess, frames)
        assert code == 1008
    # Another tenant holding the right token learns nothing: not_found, as for a session that does not exist.
    frames, _ = await ws_frames(secure, {"session_id": a["id"], "resume_token": token}, key=secure.keys["beta"])
    assert frames[0]["code"] == "not_found"
    frames, code = await ws_frames(secure, {"session_id": a["id"], "resume_token": token}, key=alpha)
    assert frames[0]["type"] == "session" and frames[0]["session_id"] == a["id"] and code is None
    # Rotation: the old token stops working, the new one works.
    rotated = call(secure, "POST", f"/v1/sessions/{a['id']}/token", alpha).json()["resume_token"]
    assert TOKEN_CHARS.match(rotated) and rotated != token
    frames, code = await ws_frames(secure, {"session_id": a["id"], "resume_token": token}, key=alpha)
    assert frames[0]["code"] == "unauthorized" and code == 1008
    frames, _ = await ws_frames(secure, {"session_id": a["id"], "resume_token": rotated}, key=alpha)
    assert frames[0]["type"] == "session"
    for c in created:
        assert call(secure, "DELETE", f"/v1/sessions/{c['id']}", alpha).status_code == 204
    FIGURES["resume-token guesses and reuses refused"] = len(attempts) + 2


# ----- origins ----------------------------------------------------------------------------------------

async def test_origin_check_refuses_look_alikes(secure) -> None:
    port = urllib.parse.urlsplit(secure.base_url).port
    refused = [f"http://localhost:{port}", f"http://127.0.0.1:{port + 1}", f"http://127.0.0.1:{port}.evil.test",
               f"http://127.0.0.1:{port}@evil.test", f"http://evil.test/http://127.0.0.1:{port}",
               ALLOWED_ORIGIN + ".evil.test", "http://chat.example.com", ALLOWED_ORIGIN + ":8443", "null",
               "file://", f"http://[::1]:{port}"]
    for origin in refused:
        with pytest.raises(websockets.InvalidStatus) as denied:
            async with websockets.connect(secure.ws_url + f"?api_key={secure.keys['alpha']}", origin=origin):
                pass
        assert denied.value.response.status_code == 403, origin
    for origin in (secure.base_url, ALLOWED_ORIGIN, None):
        kwargs = {"origin": origin} if origin else {}
        frames, code = await ws_frames(secure, {}, key=secure.keys["alpha"], **kwargs)
        assert frames[0]["type"] == "session" and code is None, (origin, frames)
        deleted = call(secure, "DELETE", f"/v1/sessions/{frames[0]['session_id']}", secure.keys["alpha"])
        assert deleted.status_code == 204
        # An allowed origin is no key: without one, still unauthorized.
        frames, code = await ws_frames(secure, {}, **kwargs)
        assert frames[0]["code"] == "unauthorized" and code == 1008
    FIGURES["look-alike origins refused"] = len(refused)


def test_cross_site_http_requests_are_refused(secure) -> None:
    """Browsers send `text/plain` POSTs cross-site without a CORS preflight: the Origin rule of the WebSocket
    applies to HTTP too, before the body is read (in open mode any web page could otherwise drive the server)."""
    alpha = secure.keys["alpha"]
    port = urllib.parse.urlsplit(secure.base_url).port
    before = {s["id"] for s in call(secure, "GET", "/v1/sessions", alpha).json()}
    refused = 0
    for origin in ("http://evil.test", "null", f"http://localhost:{port}", ALLOWED_ORIGIN + ".evil.test"):
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "application/json"):
            headers = {"Origin": origin, "Content-Type": content_type, "Authorization": f"Bearer {alpha}"}
            for path, body in (("/v1/sessions", '{"title": "csrf"}'),
                               ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}]}')):
                resp = httpx.post(secure.base_url + path, content=body, headers=headers, timeout=60)
                assert_error(resp, 403, "unauthorized")
                refused += 1
    assert {s["id"] for s in call(secure, "GET", "/v1/sessions", alpha).json()} == before
    for origin in (secure.base_url, ALLOWED_ORIGIN, None):
        headers = {"Origin": origin} if origin else {}
        resp = call(secure, "POST", "/v1/sessions", alpha, {"title": "same site"}, headers)
        assert resp.status_code == 201, (origin, resp.text)
        assert call(secure, "DELETE", f"/v1/sessions/{resp.json()['id']}", alpha, headers=headers).status_code == 204
    FIGURES["cross-site HTTP requests refused"] = refused


# ----- the disk tier's paths, and the log -------------------------------------------------------------

HOSTILE = ["../../../../../../etc/passwd", "..\\..\\..\\windows\\win.ini", "/tmp/chatcore-evil-{tag}",
           "%2e%2e%2f%2e%2e%2fchatcore-evil-{tag}", "kv/../../chatcore-evil-{tag}", "~root/.ssh/authorized_keys",
           "C:\\chatcore-evil-{tag}", "\u202e" + "gpj.exe", "x" * 120]


async def test_disk_tier_paths_cannot_be_steered_and_no_secret_is_logged(secure) -> None:
    """Hostile names as system prompts, titles and client ids reach no path. (NUL is refused at the door:
    tests/test_server_nul_text.py.)"""
    tag = uuid.uuid4().hex[:8]
    hostile = [h.replace("{tag}", tag) for h in HOSTILE]
    alpha = secure.keys["alpha"]
    data = secure.data_dir
    before_root = {p.name for p in secure.root.iterdir()}
    used: list[str] = []
    for i, text in enumerate(hostile):
        chat = Chat(secure, alpha)
        await chat.hello(system_prompt=f"{text} {text} {SHARED_SYSTEM}", title=text[:200])
        turn = await chat.send_user(f"{text} {i}", {**GREEDY, "max_tokens": 4}, client_id=text[:128])
        await chat.until_done(turn)
        assert turn.done and turn.done["finish_reason"] in ("stop", "length"), turn.frames
        used.append(chat.session_id)
        await chat.close()
        # The same strings where ids go: never a file, only not_found.
        frames, _ = await ws_frames(secure, {"session_id": text[:128], "resume_token": text}, key=alpha)
        assert frames[0]["code"] in ("not_found", "bad_request"), frames
        quoted = urllib.parse.quote(text, safe="")
        assert call(secure, "GET", f"/v1/sessions/{quoted}", alpha).status_code in (400, 404)
        resp = call(secure, "POST", "/v1/chat/completions", alpha,
                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
                    {"X-Session-Id": urllib.parse.quote(text[:100])})
        assert resp.status_code in (400, 404), resp.text

    def written() -> list[str] | None:
        """Once the write-through has finished: the files under the data dir."""
        with sqlite3.connect(data / "chatcore.db") as db:
            rows = db.execute("SELECT hash, path FROM kv_blocks").fetchall()
        files = sorted(str(p.relative_to(data)) for p in data.rglob("*") if p.is_file())
        kv = [f for f in files if f.startswith("kv/")]
        indexed = {f"kv/{path}" for _, path in rows}
        return files if rows and indexed == set(kv) else None

    files = await wait_for(written, "the disk tier's write-through to settle", deadline_s=120, interval_s=0.2)
    with sqlite3.connect(data / "chatcore.db") as db:
        rows = db.execute("SELECT hash, path FROM kv_blocks").fetchall()
    assert all(path == f"{h[:2]}/{h}.kvb" for h, path in rows), rows[:3]
    for name in files:
        assert (BLOCK_FILE.match(name) or name in ("chatcore.db", "chatcore.db-wal", "chatcore.db-shm",
                                                   "replica.lock") or re.match(r"^server-\d+\.log$", name)), name
    assert {p.name for p in secure.root.iterdir()} == before_root  # nothing appeared beside the data dir
    for path in ("/tmp/chatcore-evil-" + tag, "/chatcore-evil-" + tag):
        assert not os.path.exists(path)
    # The log: no API key and no resume token, although keys went in query strings (?api_key=) all along.
    log = secure.log()
    assert "api_key=[redacted]" in log  # the access lines are there, with the secret taken out
    for key in secure.keys.values():
        assert key not in log, "an API key is in the server log"
    problems = log_problems(secure)
    assert not problems, problems[:10]
    FIGURES["hostile strings (prompt, title, id, header, path)"] = len(hostile) * 6
    FIGURES["disk-tier files checked"] = sum(1 for f in files if f.startswith("kv/"))
    FIGURES["files outside kv/<2 hex>/<32 hex>.kvb"] = 0


def test_security_figures(secure, capsys) -> None:
    """Prints what the checks above covered (runs last in this module)."""
    assert cache(secure)["audit"]["ok"]
    report(capsys, "security", {**FIGURES, "secrets in the log": 0})

