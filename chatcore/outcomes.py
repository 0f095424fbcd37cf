"""How a request or a turn ends: its finish reason and, when it failed, the error code.

A leaf module (it imports nothing of chatcore), so that every layer, from the engine to the
store and the server, carries the same values. Both enums are `StrEnum`s whose values are the
wire names of docs/protocol.md: a member is written to JSON, to the database and to logs as
its value.
"""

from __future__ import annotations

import enum


class FinishReason(enum.StrEnum):
    """Why a request's sequence, or a session's turn, ended."""

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"  # the client cancelled it (an abort)
    ERROR = "error"
    BUSY = "busy"  # no capacity within `max_queue_wait_s`
    TOOL_CALLS = "tool_calls"  # OpenAI: the answer calls a tool
    # Turns only: the client went away (a dropped socket past its grace period, or shutdown),
    # the replica running it was lost, or another replica took the session over.
    DISCONNECTED = "disconnected"
    INTERRUPTED = "interrupted"
    CONFLICT = "conflict"


class ErrorCode(enum.StrEnum):
    """Why a request failed, as the error code clients see (docs/protocol.md, "Errors"): every code
    a client can get, over HTTP or a WebSocket. `chatcore/server/errors.py` maps each to its status."""

    BAD_REQUEST = "bad_request"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"  # a valid OpenAI parameter this server does not do
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    BUSY = "busy"  # no capacity now: the client may retry
    TOO_LARGE = "too_large"
    CONFLICT = "conflict"  # another connection or replica took the session over
    INTERNAL = "internal"
