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


@pytest.mark.parametrize("setting", [{"CHATCORE_HOST": "0.0.0.0"},
                                     {"CHATCORE_ALLOWED_HOSTS": '["chat.example.com"]'}])
def test_open_mode_off_loopback_is_refused_without_the_insecure_flag(tmp_path, setting) -> None:
    import subprocess
    import sys

    env = {**os.environ, "CHATCORE_DATA_DIR": str(tmp_path), "CHATCORE_PORT": "9", **setting}
    proc = subprocess.run([sys.executable, "-m", "chatcore.cli", "serve"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no API key" in lines[0] and "--insecure-open-mode" in lines[0], proc.stderr


def test_open_mode_off_loopback_serves_with_the_insecure_flag(tmp_path) -> None:
    from tests.server_helpers import start_server

    server = start_server(tmp_path / "data", host="0.0.0.0", insecure_open_mode="true")
    try:
        status, _ = server.get("/healthz")
        assert status == 200
        assert "open mode" in server.log()
    finally:
        server.stop()
