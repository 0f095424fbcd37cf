"""The resume tokens of the sessions this client opened, kept in the data folder.

The file (`<data_dir>/chat/sessions.json`) is readable by its owner alone (0600, in a 0700 folder)
from the moment it exists: it is written to a temporary file created 0600 and renamed over the old
one, so a crash never leaves it half written and no other user ever could read a token.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

FILE_NAME = "sessions.json"


class TokenStore:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / "chat" / FILE_NAME

    def get(self, session_id: str) -> str | None:
        entry = self._read().get(session_id)
        return entry.get("resume_token") if isinstance(entry, dict) else None

    def put(self, session_id: str, resume_token: str, url: str) -> None:
        sessions = self._read()
        if sessions.get(session_id, {}).get("resume_token") == resume_token:
            return
        sessions[session_id] = {"resume_token": resume_token, "url": url}
        self._write(sessions)

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except ValueError:  # not JSON: treated as empty, and replaced whole on the next write
            return {}
        sessions = data.get("sessions") if isinstance(data, dict) else None
        return sessions if isinstance(sessions, dict) else {}

    def _write(self, sessions: dict[str, dict[str, str]]) -> None:
        folder = self.path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".sessions-", dir=folder)  # mkstemp creates it 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"sessions": sessions}, fh, indent=1)
            os.replace(staging, self.path)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
