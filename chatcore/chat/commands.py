"""What one line of input asks for: a user turn, or one of the slash commands."""

from __future__ import annotations

from dataclasses import dataclass

COMMANDS = {
    "/exit": "end the chat",
    "/new": "start a new session",
    "/system": "/system TEXT: start a new session whose system prompt is TEXT",
    "/sessions": "list this tenant's sessions",
    "/history": "print this session's history",
    "/help": "list the commands",
}
HINT = "commands: " + ", ".join(COMMANDS) + " (a line starting with // sends its text from the second /)"


@dataclass(frozen=True)
class Turn:
    content: str


@dataclass(frozen=True)
class Command:
    name: str
    argument: str


@dataclass(frozen=True)
class Unknown:
    hint: str


@dataclass(frozen=True)
class Blank:
    pass


Line = Turn | Command | Unknown | Blank


def parse(line: str) -> Line:
    """A line starting with `/` is a command; `//text` sends `/text`; a blank line does nothing."""
    if not line.strip():
        return Blank()
    if line.startswith("//"):
        return Turn(line[1:])
    if not line.startswith("/"):
        return Turn(line)
    name, _, argument = line.strip().partition(" ")
    if name not in COMMANDS:
        return Unknown(f"unknown command {name}; {HINT}")
    argument = argument.strip()
    if name == "/system" and not argument:
        return Unknown("/system needs the text of the system prompt: /system TEXT")
    if name != "/system" and argument:
        return Unknown(f"{name} takes no argument")
    return Command(name, argument)
