"""`chatcore chat`: build the client from its options, run it, and turn every failure into one line."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from chatcore.chat.address import websocket_url
from chatcore.chat.connection import Connection
from chatcore.chat.errors import ChatError
from chatcore.chat.lines import LineReader
from chatcore.chat.loop import Chat
from chatcore.chat.rest import Rest
from chatcore.chat.terminal import Terminal, printable
from chatcore.chat.tokens import TokenStore

API_KEY_ENV = "CHATCORE_API_KEY"
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class ChatOptions:
    url: str
    api_key: str | None
    session: str | None
    resume_token: str | None
    system: str | None
    params: dict[str, Any]
    data_dir: Path
    default_port: int  # where `url` names no port and no scheme (chat/address.py)


def default_url(host: str, port: int) -> str:
    """The local server's WebSocket URL: the `host` and `port` settings, a wildcard address as loopback."""
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"ws://{host}:{port}/v1/ws"


def chat_command(options: ChatOptions) -> int:
    terminal = Terminal()
    try:
        options = replace(options, url=websocket_url(options.url, options.default_port))
        return asyncio.run(_chat(options, terminal))
    except ChatError as exc:
        print(f"chatcore chat: {printable(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # a bug or a surprise: one line, never a traceback in the terminal
        print(f"chatcore chat: {type(exc).__name__}: {printable(str(exc))}", file=sys.stderr)
        return 1


async def _chat(options: ChatOptions, terminal: Terminal) -> int:
    tokens = TokenStore(options.data_dir)
    resume_token = options.resume_token
    if options.session and not resume_token:
        resume_token = tokens.get(options.url, options.session)
        if resume_token is None:
            raise ChatError(f"no resume token for session {options.session} of {options.url} in {tokens.path}; "
                            "pass it with --resume-token", exit_code=2)
    api_key = options.api_key or os.environ.get(API_KEY_ENV) or None
    connection = Connection(options.url, api_key, terminal.notice)
    chat = Chat(connection, Rest(options.url, api_key), tokens, terminal, LineReader(sys.stdin.fileno()),
                options.params, options.system)
    main = asyncio.current_task()
    assert main is not None

    def interrupted() -> None:
        if not chat.interrupt():
            main.cancel()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, interrupted)
    try:
        await chat.open(options.session, resume_token)
        return await chat.run()
    except asyncio.CancelledError:
        if terminal.interactive:
            terminal.write("\n")
        return EXIT_INTERRUPTED
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        await connection.close()
