"""The one error the chat client reports: a sentence for the terminal, never a traceback."""

from __future__ import annotations


class ChatError(Exception):
    """A failure said in one line; `exit_code` is what `chatcore chat` exits with."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
