"""Where the chat writes: answers and listings to standard output, notices to standard error.

A terminal gets a prompt and colours (unless NO_COLOR is set); a pipe gets neither, so scripts read
plain text: `session: <id>`, then each answer followed by a newline.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

PROMPT = ">>> "
DIM, BOLD, RESET = "\x1b[2m", "\x1b[1m", "\x1b[0m"


class Terminal:
    def __init__(self, out: TextIO = sys.stdout, err: TextIO = sys.stderr, interactive: bool | None = None) -> None:
        self.out, self.err = out, err
        self.interactive = sys.stdin.isatty() and out.isatty() if interactive is None else interactive
        self.colour = self.interactive and "NO_COLOR" not in os.environ

    def prompt(self) -> None:
        if self.interactive:
            self.write(f"{BOLD}{PROMPT}{RESET}" if self.colour else PROMPT)

    def write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def line(self, text: str) -> None:
        self.write(text + "\n")

    def notice(self, text: str) -> None:
        shown = f"{DIM}[{text}]{RESET}" if self.colour else f"[{text}]"
        self.err.write(shown + "\n")
        self.err.flush()
