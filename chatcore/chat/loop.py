"""The chat itself: read a line, act on it, stream the answer; Ctrl-C during an answer cancels it.

A turn is followed by its frames' `seq` (the connection drops the ones seen before). When the
socket drops mid-answer, the connection comes back with `last_seq` and hands over its new
`session` frame; from it the turn learns what the drop cost:

- the answer joined the session's history meanwhile (it finished, or a stopping server ended it):
  the rest of the stored answer after what was printed is printed, and every frame up to the
  session's `seq` counts as received, so a replay of that turn prints nothing twice;
- else, when its `start` never arrived, the `user` frame is sent again with the same `id` (the
  server starts no second turn for an id it has: it replays that turn instead);
- else the turn is still running (or was lost with the server, whose replay ends it with `done`
  `disconnected`): its frames after `last_seq` follow.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from chatcore.chat.commands import HINT, Blank, Command, Turn, Unknown, parse
from chatcore.chat.connection import Connection, Frame
from chatcore.chat.lines import LineReader
from chatcore.chat.rest import Rest
from chatcore.chat.terminal import Terminal
from chatcore.chat.tokens import TokenStore

IN_HISTORY = frozenset({"stop", "length", "cancelled", "disconnected"})  # endings a session's history keeps
ENDINGS = {"cancelled": "cancelled", "disconnected": "the answer was cut off (disconnected)",
           "error": "the answer failed (error)", "length": "the answer reached max_tokens"}


class Chat:
    def __init__(self, connection: Connection, rest: Rest, tokens: TokenStore, terminal: Terminal,
                 lines: LineReader, params: dict[str, Any], system_prompt: str | None) -> None:
        self.connection, self.rest, self.tokens = connection, rest, tokens
        self.terminal, self.lines = terminal, lines
        self.params = params
        self.system_prompt = system_prompt
        self.known_messages = 0  # the session's history as this client last knew it, in messages
        self.answering = False

    async def open(self, session_id: str | None = None, resume_token: str | None = None) -> None:
        frame = await self.connection.open(session_id, resume_token, None if session_id else self.system_prompt)
        self.tokens.put(self.connection.url, frame["session_id"], frame["resume_token"])
        self.known_messages = frame["history_start"] + len(frame["history"])
        self.terminal.line(f"session: {frame['session_id']}")

    async def run(self) -> int:
        """Lines until `/exit` or the end of the input; the exit status."""
        while True:
            self.terminal.prompt()
            line = await self.lines.readline()
            if line is None:
                if self.terminal.interactive:
                    self.terminal.write("\n")
                return 0
            parsed = parse(line)
            if isinstance(parsed, Turn):
                await self.turn(parsed.content)
            elif isinstance(parsed, Unknown):
                self.terminal.notice(parsed.hint)
            elif isinstance(parsed, Command):
                if parsed.name == "/exit":
                    return 0
                await self.command(parsed)
            else:
                assert isinstance(parsed, Blank)

    def interrupt(self) -> bool:
        """Ctrl-C: cancel the answer being streamed (True), or say there is none (False)."""
        if not self.answering:
            return False
        asyncio.get_running_loop().create_task(self.connection.send_if_open({"type": "cancel"}))
        return True

    async def command(self, command: Command) -> None:
        if command.name == "/new":
            await self.open()
        elif command.name == "/system":
            self.system_prompt = command.argument
            await self.open()
        elif command.name == "/sessions":
            for session in await self.rest.sessions():
                mark = "*" if session["id"] == self.connection.session_id else " "
                self.terminal.line(f"{mark} {session['id']}  {session.get('turns', 0)} turns  "
                                   f"{session.get('title') or '(untitled)'}")
        elif command.name == "/history":
            assert self.connection.session_id is not None
            detail = await self.rest.session(self.connection.session_id)
            if detail.get("system_prompt"):
                self.terminal.line(f"system: {detail['system_prompt']}")
            for message in detail["history"]:
                self.terminal.line(f"{message['role']}: {message['content']}")
        elif command.name == "/help":
            self.terminal.line(HINT)

    async def turn(self, content: str) -> None:
        message = {"type": "user", "id": uuid.uuid4().hex, "content": content, "params": self.params}
        printed = ""
        number: int | None = None  # the turn's number, from its `start` frame
        self.answering = True
        try:
            pending = await self.connection.send(message)
            resent = pending is not None  # a reconnect in send: the message went out on the new socket
            while True:
                frame, pending = pending or await self.connection.recv(), None
                kind = frame.get("type")
                if kind == "session":
                    settled = self._settled_from_history(frame, printed)
                    if settled:
                        return
                    if number is None and not resent:
                        pending = await self.connection.send(message)
                    resent = pending is not None
                elif kind == "error":
                    self.terminal.notice(f"{frame.get('code')}: {frame.get('message')}")
                    if number is None:
                        return
                elif kind == "start":
                    number = frame["turn"]
                elif kind in ("token", "done") and frame.get("turn") == number:
                    if kind == "done":
                        self._done(frame)
                        return
                    if frame.get("index", 0) == 0:
                        self.terminal.write(frame["text"])
                        printed += frame["text"]
        finally:
            self.answering = False

    def _settled_from_history(self, frame: Frame, printed: str) -> bool:
        """Whether the turn joined the history while the socket was down; if so, print the rest of it."""
        total = frame["history_start"] + len(frame["history"])
        if total < self.known_messages + 2:
            return False
        last = frame["history"][-1] if frame["history"] else {}
        answer = last.get("content", "") if last.get("role") == "assistant" else ""
        self.terminal.write((answer[len(printed):] if answer.startswith(printed) else "") + "\n")
        self.connection.skip_through(frame["seq"])
        self.known_messages = total
        return True

    def _done(self, frame: Frame) -> None:
        self.terminal.write("\n")
        reason = frame.get("finish_reason")
        if reason in IN_HISTORY:
            self.known_messages += 2
        if reason in ENDINGS:
            self.terminal.notice(ENDINGS[reason])
