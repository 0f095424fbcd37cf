"""The WebSocket frames a client sends (docs/protocol.md), as a tagged union of `msgspec.Struct`s on
`type`. A frame's fields are checked when it is decoded, and a field the frame does not define is
refused (`bad_request` naming it): nothing a client sends is accepted and ignored."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from chatcore.server.bodies import SystemPrompt, Title, check_title
from chatcore.server.errors import from_validation_error
from chatcore.server.params import ChatSampling

MAX_ID_CHARS = 128
MAX_TOKEN_CHARS = 256
MAX_KEY_CHARS = 256
MAX_SEQ = 2**63 - 1  # frame numbers are stored as 64-bit integers


class SessionParams(ChatSampling, kw_only=True):
    """A `user` frame's `params`. `tools` and `tool_choice` are named only to be refused clearly: a session
    keeps no tool calls."""

    tools: Any = msgspec.UNSET
    tool_choice: Any = msgspec.UNSET


class Hello(msgspec.Struct, tag="hello", tag_field="type", forbid_unknown_fields=True):
    session_id: Annotated[str, Meta(max_length=MAX_ID_CHARS)] | None = None
    resume_token: Annotated[str, Meta(max_length=MAX_TOKEN_CHARS)] | None = None
    last_seq: Annotated[int, Meta(ge=0, le=MAX_SEQ)] | None = None
    system_prompt: SystemPrompt | None = None
    title: Title | None = None

    def __post_init__(self) -> None:
        check_title(self.title)


class User(msgspec.Struct, tag="user", tag_field="type", forbid_unknown_fields=True):
    id: Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS, description="the idempotency key")]
    content: str
    params: SessionParams | None = None


class Cancel(msgspec.Struct, tag="cancel", tag_field="type", forbid_unknown_fields=True):
    pass


class Ping(msgspec.Struct, tag="ping", tag_field="type", forbid_unknown_fields=True):
    pass


class Auth(msgspec.Struct, tag="auth", tag_field="type", forbid_unknown_fields=True):
    api_key: Annotated[str, Meta(max_length=MAX_KEY_CHARS)] | None = None


class History(msgspec.Struct, tag="history", tag_field="type", forbid_unknown_fields=True):
    """An earlier page of the attached session's history: the messages before index `before` (a
    `history_start` the client was sent)."""

    before: Annotated[int, Meta(ge=0, le=MAX_SEQ)]


Frame = Hello | User | Cancel | Ping | Auth | History


def decode_frame(frame: object) -> Frame:
    """A frame parsed from JSON, as its Struct; `ApiError` `bad_request` names a bad field."""
    try:
        return msgspec.convert(frame, Frame, strict=True)
    except msgspec.ValidationError as exc:
        raise from_validation_error(exc) from exc
