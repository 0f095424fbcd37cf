"""`chatcore chat --url`: the addresses a user sees, mapped to the WebSocket URL (chat/address.py)."""

from __future__ import annotations

import pytest

from chatcore.chat.address import websocket_url
from chatcore.chat.errors import ChatError


@pytest.mark.parametrize(("given", "url"), [
    ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/v1/ws"),
    ("http://127.0.0.1:8000/", "ws://127.0.0.1:8000/v1/ws"),
    ("HTTP://Example.org:81", "ws://Example.org:81/v1/ws"),
    ("https://chat.example.org", "wss://chat.example.org/v1/ws"),
    ("http://example.org", "ws://example.org/v1/ws"),  # a scheme and no port: the scheme's own port
    ("http://proxy:8080/chatcore/", "ws://proxy:8080/chatcore/v1/ws"),  # a reverse proxy's prefix
    ("http://127.0.0.1:8000/v1/ws", "ws://127.0.0.1:8000/v1/ws"),
    ("localhost:9000", "ws://localhost:9000/v1/ws"),
    ("localhost", "ws://localhost:8123/v1/ws"),  # no scheme, no port: the port setting's
    ("[::1]:9000", "ws://[::1]:9000/v1/ws"),
    ("ws://127.0.0.1:8000/v1/ws", "ws://127.0.0.1:8000/v1/ws"),
    ("wss://h.example/v1/ws?x=1", "wss://h.example/v1/ws?x=1"),
    ("ws://127.0.0.1:8000", "ws://127.0.0.1:8000/v1/ws"),
    ("  http://127.0.0.1:8000  ", "ws://127.0.0.1:8000/v1/ws"),
])
def test_each_form_maps_to_the_websocket_url(given: str, url: str) -> None:
    assert websocket_url(given, 8123) == url


@pytest.mark.parametrize("given", ["", "ftp://127.0.0.1:8000", "http://", "http://h:99999", "file:///tmp/x", ":8000"])
def test_what_is_no_address_is_refused_naming_the_forms(given: str) -> None:
    with pytest.raises(ChatError, match="not a server address: use http://HOST:PORT") as refused:
        websocket_url(given, 8000)
    assert refused.value.exit_code == 2
