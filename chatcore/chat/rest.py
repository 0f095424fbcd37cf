"""The two HTTP reads the client needs besides its socket: the tenant's sessions and one session's history."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from chatcore.chat.errors import ChatError

TIMEOUT_S = 30.0


def http_base(ws_url: str) -> str:
    """The server's HTTP origin for its WebSocket URL: ws://h:p/v1/ws -> http://h:p."""
    parts = urlsplit(ws_url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, "", "", ""))


class Rest:
    def __init__(self, ws_url: str, api_key: str | None) -> None:
        self.base = http_base(ws_url)
        self.api_key = api_key

    async def sessions(self) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._get, "/v1/sessions")

    async def session(self, session_id: str) -> dict[str, Any]:
        return await asyncio.to_thread(self._get, f"/v1/sessions/{quote(session_id, safe='')}")

    def _get(self, path: str) -> Any:
        request = urllib.request.Request(self.base + path)
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return json.loads(response.read().decode())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read().decode())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = err.reason
            raise ChatError(f"GET {path}: HTTP {err.code}: {message}") from None
        except (OSError, ValueError) as exc:
            raise ChatError(f"GET {self.base}{path} failed ({type(exc).__name__})") from None
