"""`GET /v1/ws`: the chat protocol of docs/protocol.md.

One socket holds at most one session. Outgoing frames go through one queue and one sender
task, so frames are never interleaved. A running turn's frames reach the socket through a
subscription that replays what the client missed (`seq > last_seq`) and then follows live.
When the socket goes, the turn keeps running; if nobody re-attaches within the grace
period, it is cancelled as `disconnected`.

An authenticated socket counts against its tenant's connections (`max_connections_per_tenant`,
chatcore/server/connections.py) for its whole life, and is closed (4408) once it has received no
frame and followed no turn for `socket_idle_timeout_s`: the idle time restarts at each frame received
and at the end of each turn it follows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

import msgspec
from litestar import WebSocket, websocket
from litestar.connection import ASGIConnection

from chatcore.outcomes import ErrorCode, FinishReason
from chatcore.server.auth import (
    Authenticator,
    Principal,
    RevocationWatch,
    host_allowed,
    presented_key,
)
from chatcore.server.body_decoding import nul_error
from chatcore.server.connections import PendingSockets, TenantConnections
from chatcore.server.errors import (
    CLOSE_FRAME_TOO_BIG,
    CLOSE_REVOKED,
    CLOSE_TAKEN_OVER,
    CLOSE_UNREAD,
    CLOSE_UPGRADE_REFUSED,
    ApiError,
    WsClose,
    idle_close,
    to_api_error,
    turn_frame,
    ws_close,
    ws_refusal_close,
)
from chatcore.server.frames import (
    Auth,
    Cancel,
    Frame,
    Hello,
    History,
    Ping,
    SessionParams,
    User,
    decode_frame,
)
from chatcore.server.history import HistoryReads, page_fields
from chatcore.server.params import sampling_params
from chatcore.server.services import Services
from chatcore.sessions.state import SessionState

log = logging.getLogger(__name__)
# What may wait for a client that does not read (beyond what the kernel's socket buffers hold):
# a whole 2,048-token turn fits many times over. Past either bound the socket is closed (1008)
# and the queue dropped. Characters bound the frames that are big (a `session` frame carries a
# page of history, up to 1 Mi characters), the count bounds the per-frame overhead of tiny ones (pongs).
MAX_QUEUED_FRAMES = 8192
MAX_QUEUED_CHARS = 4 << 20  # of JSON text, 1 to 4 bytes each in memory
AUTH_FRAME_TIMEOUT_S = 10.0  # keyed mode, no key on the upgrade: how long the `auth` frame may take
CLOSE_WAIT_S = 10.0  # after the handler ends, how long the last frames may take to leave


def origin_allowed(socket: ASGIConnection, allowed: list[str]) -> bool:
    origin = socket.headers.get("origin")
    if not origin:
        return True  # not a browser
    host = socket.headers.get("host", "")
    netloc = urlsplit(origin).netloc
    return netloc == host or origin in allowed or "*" in allowed


class Connection:
    def __init__(self, socket: WebSocket, services: Services, principal: Principal) -> None:
        self.socket = socket
        self.services = services
        self.principal = principal
        self.out: asyncio.Queue[tuple[str, int | None] | WsClose] = asyncio.Queue()
        self.queued_chars = 0
        self.state: SessionState | None = None
        self.last_seq: int | None = None
        self.pump: asyncio.Task[None] | None = None
        self.closed = False
        self.history_reads = HistoryReads(services.settings.max_history_reads_per_minute)
        self.last_activity = time.monotonic()  # the last frame received, or the end of a turn it followed

    # ----- output ----------------------------------------------------------------------------
    def send(self, frame: dict[str, Any]) -> None:
        if self.closed:
            return
        text = json.dumps(frame, ensure_ascii=False)
        if self.out.qsize() >= MAX_QUEUED_FRAMES or self.queued_chars + len(text) > MAX_QUEUED_CHARS:
            log.warning("a client left %d frames (%d characters) unread: closing its socket", self.out.qsize(),
                        self.queued_chars)
            while not self.out.empty():
                self.out.get_nowait()
            self.queued_chars = 0
            self.close(*CLOSE_UNREAD)
            return
        seq = frame.get("seq")
        self.queued_chars += len(text)
        self.out.put_nowait((text, seq if isinstance(seq, int) else None))

    def error(self, code: ErrorCode, message: str) -> None:
        self.send(ApiError(code, message).frame())

    def fail(self, exc: BaseException) -> None:
        """The error frame of `exc` (`to_api_error`), then the close its code calls for, if any."""
        error = to_api_error(exc)
        self.send(error.frame())
        close = ws_close(error.code)
        if close is not None:
            self.close(*close)

    def revoked(self) -> None:
        self.error(ErrorCode.UNAUTHORIZED, "the API key was revoked")
        self.close(*CLOSE_REVOKED)

    def close(self, code: int, reason: str = "") -> None:
        if not self.closed:
            self.out.put_nowait(WsClose(code, reason))
            self.closed = True

    async def sender(self) -> None:
        while True:
            item = await self.out.get()
            if isinstance(item, WsClose):
                await self.socket.close(code=item.code, reason=item.reason)
                return
            text, seq = item
            self.queued_chars -= len(text)
            await self.socket.send_data(text, mode="text")
            if seq is not None:
                self.last_seq = max(self.last_seq or 0, seq)

    # ----- session attachment ----------------------------------------------------------------
    def attachments(self) -> dict[str, Connection]:
        return self.services.ws_attached

    def attach(self, state: SessionState) -> None:
        self.detach()
        previous = self.attachments().get(state.id)
        if previous is not None and previous is not self:
            previous.error(ErrorCode.CONFLICT, "another connection took over this session")
            previous.stop_pump()
            previous.state = None
            previous.close(*CLOSE_TAKEN_OVER)
        self.attachments()[state.id] = self
        self.state = state
        if state.grace_timer is not None:
            state.grace_timer.cancel()
            state.grace_timer = None

    def detach(self) -> None:
        """Leave the session; a running turn gets the grace period to be picked up again."""
        self.stop_pump()
        state = self.state
        self.state = None
        if state is None or self.attachments().get(state.id) is not self:
            return
        del self.attachments()[state.id]
        self.services.turns.arm_grace(state)

    def turn_running(self) -> bool:
        return self.state is not None and self.state.turn_running

    def stop_pump(self) -> None:
        if self.pump is not None:
            self.pump.cancel()
            self.pump = None

    def follow(self, state: SessionState, after_seq: int | None) -> None:
        """Stream the session's current turn from `after_seq` on."""
        frames = state.current
        if frames is None:
            return
        self.stop_pump()
        queue = frames.subscribe(after_seq)

        async def pump() -> None:
            try:
                while True:
                    frame = turn_frame(await queue.get())
                    self.send(frame)
                    if frame["type"] == "done":
                        self.last_activity = time.monotonic()  # the idle time starts when the turn ends
                        return
            finally:
                frames.unsubscribe(queue)

        self.pump = asyncio.create_task(pump())

    # ----- frames ----------------------------------------------------------------------------
    async def handle(self, frame: Frame) -> None:
        if isinstance(frame, Ping):
            self.send({"type": "pong"})
        elif isinstance(frame, Hello):
            await self.hello(frame)
        elif isinstance(frame, User):
            await self.user(frame)
        elif isinstance(frame, Auth):  # open mode ignores keys, as it ignores Authorization headers
            if self.principal.key_id is not None:
                raise ApiError(ErrorCode.BAD_REQUEST,
                               "this socket is authenticated already; auth is only a first frame")
        elif isinstance(frame, Cancel):
            if self.state is None:
                raise ApiError(ErrorCode.BAD_REQUEST, "send hello first")
            await self.services.turns.cancel(self.state, FinishReason.CANCELLED)
        elif isinstance(frame, History):
            self.history(frame)

    def history(self, frame: History) -> None:
        """An earlier page of the attached session's history (chatcore/server/history.py)."""
        if self.state is None:
            raise ApiError(ErrorCode.BAD_REQUEST, "send hello first")
        history = self.state.history()
        if frame.before > len(history):
            raise ApiError(ErrorCode.BAD_REQUEST, f"before must be at most {len(history)}, the messages in the history")
        self.history_reads.take()
        page = page_fields(history, frame.before, self.services.settings.history_page_messages)
        self.send({"type": "history", **page})

    async def hello(self, frame: Hello) -> None:
        self.history_reads.take()
        session_id, token, last_seq = frame.session_id, frame.resume_token, frame.last_seq
        routed = self.socket.query_params.get("session_id")  # for nginx's affinity (docs/deploy.md)
        if routed and session_id is not None and routed != session_id:
            raise ApiError(ErrorCode.BAD_REQUEST, "the session_id in the URL and in hello differ")
        manager = self.services.sessions
        if session_id is None:
            state, token = await manager.create(self.principal.tenant_id, system_prompt=frame.system_prompt,
                                                title=frame.title or "",
                                                id_hint=self.socket.headers.get("x-chatcore-new-session"))
        else:
            state = await manager.resume(self.principal.tenant_id, session_id, token)
            self.services.residency.prefetch(state)
        if self.closed:  # its key was revoked meanwhile
            return
        self.attach(state)
        self.last_seq = last_seq
        history = state.history()
        self.send({"type": "session", "session_id": state.id, "resume_token": token, "title": state.title,
                   **page_fields(history, len(history), self.services.settings.history_page_messages),
                   "truncated_turns": state.window_start, "seq": state.next_seq, "limits": self.services.limits()})
        current = state.current
        if current is not None and (state.turn_running or last_seq is not None):
            self.follow(state, last_seq)

    async def user(self, frame: User) -> None:
        state = self.state
        if state is None:
            raise ApiError(ErrorCode.BAD_REQUEST, "send hello first")
        client_id = frame.id
        if not frame.content.strip():
            raise ApiError(ErrorCode.BAD_REQUEST, "'content' must be a non-empty string")
        services = self.services
        fields = frame.params or SessionParams()
        if fields.tools is not msgspec.UNSET or fields.tool_choice is not msgspec.UNSET:
            raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           "tools are not available in sessions (a session keeps no tool "
                           "calls); use POST /v1/chat/completions with the whole conversation")
        params = sampling_params(fields, services.settings, vocab_size=services.engine.info.vocab_size,
                                 max_tokens=fields.max_tokens, logprobs=bool(fields.logprobs),
                                 top_logprobs=fields.top_logprobs or 0, default_max_tokens=256,
                                 default_temperature=0.7)
        # An idle session may have gone cold (dropped from memory) while this socket stayed attached:
        # run the turn on the session's live state, never on the old object (that would fork the session).
        state = await self.services.sessions.open(self.principal.tenant_id, state.id)
        if not self.holds(state.id):
            return
        self.state = state
        previous = state.current
        if previous is not None and previous.client_id == client_id:
            self.follow(state, self.last_seq)  # a resent message: no second turn, just what was missed
            return
        used = await self.services.sessions.client_id_used(state.id, client_id)
        if not self.holds(state.id):
            return
        if used:
            raise ApiError(ErrorCode.BAD_REQUEST, f"message id {client_id!r} was already used in this session")
        await self.services.turns.start(state, frame.content, params, client_id,
                                        still_current=lambda: self.holds(state.id),
                                        max_tokens_given=fields.max_tokens is not None)
        self.follow(state, self.last_seq)

    def holds(self, session_id: str) -> bool:
        """Whether this socket still holds the session. Checked after every await before acting on
        it: meanwhile another socket may have taken it over (this one was told and is closing)."""
        return not self.closed and self.attachments().get(session_id) is self


@websocket("/v1/ws")
async def chat_socket(socket: WebSocket, services: Services) -> None:
    settings = services.settings
    auth: Authenticator = socket.app.state.auth
    if not origin_allowed(socket, settings.allowed_origins) or not await host_allowed(
            socket, auth, settings.allowed_hosts):
        await socket.close(code=CLOSE_UPGRADE_REFUSED.code, reason=CLOSE_UPGRADE_REFUSED.reason)
        return
    await socket.accept()
    held: TenantConnections = socket.app.state.tenant_connections
    try:
        principal = await _authenticate(socket, auth, settings.max_frame_bytes, socket.app.state.pending_sockets)
        if principal is not None:
            held.take(principal.tenant_id)
    except ApiError as exc:
        await socket.send_data(json.dumps(exc.frame()), mode="text")
        code, reason = ws_refusal_close(exc.code)
        await socket.close(code=code, reason=reason)
        return
    if principal is None:  # gone before it said who it is
        return
    try:
        await _serve(Connection(socket, services, principal))
    finally:
        held.give_back(principal.tenant_id)


async def _serve(conn: Connection) -> None:
    """The socket's frames, one at a time, until it closes, idles out, or its sender ends."""
    socket, settings, principal = conn.socket, conn.services.settings, conn.principal
    sender = asyncio.create_task(conn.sender())
    revocations: RevocationWatch = socket.app.state.revocations
    watched = revocations.register(principal.key_id, conn.revoked) if principal.key_id else None
    try:
        while not conn.closed:
            message = await _next_message(conn, sender, settings.socket_idle_timeout_s)
            if message is None or message["type"] == "websocket.disconnect":
                break
            conn.last_activity = time.monotonic()
            await _on_message(conn, message, settings.max_frame_bytes)
    except Exception:
        log.exception("websocket handler failed")
    finally:
        if watched is not None:
            revocations.unregister(watched)
        conn.detach()
        if not conn.closed:
            conn.closed = True
            sender.cancel()
        await asyncio.wait({sender}, timeout=CLOSE_WAIT_S)  # a client that reads nothing blocks it
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)


async def _next_message(conn: Connection, sender: asyncio.Task[None], idle_s: float) -> dict[str, Any] | None:
    """The socket's next message; None when the sender ended, or when the socket has been idle (no frame
    received, no turn running) for `idle_s`: it is then closed (4408) with a reason naming the setting."""
    receiver = asyncio.ensure_future(conn.socket.receive())
    while True:
        left = conn.last_activity + idle_s - time.monotonic()
        if left <= 0 and not conn.turn_running():
            receiver.cancel()
            conn.close(*idle_close(idle_s))
            return None
        done, _ = await asyncio.wait({receiver, sender}, timeout=left if left > 0 else idle_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if receiver in done:
            return receiver.result()
        if sender in done:
            receiver.cancel()
            return None


async def _authenticate(socket: WebSocket, auth: Authenticator, max_bytes: int,
                        pending: PendingSockets) -> Principal | None:
    """The caller, from the upgrade (`Authorization`, `?api_key=`), or else, in keyed mode, from a
    first frame `{"type":"auth","api_key":...}`: a browser cannot set headers on a WebSocket, and a
    key in the URL ends up in proxies' logs. None when the client leaves before that frame. Sockets
    waiting for that frame are bounded per client address (`busy` past the bound)."""
    key = presented_key(socket)
    # Re-checked now (one count of keys): a socket let in as `local` on a stale "open" answer would
    # stay the admin tenant for its whole life, whatever key its `auth` frame then names.
    if key is not None or await auth.open_mode(key_presented=True):
        return await auth.for_key(key)
    try:
        with pending.waiting(socket.client.host if socket.client else ""):
            message = await asyncio.wait_for(socket.receive(), AUTH_FRAME_TIMEOUT_S)
    except TimeoutError:
        raise ApiError(ErrorCode.UNAUTHORIZED,
                       f"no key: send an auth frame within {AUTH_FRAME_TIMEOUT_S:.0f} s") from None
    if message["type"] == "websocket.disconnect":
        return None
    text = message.get("text")
    try:
        frame = decode_frame(json.loads(text)) if text is not None and len(text) <= max_bytes else None
    except (ValueError, RecursionError, ApiError):
        frame = None
    api_key = frame.api_key if isinstance(frame, Auth) else None
    if not api_key:
        raise ApiError(ErrorCode.UNAUTHORIZED,
                       'an API key is required: send {"type":"auth","api_key":...} first '
                       "(or Authorization: Bearer, or api_key= on the upgrade)")
    return await auth.for_key(api_key)


def _encodable(frame: dict[str, Any]) -> bool:
    try:
        json.dumps(frame, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        return False
    return True


async def _on_message(conn: Connection, message: dict[str, Any], max_bytes: int) -> None:
    text = message.get("text")
    if text is None:
        size = len(message.get("bytes") or b"")
        if size > max_bytes:
            conn.error(ErrorCode.TOO_LARGE, f"frames are limited to {max_bytes} bytes")
            conn.close(*CLOSE_FRAME_TOO_BIG)
        else:
            conn.error(ErrorCode.BAD_REQUEST, "binary frames are not supported; send JSON text frames")
        return
    if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        conn.error(ErrorCode.TOO_LARGE, f"frames are limited to {max_bytes} bytes")
        conn.close(*CLOSE_FRAME_TOO_BIG)
        return
    try:
        frame = json.loads(text)
    except (ValueError, RecursionError):
        conn.error(ErrorCode.BAD_REQUEST, "frames must be JSON")
        return
    if not isinstance(frame, dict):
        conn.error(ErrorCode.BAD_REQUEST, "a frame must be a JSON object")
        return
    if "\\ud" in text.lower() and not _encodable(frame):
        # JSON may escape lone UTF-16 surrogates ("\ud800"): no UTF-8 text, so no title, prompt or reply.
        conn.error(ErrorCode.BAD_REQUEST, "frames must be valid Unicode: lone surrogate escapes are not allowed")
        return
    refused = nul_error(frame) if "\\u0000" in text else None  # PostgreSQL cannot store a NUL
    if refused is not None:
        conn.send(refused.frame())
        return
    try:
        await conn.handle(decode_frame(frame))
    except Exception as exc:  # a refusal, or a bug (`internal`, logged): the socket lives on unless its code closes it
        conn.fail(exc)
