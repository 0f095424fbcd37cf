"""Lines from standard input without a thread: the event loop wakes when the descriptor is readable.

A terminal in canonical mode hands over whole lines (its driver does the editing: erase, kill,
word erase); a pipe hands over whatever was written. A regular file (`< file`) cannot be watched by
epoll, and never blocks, so it is read directly.
"""

from __future__ import annotations

import asyncio
import codecs
import os

CHUNK = 65536


class LineReader:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._eof = False

    async def readline(self) -> str | None:
        """The next line without its newline; None at the end of the input."""
        while "\n" not in self._buffer:
            if self._eof:
                line, self._buffer = self._buffer, ""
                return line or None
            data = await self._read()
            if not data:
                self._eof = True
                self._buffer += self._decoder.decode(b"", final=True)
            else:
                self._buffer += self._decoder.decode(data)
        line, self._buffer = self._buffer.split("\n", 1)
        return line.removesuffix("\r")

    async def _read(self) -> bytes:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        try:
            loop.add_reader(self.fd, lambda: ready.done() or ready.set_result(None))
        except PermissionError:  # a regular file: epoll refuses it, and reading it never blocks
            return os.read(self.fd, CHUNK)
        try:
            await ready
        finally:
            loop.remove_reader(self.fd)
        try:
            return os.read(self.fd, CHUNK)
        except OSError:  # a terminal that went away (EIO): the end of the input
            return b""
