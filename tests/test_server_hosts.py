"""Open mode answers only to loopback host names: a DNS-rebinding page gets nothing."""

from __future__ import annotations

import base64
import http.client
import os
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.model


def _request(server, path: str, host: str, upgrade: bool = False) -> int:
    url = urlsplit(server.base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    headers = {"Host": host}
    if upgrade:
        headers.update({"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                        "Sec-WebSocket-Key": base64.b64encode(os.urandom(16)).decode(),
                        "Origin": f"http://{host}"})
    conn.request("GET", path, headers=headers)
    status = conn.getresponse().status
    conn.close()
    return status


def test_rebinding_host_names_are_refused_in_open_mode(live_server) -> None:
    port = urlsplit(live_server.base_url).port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
        assert _request(live_server, "/v1/sessions", host) == 200, host
    assert _request(live_server, "/v1/ws", f"127.0.0.1:{port}", upgrade=True) == 101
    for host in (f"evil.test:{port}", "evil.test", f"127.0.0.1.evil.test:{port}"):
        assert _request(live_server, "/v1/sessions", host) == 403, host
        assert _request(live_server, "/v1/ws", host, upgrade=True) == 403, host
    # Every HTTP route is refused to such a page, metrics included; probes use loopback names.
    assert _request(live_server, "/metrics", f"evil.test:{port}") == 403
    assert _request(live_server, "/healthz", f"127.0.0.1:{port}") == 200
