"""The real app served by uvicorn inside the test's event loop, for tests that must hold the server
between two of its awaits (races driven step by step, without sleeps)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
import websockets
from litestar import Litestar

from chatcore.cache.audit import audit
from chatcore.config import Settings
from chatcore.engine.commands import Audit
from chatcore.engine.engine import EngineStopped
from chatcore.models.loader import LoadedModel
from chatcore.server.app import create_app
from chatcore.server.services import Services


@dataclass
class InProcessServer:
    app: Litestar
    port: int

    @property
    def services(self) -> Services:
        return self.app.state.services

    def connect(self, **kwargs: Any) -> Any:
        return websockets.connect(f"ws://127.0.0.1:{self.port}/v1/ws", max_size=None, **kwargs)


@asynccontextmanager
async def serve(settings: Settings, loaded: LoadedModel) -> AsyncIterator[InProcessServer]:
    """The socket listens before uvicorn starts, so clients may connect at once: their handshakes
    wait in the backlog until the app has started. On a clean exit the block audit must hold."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    app = create_app(settings, loaded)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        yield InProcessServer(app, listener.getsockname()[1])
        engine = app.state.services.engine
        try:
            report = await engine.send(Audit())
        except EngineStopped:  # the test stopped it: nothing touches the pool any more
            report = audit(engine._core.pool)
        assert report.ok, report.format()  # every block accounted for, whatever the test did
    finally:
        server.should_exit = True
        await task
        listener.close()


@asynccontextmanager
async def http_client(server: InProcessServer) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of the server, once the app has started (its /healthz answered: `services` exists)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as client:
        assert (await client.get("/healthz")).status_code == 200
        yield client
