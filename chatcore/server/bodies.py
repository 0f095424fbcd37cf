"""The HTTP request bodies, as `msgspec.Struct`s: their fields, types and limits are validated when a body
is decoded (chatcore/server/body_decoding.py) and shown in `/schema/openapi.json`. Unknown fields are
refused; the fields of OpenAI's APIs that chatcore does not implement are declared, so that the routes
refuse them by name with `unsupported_parameter`, unless they ask for nothing."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from chatcore.server.params import ChatSampling, Sampling

MAX_TITLE = 200
MAX_SYSTEM_PROMPT = 100_000
MAX_IMPORT_MESSAGES = 2000
MAX_LEGACY_LOGPROBS = 5
MAX_TOOLS = 64

Title = Annotated[str, Meta(max_length=MAX_TITLE)]
# A title is shown in terminals and lists: no control character (an escape sequence would run in a terminal
# that prints it). NUL has its own refusal (`body_decoding.nul_error`), as in every other text.
TITLE_CONTROLS = re.compile(r"[\x01-\x1f\x7f-\x9f]")
SystemPrompt = Annotated[str, Meta(max_length=MAX_SYSTEM_PROMPT)]
Role = Literal["system", "user", "assistant", "developer", "tool"]


def check_title(title: str | None) -> None:
    """Refuse a title holding a control character (a `__post_init__` check: msgspec reports it as a
    validation error, so the client gets `bad_request`)."""
    if title is not None and TITLE_CONTROLS.search(title):
        raise ValueError("title must not contain control characters (U+0001 to U+001F, U+007F to U+009F)")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """A chat message. OpenAI's other message fields are declared so that a client may send back the
    assistant messages it received (with `refusal`, `audio`, `function_call` null and `annotations`
    empty); any of them that asks for something the chat template cannot render, `name` included, is
    refused by name (`openai_routes.parse_messages`)."""

    role: Role
    content: str | Annotated[list[dict[str, Any]], Meta(description="text parts")] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(ChatSampling, kw_only=True):
    """`POST /v1/chat/completions`; `top_k`, `ignore_eos` and `repetition_penalty` are extensions."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    model: str | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Annotated[str, Meta(description='"auto", "required" or "none"')] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: Annotated[bool, Meta(description="not implemented: false only")] | None = None
    metadata: Annotated[dict[str, Any], Meta(description="not implemented: {} only")] | None = None
    service_tier: Annotated[str, Meta(description='not implemented: "auto" or "default" only')] | None = None


class CompletionRequest(Sampling, kw_only=True):
    """`POST /v1/completions`: a string, or a list of token ids."""

    prompt: str | list[Any]
    model: str | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LEGACY_LOGPROBS)] | None = None
    echo: Annotated[bool, Meta(description="not implemented: false only")] | None = None
    suffix: Annotated[str, Meta(description='not implemented: "" only')] | None = None
    best_of: Annotated[int, Meta(description="not implemented: 1 only")] | None = None


class NewSession(msgspec.Struct, forbid_unknown_fields=True):
    title: Title | None = None
    system_prompt: SystemPrompt | None = None

    def __post_init__(self) -> None:
        check_title(self.title)


class Rename(msgspec.Struct, forbid_unknown_fields=True):
    title: Title

    def __post_init__(self) -> None:
        check_title(self.title)


class Branch(msgspec.Struct, forbid_unknown_fields=True):
    turns: Annotated[int, Meta(ge=0, description="the number of complete exchanges the branch keeps")]


class ImportedMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str


class ImportSession(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Whole exchanges: a user message, then its answer."""

    title: Title | None = None
    system_prompt: SystemPrompt | None = None
    messages: Annotated[list[ImportedMessage], Meta(min_length=2, max_length=MAX_IMPORT_MESSAGES)]

    def __post_init__(self) -> None:
        check_title(self.title)
