"""`/metrics` (issue 15, item 16): in keyed mode it needs a key unless `metrics_auth=open`, open mode is
unchanged, and a scrape does no database work (the gauges are refreshed in the background).

The key checks run against `chatcore serve` processes; the database check runs the same app under uvicorn in
this process, on a loopback port, so that it can watch the SQL statements the server's engine issues."""

from __future__ import annotations

import asyncio
import os
import re
import threading
import time
import types
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from litestar import Litestar
from sqlalchemy import event

from chatcore.cli import build_parser
from chatcore.config import Settings, load_settings
from chatcore.engine.commands import NumBlocks
from chatcore.server.app import create_app
from tests.server_helpers import (
    STARTUP_TIMEOUT_S,
    LiveServer,
    create_key,
    free_port,
    start_server,
)

pytestmark = pytest.mark.model
# Exactly the names external dashboards rely on (the `# TYPE` lines of the exposition).
METRIC_NAMES = {
    "chatcore_prefix_cache_queries_tokens_total", "chatcore_prefix_cache_hits_tokens_total", "chatcore_kv_blocks",
    "chatcore_sessions", "chatcore_preemptions_total", "chatcore_requests_total", "chatcore_ttft_seconds",
    "chatcore_inter_token_seconds", "chatcore_queue_seconds", "chatcore_disk_blocks_rejected_total",
}
SCRAPES = 20


def make_keys(data_dir: Path) -> dict[str, str]:
    """Keys for `ops` (admin) and `alpha`, made before the server starts so it is keyed from its first request."""
    data_dir.mkdir(parents=True, exist_ok=True)
    cli = types.SimpleNamespace(env={**os.environ, "CHATCORE_DATA_DIR": str(data_dir)})
    return {"ops": create_key(cli, "ops", admin=True), "alpha": create_key(cli, "alpha")}


def scrape(base_url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.get(base_url + "/metrics", headers=headers or {}, timeout=60)


def metric_names(text: str) -> set[str]:
    """The families of the exposition, less the `_created` timestamps prometheus_client adds."""
    return {name for name in re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE) if not name.endswith("_created")}


def samples(text: str) -> dict[str, float]:
    """Samples by their full name with labels, e.g. 'chatcore_kv_blocks{state="used"}'."""
    return {name: float(value) for name, value in re.findall(r"^(chatcore_\S+) (\S+)$", text, re.MULTILINE)}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory) -> Iterator[LiveServer]:
    """A keyed `chatcore serve` with the default `metrics_auth` (key)."""
    data_dir = tmp_path_factory.mktemp("metrics-keyed")
    keys = make_keys(data_dir)
    server = start_server(data_dir)
    server.keys = keys
    yield server
    assert_audit_ok(server.base_url, keys["ops"])
    server.stop()


def assert_audit_ok(base_url: str, admin_key: str) -> None:
    """After the module's tests: every KV block accounted for."""
    resp = httpx.get(base_url + "/v1/admin/cache", headers={"Authorization": f"Bearer {admin_key}"}, timeout=60)
    assert resp.status_code == 200 and resp.json()["audit"]["ok"], resp.text


def test_keyed_mode_metrics_need_a_key(keyed: LiveServer) -> None:
    for headers in ({}, bearer("sk-not-a-key"), bearer(keyed.keys["alpha"][:-1]), {"Authorization": "Basic x"}):
        resp = scrape(keyed.base_url, headers)
        assert resp.status_code == 401, (headers, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert error["code"] == "unauthorized" and "key" in error["message"], error
        assert "chatcore_" not in resp.text
    for tenant in ("alpha", "ops"):  # any valid key will do; a scraper's need not be an admin's
        resp = scrape(keyed.base_url, bearer(keyed.keys[tenant]))
        assert resp.status_code == 200, resp.text
        assert resp.headers["content-type"].startswith("text/plain")
        assert metric_names(resp.text) == METRIC_NAMES
    # The query parameter works as on the other routes (Prometheus can send either).
    assert httpx.get(f"{keyed.base_url}/metrics?api_key={keyed.keys['alpha']}", timeout=60).status_code == 200


def test_open_mode_metrics_stay_open(live_server: LiveServer) -> None:
    resp = scrape(live_server.base_url)
    assert resp.status_code == 200, resp.text
    assert metric_names(resp.text) == METRIC_NAMES
    labelled = samples(resp.text)
    for state in ("free", "cached", "used"):
        assert f'chatcore_kv_blocks{{state="{state}"}}' in labelled
    for state in ("hot", "warm", "cold"):
        assert f'chatcore_sessions{{state="{state}"}}' in labelled


def test_metrics_auth_setting_from_the_environment_and_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATCORE_METRICS_AUTH", raising=False)
    assert Settings().metrics_auth == "key"
    monkeypatch.setenv("CHATCORE_METRICS_AUTH", "open")
    assert Settings().metrics_auth == "open"
    args = build_parser().parse_args(["serve", "--metrics-auth", "key"])
    assert load_settings(metrics_auth=args.metrics_auth).metrics_auth == "key"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--metrics-auth", "admin"])


# ----- no database work per scrape (the app under uvicorn in this process) ------------------------------


@dataclass
class InProcessServer:
    base_url: str
    app: Litestar
    loop: asyncio.AbstractEventLoop
    keys: dict[str, str]

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the server's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)


@pytest.fixture(scope="module")
def in_process(tmp_path_factory, loaded_fp32) -> Iterator[InProcessServer]:
    """Keyed mode with `metrics_auth=open`: no key lookup either, so a scrape needs no query at all."""
    data_dir = tmp_path_factory.mktemp("metrics-in-process")
    keys = make_keys(data_dir)
    port = free_port()
    settings = Settings(data_dir=data_dir, port=port, dtype="float32", kv_cache_gb=0.25, metrics_auth="open")
    app = create_app(settings, loaded_fp32)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    loop_ready: Future[asyncio.AbstractEventLoop] = Future()

    async def serve() -> None:
        loop_ready.set_result(asyncio.get_running_loop())
        await server.serve()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="uvicorn", daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    wait_healthy(base_url, thread)
    yield InProcessServer(base_url, app, loop_ready.result(timeout=1), keys)
    assert_audit_ok(base_url, keys["ops"])
    server.should_exit = True
    thread.join(timeout=60)


def wait_healthy(base_url: str, thread: threading.Thread) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and thread.is_alive():
        try:
            with urllib.request.urlopen(base_url + "/healthz", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)  # polling for the port to open, not synchronising on work
    raise RuntimeError("the in-process server did not answer /healthz")


@contextmanager
def request_statements(app: Litestar) -> Iterator[list[str]]:
    """The SQL statements the server's engine runs from an HTTP request's task, while the block runs
    (background chores such as the lease renewal or the gauge refresh run in tasks of their own)."""
    engine = app.state.services.db.sync_engine
    seen: list[str] = []

    def record(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        task = asyncio.current_task()
        if task is not None and getattr(task.get_coro(), "__qualname__", "").endswith("run_asgi"):
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def test_a_scrape_runs_no_database_query(in_process: InProcessServer) -> None:
    assert scrape(in_process.base_url).status_code == 200  # metrics_auth=open: no key needed in keyed mode
    with request_statements(in_process.app) as seen:
        # The check sees a request's statements: a keyed route's key lookup is one.
        listed = httpx.get(in_process.base_url + "/v1/sessions", headers=bearer(in_process.keys["alpha"]), timeout=60)
        assert listed.status_code == 200 and any("api_keys" in s for s in seen), seen
        seen.clear()
        for _ in range(SCRAPES):
            resp = scrape(in_process.base_url)
            assert resp.status_code == 200 and metric_names(resp.text) == METRIC_NAMES
        assert seen == [], seen[:3]


def test_the_gauges_follow_the_server_after_a_refresh(in_process: InProcessServer) -> None:
    services = in_process.app.state.services
    before = samples(scrape(in_process.base_url).text)
    created = 3
    for i in range(created):
        resp = httpx.post(in_process.base_url + "/v1/sessions", json={"title": f"gauge {i}"},
                          headers=bearer(in_process.keys["alpha"]), timeout=60)
        assert resp.status_code == 201, resp.text

    async def refresh() -> dict[str, int]:
        await in_process.app.state.gauges.refresh()
        return services.sessions.counts()

    counts = in_process.run(refresh())
    after = samples(scrape(in_process.base_url).text)
    sessions = {state: after[f'chatcore_sessions{{state="{state}"}}'] for state in ("hot", "warm", "cold")}
    previous = sum(before[f'chatcore_sessions{{state="{state}"}}'] for state in ("hot", "warm", "cold"))
    assert sum(sessions.values()) == previous + created, (before, sessions)
    assert sessions["hot"] == counts["hot"] and sessions["warm"] == counts["warm"]
    blocks = sum(after[f'chatcore_kv_blocks{{state="{state}"}}'] for state in ("free", "cached", "used"))
    assert blocks == in_process.run(services.engine.send(NumBlocks()))
