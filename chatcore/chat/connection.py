"""One session's WebSocket, kept attached: `hello`, then frames in `seq` order, reconnecting when it drops.

After a drop, the connection comes back with the session's id, its resume token and `last_seq` (the
highest `seq` received), as docs/protocol.md's "Reconnects and replay" says, and returns the new
`session` frame to its reader, which decides what the drop cost it. A `start`, `token` or `done`
frame whose `seq` is at most `last_seq` was received already and is never returned twice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

from chatcore.chat.errors import ChatError
from chatcore.outcomes import ErrorCode

Frame = dict[str, Any]
SEQ_FRAMES = frozenset({"start", "token", "done"})
OPEN_TIMEOUT_S = 10.0
RECONNECT_DEADLINE_S = 180.0  # a restarting server loads its model and warms up before it listens
RETRY_S = (0.1, 0.2, 0.5, 1.0)  # then every second
# The largest frame accepted from the server: a `session` frame's page of history (up to 1 Mi characters of
# messages, as JSON) fits with room to spare. A bigger one closes the socket (1009) and ends the chat in one line.
MAX_FRAME_BYTES = 16 << 20
CLOSE_TOO_BIG = 1009


class Unreachable(ChatError):
    """Nothing answered at the URL: worth retrying while reconnecting, one line otherwise."""


class Connection:
    def __init__(self, url: str, api_key: str | None, notice: Callable[[str], None]) -> None:
        self.url = url
        self.api_key = api_key
        self.notice = notice
        self.session_id: str | None = None
        self.resume_token: str | None = None
        self.last_seq: int | None = None
        self._ws: ClientConnection | None = None

    async def open(self, session_id: str | None, resume_token: str | None, system_prompt: str | None) -> Frame:
        """Attach to a new session (`session_id` None) or an existing one; returns its `session` frame."""
        await self.close()
        self.session_id, self.resume_token, self.last_seq = None, None, None
        frame = await self._hello(await self._connect(), session_id, resume_token, system_prompt, None)
        self.last_seq = frame["seq"]  # frames before this one belong to turns this client did not watch
        return frame

    async def send(self, frame: Frame) -> Frame | None:
        """Send `frame`; the `session` frame of a reconnect when the socket had dropped, else None."""
        try:
            await self._socket().send(json.dumps(frame))
            return None
        except (ConnectionClosed, OSError):
            reattached = await self.reconnect()
            await self._socket().send(json.dumps(frame))
            return reattached

    async def recv(self) -> Frame:
        """The next frame not received before; after a drop, the `session` frame of the reconnect."""
        while True:
            try:
                frame = json.loads(await self._socket().recv())
            except (ConnectionClosed, OSError) as exc:
                _raise_if_too_big(exc, self.url)
                return await self.reconnect()
            if frame.get("type") in SEQ_FRAMES and isinstance(frame.get("seq"), int):
                if self.last_seq is not None and frame["seq"] <= self.last_seq:
                    continue
                self.last_seq = frame["seq"]
            elif frame.get("type") == "error":
                _raise_fatal(frame, self.session_id)
            return frame

    async def send_if_open(self, frame: Frame) -> None:
        """Send `frame` if the socket is up; a frame that means nothing later (cancel) is dropped otherwise."""
        try:
            if self._ws is not None:
                await self._ws.send(json.dumps(frame))
        except (ConnectionClosed, OSError):
            pass

    def skip_through(self, seq: int) -> None:
        """Treat every frame up to `seq` as received (a turn the client settled from the history)."""
        self.last_seq = max(self.last_seq or 0, seq)

    async def reconnect(self) -> Frame:
        if self.session_id is None:
            raise ChatError(f"the connection to {self.url} closed before a session was opened")
        self.notice("connection lost; reconnecting")
        deadline = time.monotonic() + RECONNECT_DEADLINE_S
        attempt = 0
        while True:
            try:
                ws = await self._connect()
                frame = await self._hello(ws, self.session_id, self.resume_token, None, self.last_seq)
                self.notice("reconnected")
                return frame
            except Unreachable:
                if time.monotonic() >= deadline:
                    raise
            except (ConnectionClosed, OSError):
                if time.monotonic() >= deadline:
                    raise ChatError(f"lost the connection to {self.url} and could not reconnect within "
                                    f"{RECONNECT_DEADLINE_S:g} s") from None
            await asyncio.sleep(RETRY_S[min(attempt, len(RETRY_S) - 1)] if attempt < len(RETRY_S) else 1.0)
            attempt += 1

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()

    def _socket(self) -> ClientConnection:
        if self._ws is None:
            raise ConnectionClosed(None, None)
        return self._ws

    async def _connect(self) -> ClientConnection:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            return await connect(self.url, additional_headers=headers, max_size=MAX_FRAME_BYTES,
                                 open_timeout=OPEN_TIMEOUT_S)
        except InvalidURI:
            raise ChatError(f"{self.url} is not a WebSocket URL", exit_code=2) from None
        except InvalidStatus as exc:
            status = exc.response.status_code
            hint = " (a key: --api-key or CHATCORE_API_KEY)" if status in (401, 403) else ""
            raise ChatError(f"{self.url} refused the connection: HTTP {status}{hint}") from None
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            reason = ("connection refused" if isinstance(exc, ConnectionRefusedError)
                      else exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__)
            raise Unreachable(f"no chatcore server answers at {self.url} ({reason}); is `chatcore serve` "
                              "running? (--url names another)") from None

    async def _hello(self, ws: ClientConnection, session_id: str | None, resume_token: str | None,
                     system_prompt: str | None, last_seq: int | None) -> Frame:
        self._ws = ws
        await ws.send(json.dumps({"type": "hello", "session_id": session_id, "resume_token": resume_token,
                                  "last_seq": last_seq, "system_prompt": system_prompt, "title": None}))
        try:
            frame = json.loads(await ws.recv())
        except ConnectionClosed as exc:
            _raise_if_too_big(exc, self.url)
            raise
        if frame.get("type") == "error":
            self._ws = None
            await ws.close()
            _raise_fatal(frame, session_id)
            raise ChatError(f"the server refused the session: {frame.get('message', frame.get('code'))}")
        if frame.get("type") != "session":
            raise ChatError(f"the server answered hello with {frame.get('type')!r}, not a session frame")
        self.session_id, self.resume_token = frame["session_id"], frame["resume_token"]
        return frame


def _raise_if_too_big(exc: BaseException, url: str) -> None:
    """A socket this client closed because the server's frame passed `MAX_FRAME_BYTES`: no reconnect (the
    server would send it again), one line."""
    if isinstance(exc, ConnectionClosed) and exc.sent is not None and exc.sent.code == CLOSE_TOO_BIG:
        raise ChatError(f"{url} sent a frame over {MAX_FRAME_BYTES} bytes, the most this client reads") from None


def _raise_fatal(frame: Frame, session_id: str | None) -> None:
    """Raise for the errors that end the client's hold on its session (docs/protocol.md's error codes)."""
    code, message = frame.get("code"), frame.get("message") or frame.get("code")
    if code == ErrorCode.UNAUTHORIZED:
        if session_id is not None:
            raise ChatError(f"the server refused the resume token of session {session_id} ({message}); "
                            "pass the right one with --resume-token", exit_code=2)
        raise ChatError(f"the server refused the API key ({message}); pass one with --api-key", exit_code=2)
    if code == ErrorCode.CONFLICT:
        raise ChatError(f"another client took over session {session_id} ({message})")
    if code == ErrorCode.NOT_FOUND and session_id is not None:
        raise ChatError(f"session {session_id}: {message}", exit_code=2)
