"""Connection limits: what a client may hold open before it has said who it is.

- `max_connections` (uvicorn's `limit_concurrency`): past it an HTTP request gets 503. uvicorn checks
  only HTTP requests; `GuardedHttpProtocol` applies the same bound to WebSocket upgrades.
- `header_timeout_s`: a connection whose request headers are not complete this long after it opened,
  or after its last response, is closed. uvicorn has no such timeout (`timeout_keep_alive` starts only
  after a response), so a client could hold a connection forever with half a request.
- `body_timeout_s`: a request whose body has not arrived in full this long after its headers did gets
  408 (the usual JSON error body, `bad_request`) and its connection is closed, whatever the route and
  whether or not its handler reads the body; a response already begun is cut off instead. Without it a
  client could hold a connection (and, at `max_connections`, the whole server) with a body that never
  ends. A WebSocket upgrade has no body and is not timed.
- `max_connections_per_tenant` (`TenantConnections`): what one tenant holds open once it has said who it is,
  its authenticated WebSockets and its HTTP requests in flight (a streamed answer until its last chunk),
  at most; by default half of `max_connections`, so one tenant can never hold them all and shut the
  others out. Past it a request gets `busy` (429) and a socket an error frame and a close.
- `socket_idle_timeout_s` (`chatcore.server.ws`): a WebSocket that sent no frame (a `ping` counts) and ran no
  turn for this long is closed (4408): an idle socket does not hold a connection forever.
- `max_unauthenticated_sockets_per_address`: WebSockets from one address waiting for their `auth`
  frame (`PendingSockets`, used by `chatcore.server.ws`). A socket whose upgrade carries a key, or any
  socket in open mode, is authenticated at once and never waits there.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.protocols.utils import get_client_addr

from chatcore.outcomes import ErrorCode
from chatcore.server.errors import ApiError, raw_error_response, upgrade_refusal

if TYPE_CHECKING:
    from litestar.types import ASGIApp, Receive, Scope, Send
    from uvicorn._types import ASGI3Application

log = logging.getLogger(__name__)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP protocol with deadlines on request headers and bodies, and the connection bound on
    upgrades.

    The header deadline is armed when the connection opens and after each response (unless a pipelined
    request is already parsed), and disarmed when a request's headers are complete. The body deadline
    is armed when a request starts (its ASGI task; a pipelined request's when the one before it has
    been answered) and disarmed when the parser has its whole body: only the request being parsed can
    lack part of its body, so one deadline a connection suffices."""

    header_timeout_s: float = 10.0  # set per server by `guarded_http_protocol`
    body_timeout_s: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        self._disarm_body_deadline()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._disarm_header_deadline()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm_body_deadline()
        super().on_message_complete()

    def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
        super()._start_asgi_task(cycle, app)
        if cycle.more_body:
            self._arm_body_deadline(cycle)

    def on_response_complete(self) -> None:
        idle = not self.pipeline
        super().on_response_complete()
        if idle and not self.transport.is_closing():
            self._arm_header_deadline()

    def handle_websocket_upgrade(self) -> None:
        limit = self.limit_concurrency
        if limit is not None and len(self.connections) >= limit:  # the test uvicorn applies to HTTP requests
            log.warning("a WebSocket upgrade was refused: %d connections are open (max_connections)",
                        len(self.connections))
            self._refuse_upgrade()
            return
        super().handle_websocket_upgrade()

    def _refuse_upgrade(self) -> None:
        self.transport.write(upgrade_refusal())
        self.transport.close()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if not self.transport.is_closing():
            log.info("closed a connection whose request headers took over %g s (header_timeout_s)",
                     self.header_timeout_s)
            self.transport.close()

    def _arm_body_deadline(self, cycle: RequestResponseCycle) -> None:
        self._disarm_body_deadline()
        self._body_deadline = self.loop.call_later(self.body_timeout_s, self._body_deadline_passed, cycle)

    def _disarm_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_deadline_passed(self, cycle: RequestResponseCycle) -> None:
        self._body_deadline = None
        if self.transport.is_closing():
            return
        answered = not cycle.response_started
        log.info("%s %s from %s: the request body did not arrive in full within %g s (body_timeout_s): %s",
                 cycle.scope["method"], cycle.scope["path"], get_client_addr(cycle.scope), self.body_timeout_s,
                 "answered 408 and closed" if answered else "closed (its response had begun)")
        if answered:
            self.transport.write(self._timeout_response())
        # The handler, if it still waits for the body, reads a disconnect; anything it sends is dropped.
        cycle.disconnected = True
        cycle.message_event.set()
        self.transport.close()

    def _timeout_response(self) -> bytes:
        error = ApiError(ErrorCode.BAD_REQUEST, f"the request body did not arrive in full within "
                         f"{self.body_timeout_s:g} s of its headers (body_timeout_s)", 408)
        return raw_error_response(error, self.server_state.default_headers)


def guarded_http_protocol(header_timeout_s: float, body_timeout_s: float) -> type[GuardedHttpProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), with this server's header and body timeouts."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})


class PendingSockets:
    """WebSockets waiting for their `auth` frame, counted per client address."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiting: Counter[str] = Counter()

    @contextmanager
    def waiting(self, address: str) -> Iterator[None]:
        """Count one socket from `address` while it waits; `busy` if that address already has `limit`."""
        if self._waiting[address] >= self.limit:
            raise ApiError(ErrorCode.BUSY,
                           f"{self.limit} sockets from this address are already waiting for their auth "
                           "frame (max_unauthenticated_sockets_per_address)")
        self._waiting[address] += 1
        try:
            yield
        finally:
            self._waiting[address] -= 1
            if not self._waiting[address]:
                del self._waiting[address]


class TenantConnections:
    """What each tenant holds open: its authenticated WebSockets and its HTTP requests in flight, at most
    `limit` a tenant (`max_connections_per_tenant`). `take` before serving, `give_back` exactly once after."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: Counter[str] = Counter()

    def take(self, tenant_id: str) -> None:
        """Count one more connection of `tenant_id`; `busy` if it holds `limit` already."""
        if self._held[tenant_id] >= self.limit:
            raise ApiError(ErrorCode.BUSY, f"this tenant already holds {self.limit} open connections (WebSockets "
                           "and requests in flight; max_connections_per_tenant)")
        self._held[tenant_id] += 1

    def give_back(self, tenant_id: str) -> None:
        self._held[tenant_id] -= 1
        if not self._held[tenant_id]:
            del self._held[tenant_id]


HELD_SCOPE_KEY = "chatcore.tenant_connection"  # the tenant an HTTP request's connection was counted for


def take_for_request(scope: dict[str, Any], connections: TenantConnections, tenant_id: str) -> None:
    """Count an HTTP request against its tenant (once, whatever guards run); `release_after_request`, the
    middleware around the guarded routes, gives it back when the response has been sent."""
    if HELD_SCOPE_KEY not in scope:
        connections.take(tenant_id)
        scope[HELD_SCOPE_KEY] = tenant_id


def release_after_request(app: ASGIApp) -> ASGIApp:
    """Middleware: give back the connection `take_for_request` counted, once the whole response (a stream's
    last chunk included) has been sent or the request has failed."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await app(scope, receive, send)
        finally:
            tenant_id = cast("dict[str, Any]", scope).pop(HELD_SCOPE_KEY, None)
            if tenant_id is not None:
                scope["litestar_app"].state.tenant_connections.give_back(tenant_id)

    return middleware
