"""The Litestar app factory."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, cast

from litestar import Litestar, MediaType, Request, Response, Router, get
from litestar.config.cors import CORSConfig
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.static_files import create_static_files_router
from litestar.types import ControllerRouterHandler, ExceptionHandlersMap

from chatcore.config import Settings
from chatcore.models.loader import LoadedModel
from chatcore.outcomes import ErrorCode
from chatcore.resources import WEB_DIR
from chatcore.server import (
    completions_routes,
    import_routes,
    openai_routes,
    ops_routes,
    session_routes,
)
from chatcore.server.auth import Authenticator, RevocationWatch, host_allowed
from chatcore.server.body_decoding import NUL, StrictRequest
from chatcore.server.connections import (
    PendingSockets,
    TenantConnections,
    release_after_request,
    take_for_request,
)
from chatcore.server.deps import DEPENDENCIES
from chatcore.server.errors import ApiError, error_handler, error_response, forbidden
from chatcore.server.openapi_schema import StructBodySchemaPlugin
from chatcore.server.services import Services
from chatcore.server.ws import chat_socket, origin_allowed

log = logging.getLogger(__name__)


@get("/", media_type=MediaType.HTML, include_in_schema=False)
async def index() -> Response[bytes]:
    page = WEB_DIR / "index.html"
    if not page.is_file():
        return Response(b"<h1>chatcore</h1><p>The web UI is not installed.</p>", media_type=MediaType.HTML)
    return Response(page.read_bytes(), media_type=MediaType.HTML, headers={"Cache-Control": "no-cache"})


async def _require_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """A guard: the caller's key, as on every route docs/protocol.md does not list as open; then the request
    counts against its tenant's connections (`max_connections_per_tenant`) until its response is sent."""
    principal = await connection.app.state.auth.principal(connection)
    take_for_request(cast("dict[str, Any]", connection.scope), connection.app.state.tenant_connections,
                     principal.tenant_id)


def _nul_in_target(request: Request[Any, Any, Any]) -> Response[Any] | None:
    """A path (a session id) or query holding a NUL, `%00`, is refused as a body holding one is
    (chatcore/server/body_decoding.py): PostgreSQL cannot compare or store it."""
    if NUL not in request.scope["path"] and b"%00" not in request.scope["query_string"]:
        return None
    return error_response(ApiError(ErrorCode.BAD_REQUEST, "the path and query must not contain NUL (%00)"))


# What a page on an allowed origin may send and read: the key, JSON bodies, the session headers, and
# how long to wait after a 429.
CORS_REQUEST_HEADERS = ["Authorization", "Content-Type", "X-Session-Id", "X-Chatcore-New-Session"]
CORS_EXPOSED_HEADERS = ["Retry-After"]


def cors_config(allowed_origins: list[str]) -> CORSConfig | None:
    """CORS headers for the allowed origins, preflights answered; none without any (a CORSConfig's default
    origin is `*`). Others get no CORS headers, and `same_origin` refuses their requests."""
    if not allowed_origins:
        return None
    return CORSConfig(allow_origins=allowed_origins, allow_headers=CORS_REQUEST_HEADERS,
                      expose_headers=CORS_EXPOSED_HEADERS)


def _same_origin(settings: Settings) -> Callable[[Request[Any, Any, Any]], Awaitable[Response[Any] | None]]:
    """The app's `before_request`: cross-site requests from browsers (which always name their Origin on a
    POST, even a 'simple' one, text/plain with no CORS preflight) are refused by the rule the WebSocket
    upgrade uses: in open mode, any web page could otherwise create sessions and run completions on a local
    server. Before the body is read; clients that are not browsers send no Origin. A 403 `unauthorized`: the
    caller is refused, and no key would change that (chatcore/server/errors.py, `forbidden`)."""

    async def same_origin(request: Request[Any, Any, Any]) -> Response[Any] | None:
        if not origin_allowed(request, settings.allowed_origins):
            return error_response(forbidden("origin not allowed"))
        if not await host_allowed(request, request.app.state.auth, settings.allowed_hosts):
            return error_response(forbidden("host not allowed in open mode"))
        return _nul_in_target(request)

    return same_origin


def _lifespan(settings: Settings, loaded: LoadedModel | None,
              on_device_lost: Callable[[str], None] | None) -> Callable[[Litestar], AbstractAsyncContextManager[None]]:
    """Start the services, and the app's helpers over them, when the app starts; stop them when it stops."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        services = await Services.start(settings, loaded, on_device_lost)
        app.state.services = services
        app.state.auth = Authenticator(services)
        app.state.gauges = ops_routes.GaugeRefresher(services)
        app.state.revocations = RevocationWatch(services)
        app.state.pending_sockets = PendingSockets(settings.max_unauthenticated_sockets_per_address)
        app.state.tenant_connections = TenantConnections(settings.resolved_max_connections_per_tenant)
        try:  # whatever fails from here on, the services stop (leases released, engine joined)
            await app.state.gauges.start()
            app.state.revocations.start()
            yield
        finally:
            await app.state.revocations.stop()
            await app.state.gauges.stop()
            await services.stop()

    return lifespan


def _route_handlers() -> list[ControllerRouterHandler]:
    return [
        index,
        create_static_files_router("/static", directories=[WEB_DIR], include_in_schema=False),
        chat_socket,  # authenticates after the upgrade, to answer with an error frame
        # The key is checked by a guard, before a body is read or validated.
        Router("/", guards=[_require_key], middleware=[release_after_request], route_handlers=[
            openai_routes.chat_completions,
            completions_routes.completions,
            openai_routes.list_models,
            session_routes.limits,
            session_routes.list_sessions,
            session_routes.create_session,
            import_routes.import_session,
            session_routes.get_session,
            session_routes.rename_session,
            session_routes.rotate_token,
            session_routes.branch_session,
            session_routes.delete_session,
            ops_routes.admin_cache,
        ]),
        ops_routes.healthz,
        ops_routes.readyz,
        ops_routes.metrics,
    ]


EXCEPTION_HANDLERS: ExceptionHandlersMap = {Exception: error_handler}  # every error through `to_api_error`


def create_app(settings: Settings, loaded: LoadedModel | None = None,
               on_device_lost: Callable[[str], None] | None = None) -> Litestar:
    """An app that starts its services (database, model, engine, sessions) in its lifespan. `on_device_lost`:
    called on the event loop when the engine reports the device lost for good (`chatcore serve` then exits)."""
    return Litestar(
        route_handlers=_route_handlers(),
        lifespan=[_lifespan(settings, loaded, on_device_lost)],
        dependencies=DEPENDENCIES,
        plugins=[StructBodySchemaPlugin()],
        request_class=StrictRequest,  # bodies decoded strictly into their Structs
        before_request=_same_origin(settings),
        cors_config=cors_config(settings.allowed_origins),
        logging_config=None,  # `chatcore serve` configures logging (chatcore.logs), text or JSON
        exception_handlers=EXCEPTION_HANDLERS,
        openapi_config=OpenAPIConfig(title="chatcore", version="0.1.0",
                                     openapi_router=Router("/schema", route_handlers=[], guards=[_require_key],
                                                           middleware=[release_after_request])),
        request_max_body_size=settings.max_frame_bytes * 16,
        debug=False,
    )
