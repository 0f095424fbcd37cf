"""Why a session operation was refused: one exception class per error code a client sees.

Raised by the session layer (`SessionManager`, `TurnRunner`); the server answers each with its
`code` (an `ErrorCode`, chatcore/outcomes.py), as an HTTP status or a WebSocket error frame.
"""

from __future__ import annotations

from chatcore.outcomes import ErrorCode


class SessionError(Exception):
    """A request the session layer refuses as malformed (a bad `response_format`, ...)."""

    code = ErrorCode.BAD_REQUEST


class NotFound(SessionError):
    code = ErrorCode.NOT_FOUND  # no such session, or another tenant's: the same answer


class Busy(SessionError):
    """No room now (a turn already running in the session, the tenant's session or turn limits,
    no grammar compile thread free): the client may retry."""

    code = ErrorCode.BUSY


class TooLarge(SessionError):
    code = ErrorCode.TOO_LARGE  # a message or a prompt over its limit


class Unauthorized(SessionError):
    """A wrong resume token."""

    code = ErrorCode.UNAUTHORIZED


class Conflict(SessionError):
    code = ErrorCode.CONFLICT  # another connection took the session over, or another replica serves it
