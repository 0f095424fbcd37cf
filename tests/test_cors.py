"""CORS: an origin in `allowed_origins` gets Litestar's CORS headers (and its preflights an answer); any
other origin gets none, and its requests are still refused by the same-origin guard."""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

import pytest

from chatcore.server.app import cors_config

pytestmark = pytest.mark.model

ALLOWED = "http://app.test"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.server_helpers import start_server

    live = start_server(tmp_path_factory.mktemp("cors"), allowed_origins=f'["{ALLOWED}"]')
    yield live
    live.stop()


def _request(server, method: str, path: str, headers: dict[str, str]) -> http.client.HTTPResponse:
    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request(method, path, headers=headers)
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp


def test_an_allowed_origin_gets_cors_headers_and_its_preflight_an_answer(server) -> None:
    preflight = _request(server, "OPTIONS", "/v1/chat/completions", {
        "Origin": ALLOWED, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-session-id"})
    assert preflight.status == 204
    assert preflight.getheader("access-control-allow-origin") == ALLOWED
    allowed_headers = preflight.getheader("access-control-allow-headers").lower()
    assert all(h in allowed_headers for h in ("authorization", "content-type", "x-session-id"))
    assert "POST" in preflight.getheader("access-control-allow-methods")

    listed = _request(server, "GET", "/v1/models", {"Origin": ALLOWED})
    assert listed.status == 200
    assert listed.getheader("access-control-allow-origin") == ALLOWED
    assert listed.getheader("access-control-expose-headers") == "Retry-After"


def test_another_origin_gets_no_cors_headers_and_is_refused(server) -> None:
    preflight = _request(server, "OPTIONS", "/v1/chat/completions", {
        "Origin": "http://evil.test", "Access-Control-Request-Method": "POST"})
    assert preflight.status >= 400 and preflight.getheader("access-control-allow-origin") is None
    refused = _request(server, "GET", "/v1/models", {"Origin": "http://evil.test"})
    assert refused.status == 403 and refused.getheader("access-control-allow-origin") is None
    assert _request(server, "GET", "/v1/models", {}).status == 200  # not a browser: no Origin, no CORS


def test_no_allowed_origins_means_no_cors_at_all() -> None:
    assert cors_config([]) is None  # Litestar's CORSConfig would otherwise allow every origin
