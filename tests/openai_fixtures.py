"""The in-process server and official `openai` client that the OpenAI-route test modules share
(a pytest plugin of tests/conftest.py: a module that defines its own `server` or `client` uses those)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from chatcore.config import Settings
from chatcore.engine.commands import Audit
from tests.inprocess_server import InProcessServer, serve


@pytest.fixture(scope="module")
async def server(tmp_path_factory, loaded_fp32) -> AsyncIterator[InProcessServer]:
    """The real app over the shared fp32 model, one per test module."""
    settings = Settings(data_dir=tmp_path_factory.mktemp("openai-server"), dtype="float32", num_blocks=256,
                        kv_disk_gb=0)
    async with serve(settings, loaded_fp32) as running:  # audits the pool when the module ends
        yield running


@pytest.fixture
async def client(server: InProcessServer) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client; after each test, every block is accounted for."""
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="anything",
                                  max_retries=0, timeout=120) as api:
        yield api
    report = await server.services.engine.send(Audit())
    assert report.ok, report.format()
