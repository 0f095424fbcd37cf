"""Where the chat writes: answers and listings to standard output, notices to standard error.

A terminal gets a prompt and colours (unless NO_COLOR is set); a pipe gets neither, so scripts read
plain text: `session: <id>`, then each answer followed by a newline.

Everything written goes through `printable` first: text from the server (answers, titles, history,
session ids, error messages) reaches the terminal with no escape or control sequence in it, so a
server cannot set the clipboard (OSC 52), the window title, hyperlinks, or clear the screen. Only the
client's own colour codes are added after that.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TextIO

PROMPT = ">>> "
DIM, BOLD, RESET = "\x1b[2m", "\x1b[1m", "\x1b[0m"
# Whole sequences first (so their parameters are not shown as text): CSI (ESC [ or U+009B), OSC, DCS, SOS,
# PM and APC strings (to BEL or ST), and two-character escapes. Then any control left: C0 except tab and
# newline, DEL and C1. A sequence split across two writes loses its ESC either way and prints inert text.
_SEQUENCES = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
                        r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                        r"|\x1b[ -/]*[0-~]?")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` without terminal escape sequences and control characters; newlines and tabs are kept."""
    return _CONTROLS.sub("", _SEQUENCES.sub("", text))


class Terminal:
    def __init__(self, out: TextIO = sys.stdout, err: TextIO = sys.stderr, interactive: bool | None = None) -> None:
        self.out, self.err = out, err
        self.interactive = sys.stdin.isatty() and out.isatty() if interactive is None else interactive
        self.colour = self.interactive and "NO_COLOR" not in os.environ

    def prompt(self) -> None:
        if self.interactive:
            self._emit(f"{BOLD}{PROMPT}{RESET}" if self.colour else PROMPT)

    def write(self, text: str) -> None:
        self._emit(printable(text))

    def line(self, text: str) -> None:
        self.write(text + "\n")

    def notice(self, text: str) -> None:
        text = printable(text)
        shown = f"{DIM}[{text}]{RESET}" if self.colour else f"[{text}]"
        self.err.write(shown + "\n")
        self.err.flush()

    def _emit(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
