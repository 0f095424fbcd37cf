"""What Litestar's dependency injection gives the handlers: the running services and the caller."""

from __future__ import annotations

from typing import Any

from litestar import Request
from litestar.datastructures import State
from litestar.di import Provide

from chatcore.server.auth import Principal
from chatcore.server.services import Services


def provide_services(state: State) -> Services:
    """The services the app's lifespan started."""
    return state.services


async def provide_principal(request: Request[Any, Any, Any]) -> Principal:
    """The caller (the route guard looked it up already; this reads its answer from the scope)."""
    return await request.app.state.auth.principal(request)


DEPENDENCIES = {
    "services": Provide(provide_services, sync_to_thread=False),
    "principal": Provide(provide_principal),
}
