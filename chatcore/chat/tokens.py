"""The resume tokens of the sessions this client opened, kept in the data folder, one set per server.

A token is stored under the WebSocket URL of the server that issued it, and read back only for that
URL: `--session ID --url OTHER` never sends one server's token to another, and a `session` frame from
one server never overwrites a token of another.

The file (`<data_dir>/chat/sessions.json`) is readable by its owner alone (0600, in a folder set to
0700 on every write, even one that already existed) from the moment it exists: it is written to a
temporary file created 0600 and renamed over the old one, so a crash never leaves it half written and
no other user ever could read a token.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

FILE_NAME = "sessions.json"
FOLDER_MODE = 0o700
Servers = dict[str, dict[str, str]]  # server URL -> session id -> resume token


class TokenStore:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "chat" / FILE_NAME

    def get(self, url: str, session_id: str) -> str | None:
        return self._read().get(url, {}).get(session_id)

    def put(self, url: str, session_id: str, resume_token: str) -> None:
        if self.path.parent.is_dir():
            os.chmod(self.path.parent, FOLDER_MODE)  # an existing folder too, whether or not this call writes
        servers = self._read()
        if servers.get(url, {}).get(session_id) == resume_token:
            return
        servers.setdefault(url, {})[session_id] = resume_token
        self._write(servers)

    def _read(self) -> Servers:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (FileNotFoundError, ValueError):  # not JSON: treated as empty, and replaced whole on the next write
            return {}
        if not isinstance(data, dict):
            return {}
        servers: Servers = {url: {sid: token for sid, token in sessions.items() if isinstance(token, str)}
                            for url, sessions in _mapping(data.get("servers")).items() if isinstance(sessions, dict)}
        for sid, entry in _mapping(data.get("sessions")).items():  # as written before it kept servers apart
            url, token = _mapping(entry).get("url"), _mapping(entry).get("resume_token")
            if isinstance(url, str) and isinstance(token, str):
                servers.setdefault(url, {}).setdefault(sid, token)
        return servers

    def _write(self, servers: Servers) -> None:
        folder = self.path.parent
        folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        os.chmod(folder, FOLDER_MODE)  # mkdir's mode is not applied to a folder that exists already
        fd, staging = tempfile.mkstemp(prefix=".sessions-", dir=folder)  # mkstemp creates it 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"servers": servers}, fh, indent=1)
            os.replace(staging, self.path)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
