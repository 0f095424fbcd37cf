"""The server address a user gives `chatcore chat --url`, as the WebSocket URL the client opens.

Users see the server as `http://HOST:PORT` (the browser UI, the README, what `chatcore serve` prints),
so that is what `--url` takes, as Ollama's `OLLAMA_HOST` does:
- `http://HOST:PORT[/PREFIX]` -> `ws://HOST:PORT[/PREFIX]/v1/ws`, `https://` -> `wss://` (a path is the
  prefix a reverse proxy serves the API under);
- `HOST:PORT` or `HOST` (no scheme) -> `ws://HOST:PORT/v1/ws`, the port defaulting to the `port` setting's;
- `ws://` and `wss://` URLs as given, `/v1/ws` added only where the path is empty.
Anything else is refused in one line (exit 2), naming the forms accepted.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from chatcore.chat.errors import ChatError

WS_PATH = "/v1/ws"
_WEBSOCKET = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}
FORMS = "http://HOST:PORT, https://HOST:PORT, HOST:PORT or ws://HOST:PORT/v1/ws"


def websocket_url(given: str, default_port: int) -> str:
    """`given` as the WebSocket URL of the server's API (module docstring); ChatError when it is none."""
    text = given.strip()
    schemeless = "://" not in text
    parts = urlsplit(f"http://{text}" if schemeless else text)
    scheme = _WEBSOCKET.get(parts.scheme.lower())
    try:
        port = parts.port
    except ValueError:
        port, scheme = None, None
    if scheme is None or not parts.hostname:
        raise ChatError(f"{given!r} is not a server address: use {FORMS}", exit_code=2)
    netloc = f"{parts.netloc}:{default_port}" if schemeless and port is None else parts.netloc
    path = parts.path.rstrip("/")
    if parts.scheme.lower() in ("http", "https") and not path.endswith(WS_PATH):
        path += WS_PATH
    return urlunsplit((scheme, netloc, path or WS_PATH, parts.query, ""))
