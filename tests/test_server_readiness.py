"""`/readyz` (the engine generates, the database answers) beside `/healthz` (the loop answers), and the
start's warm-up: a server whose engine cannot generate never reports ready."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from chatcore.config import Settings
from tests.failing_runner import INJECTED
from tests.inprocess_server import serve
from tests.server_helpers import GREEDY, free_port, start_server

pytestmark = pytest.mark.model


async def test_readyz_says_ready_then_names_a_stopped_engine(tmp_path, loaded_fp32) -> None:
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=64, kv_disk_gb=0)
    async with serve(settings, loaded_fp32) as server, httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
        ready = await http.get("/readyz")
        assert ready.status_code == 200
        assert ready.json() == {"status": "ready", "checks": {"engine": "ok", "database": "ok"}}
        server.services.engine.shutdown()  # as if the engine thread had died
        gone = await http.get("/readyz")
        assert gone.status_code == 503
        assert gone.json() == {"status": "not ready", "checks": {"engine": "failing", "database": "ok"},
                               "causes": {"engine": "EngineStopped: the engine is shutting down"}}
        assert (await http.get("/healthz")).status_code == 200  # alive, not ready: restart it, do not route to it


LAUNCHER = ("-m", "tests.failing_runner")
WARMUP_TIMEOUT_S = 180


def test_a_warm_up_that_fails_stops_the_start_with_one_line(tmp_path: Path, default_model_dir: Path) -> None:
    """The model loads, but the engine cannot generate: the server exits non-zero before it ever
    answers, and says why in one line, without a traceback."""
    flag = tmp_path / "broken"
    flag.touch()
    env = {**os.environ, "CHATCORE_DATA_DIR": str(tmp_path / "data"), "CHATCORE_PORT": str(free_port()),
           "CHATCORE_HOST": "127.0.0.1", "CHATCORE_KV_CACHE_GB": "0.25"}
    done = subprocess.run([sys.executable, *LAUNCHER, str(flag), "serve"], env=env, capture_output=True, text=True,
                          timeout=WARMUP_TIMEOUT_S)
    log = done.stdout + done.stderr
    assert done.returncode == 3, log
    (line,) = [line for line in log.splitlines() if "not ready" in line]
    assert "the warm-up generation failed" in line and INJECTED in line, line
    assert "NotReady" not in log, log  # no second telling of it as a traceback
    assert "Uvicorn running" not in log, log


def test_a_failing_step_turns_readyz_to_503_with_its_cause_until_it_generates_again(
        tmp_path: Path, default_model_dir: Path) -> None:
    flag = tmp_path / "broken"
    server = start_server(tmp_path / "data", command=(*LAUNCHER, str(flag)))
    try:
        assert server.get("/readyz") == (200, {"status": "ready", "checks": {"engine": "ok", "database": "ok"}})
        flag.touch()  # the device breaks while serving
        status, reply = server.request("POST", "/v1/chat/completions", {
            **GREEDY, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hello."}]})
        assert status == 500, reply
        status, body = server.get("/readyz")
        assert status == 503, body
        assert body["checks"] == {"engine": "failing", "database": "ok"}
        assert body["causes"]["engine"] == f"RuntimeError: {INJECTED}"
        assert server.get("/healthz")[0] == 200  # alive: a supervisor restarts it, a balancer routes around it
        flag.unlink()  # a transient fault: the next check generates, and the server is ready again
        assert server.get("/readyz") == (200, {"status": "ready", "checks": {"engine": "ok", "database": "ok"}})
        status, reply = server.request("POST", "/v1/chat/completions", {
            **GREEDY, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hello."}]})
        assert status == 200 and reply["choices"][0]["message"]["content"], reply
    finally:
        server.stop()
    assert "Traceback" in server.log()  # the failing step itself is logged with its stack, once per failure


def test_a_lost_device_stops_the_server_with_its_own_exit_status(tmp_path: Path, default_model_dir: Path) -> None:
    """CUDA's sticky errors (an illegal memory access) leave a context that fails every later call: the engine
    stops, and the server exits 4 rather than stay up failing every request."""
    flag = tmp_path / "broken"
    server = start_server(tmp_path / "data", command=(*LAUNCHER, str(flag)))
    try:
        flag.write_text("device")
        status, reply = server.request("POST", "/v1/chat/completions", {
            **GREEDY, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hello."}]})
        assert status == 500, reply
        assert server.proc.wait(timeout=60) == 4, server.log()
    finally:
        server.stop()
    (line,) = [line for line in server.log().splitlines() if "the device failed" in line]
    assert "CRITICAL" in line and f"AcceleratorError: {INJECTED}" in line, line
