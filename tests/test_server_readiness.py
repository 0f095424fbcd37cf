"""`/readyz` (the engine thread and the database answer) beside `/healthz` (the loop answers)."""

from __future__ import annotations

import httpx
import pytest

from chatcore.config import Settings
from tests.inprocess_server import serve

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
        assert gone.json() == {"status": "not ready", "checks": {"engine": "failing", "database": "ok"}}
        assert (await http.get("/healthz")).status_code == 200  # alive, not ready: restart it, do not route to it
