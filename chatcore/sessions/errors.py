"""Why a session operation was refused: one exception class per error code a client sees.

Raised by the session layer (`SessionManager`, `TurnRunner`); the server answers each with its
`code` (an `ErrorCode`, chatcore/outcomes.py), as an HTTP status or a WebSocket error frame.
"""

from __future__ import annotations

from chatcore.outcomes import ErrorCode


class SessionError(Exception):
    code = ErrorCode.BAD_REQUEST


class NotFound(SessionError):
    code = ErrorCode.NOT_FOUND


class Busy(SessionError):
    code = ErrorCode.BUSY


class TooLarge(SessionError):
    code = ErrorCode.TOO_LARGE


class Unauthorized(SessionError):
    code = ErrorCode.UNAUTHORIZED


class Conflict(SessionError):
    code = ErrorCode.CONFLICT
