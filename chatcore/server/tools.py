"""Tools on chat completions: the request's `tools` and `tool_choice`, and tool calls read from answers.

A model takes tools when its chat template renders them (the tools go into its prompt through the
template) and writes its calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
as Hermes-style templates (Qwen 2.5, Qwen 3 and others) do. Any other template gets a clear 400:
without a template that shows the model the tools, the model cannot call them, and without the
block format, chatcore could not read its calls.

`tool_choice`:
- `auto` (the default with tools): the model decides; whole, well-formed blocks in its answer become
  `tool_calls`, anything else stays text;
- `required`, or a named function: the answer is constrained by a grammar (`ResponseFormat` kind
  `tool_call`) to one block calling one of the allowed functions, with arguments the function's
  `parameters` schema validates;
- `none`: the tools are still shown to the model, but it is not asked to call one and nothing is parsed.
With `parallel_tool_calls: false`, at most the first call is returned.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from chatcore.engine.grammar import ResponseFormat
from chatcore.engine.schema_limits import SchemaLimits, SchemaTooComplex
from chatcore.outcomes import ErrorCode, FinishReason
from chatcore.server.bodies import ChatCompletionRequest, NamedToolChoice
from chatcore.server.errors import ApiError
from chatcore.sessions.template import TOOL_CALL_CLOSE as CLOSE
from chatcore.sessions.template import TOOL_CALL_OPEN as OPEN

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True, slots=True)
class Tools:
    functions: tuple[dict[str, Any], ...]  # OpenAI `function` objects, as sent
    choice: str  # "auto", "required", "none", or a function name
    parallel: bool

    @property
    def for_template(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions]

    def grammar(self, limits: SchemaLimits) -> ResponseFormat | None:
        """The constraint of `required` or a named choice: one call of an allowed function (whose
        `parameters` schemas must keep within `limits`, together)."""
        if self.choice in ("auto", "none"):
            return None
        allowed = [f for f in self.functions if self.choice == "required" or f["name"] == self.choice]
        try:
            limits.check([(f"the parameters of tool {f['name']!r}", f.get("parameters") or {}) for f in allowed])
        except SchemaTooComplex as exc:
            raise ApiError(ErrorCode.BAD_REQUEST, f"tools: {exc}") from exc
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": f["name"]},
                                 "arguments": f.get("parameters") or {"type": "object"}}} for f in allowed]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return ResponseFormat("tool_call", json.dumps(schema, sort_keys=True))


def parse_tools(request: ChatCompletionRequest) -> Tools | None:
    """A chat completion request's `tools`, `tool_choice` and `parallel_tool_calls` (None without tools);
    `ApiError` names the first bad field."""
    raw, choice = request.tools, request.tool_choice
    if not raw:
        if choice not in (None, "none"):
            raise ApiError(ErrorCode.BAD_REQUEST, "tool_choice needs tools")
        return None
    functions = []
    for i, tool in enumerate(raw):
        fn = tool.get("function") if tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not FUNCTION_NAME.fullmatch(fn["name"]):
            raise ApiError(ErrorCode.BAD_REQUEST,
                           f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": "
                           "1-64 letters, digits, _ or -, ...}}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ApiError(ErrorCode.BAD_REQUEST, f"tools[{i}].function.parameters must be a JSON schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ApiError(ErrorCode.BAD_REQUEST, f"tools[{i}].function.description must be a string")
        functions.append(fn)
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ApiError(ErrorCode.BAD_REQUEST, "tools must have distinct names")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(ErrorCode.BAD_REQUEST, "tool_choice must name one of the tools")
        choice = choice.function.name
    elif choice not in ("auto", "required", "none"):
        raise ApiError(ErrorCode.BAD_REQUEST, "tool_choice must be 'auto', 'required', 'none' or a named function")
    return Tools(tuple(functions), choice, request.parallel_tool_calls is not False)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def openai_call(call: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


def _call(body: str, names: set[str]) -> dict[str, Any] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return {"name": call["name"], "arguments": arguments} if isinstance(arguments, dict) else None


class CallReader:
    """Reads an answer as it streams: text outside whole, well-formed blocks comes out as text, each
    block as a call. Text that may still become a block is held back until it is clearly not one."""

    def __init__(self, tools: Tools) -> None:
        self.names = {f["name"] for f in tools.functions}
        self.parallel = tools.parallel
        self.calls = 0
        self._pending = ""

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self._pending += text
        out: list[tuple[str, Any]] = []
        while self._pending:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._pending, OPEN)
                self._emit_text(out, self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            end = self._pending.find(CLOSE, start + len(OPEN))
            if end < 0:  # an open block: wait for its end
                self._emit_text(out, self._pending[:start])
                self._pending = self._pending[start:]
                break
            self._emit_text(out, self._pending[:start])
            block = self._pending[start: end + len(CLOSE)]
            self._pending = self._pending[end + len(CLOSE):]
            call = _call(block[len(OPEN): -len(CLOSE)], self.names)
            if call is None:
                self._emit_text(out, block)
            elif self.parallel or self.calls == 0:
                self.calls += 1
                out.append(("call", call))
        return out

    def close(self) -> list[tuple[str, Any]]:
        """The end of the answer: whatever is held back is text."""
        out: list[tuple[str, Any]] = []
        self._emit_text(out, self._pending)
        self._pending = ""
        return out

    @staticmethod
    def _emit_text(out: list[tuple[str, Any]], text: str) -> None:
        if text:
            out.append(("text", text))


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0



Event = tuple[str, Any]


async def read_calls(events: AsyncIterator[Event], tools: Tools) -> AsyncIterator[Event]:
    """Chat completion events with each choice's calls taken out of its text: ('delta', (index, text,
    logprobs)) for the text around them, ('call', (index, call number, OpenAI tool call)) for each,
    and a `tool_calls` finish for a choice that called one."""
    readers: dict[int, CallReader] = {}
    async with aclosing(events):
        async for kind, value in events:
            if kind != "delta":
                reasons, counts = value
                for index, reader in readers.items():
                    rest = "".join(part for _, part in reader.close())
                    if rest:
                        yield "delta", (index, rest, None)
                called = {i for i, reader in readers.items() if reader.calls}
                yield "done", ({i: FinishReason.TOOL_CALLS if r == FinishReason.STOP and i in called else r
                                for i, r in reasons.items()}, counts)
                return
            index, text, logprobs = value
            reader = readers.setdefault(index, CallReader(tools))
            parts = reader.feed(text)
            calls = [part for kind, part in parts if kind == "call"]
            shown = "".join(part for kind, part in parts if kind == "text")
            if shown or logprobs:
                yield "delta", (index, shown, logprobs)
            for number, call in enumerate(calls, reader.calls - len(calls)):
                yield "call", (index, number, openai_call(call, new_call_id()))
