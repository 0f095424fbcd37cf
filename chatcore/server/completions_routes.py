"""OpenAI's legacy `POST /v1/completions`: a prompt (a string, or token ids) continued as it is,
with no chat template; plain or SSE, stateless, sharing the prefix cache like chat completions."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from litestar import Response, post
from litestar.response import Stream

from chatcore.engine.outputs import TokenLogprob
from chatcore.engine.token_logprobs import TokenTexts, legacy
from chatcore.outcomes import ErrorCode, FinishReason
from chatcore.server.auth import Principal
from chatcore.server.bodies import CompletionRequest
from chatcore.server.errors import ApiError, sse_error
from chatcore.server.openai_routes import (
    engine_events,
    finish_reason,
    refuse_stream_options_without_stream,
    refuse_unimplemented,
    usage,
)
from chatcore.server.params import sampling_params
from chatcore.server.services import Services

# Accepted only at the value that asks for nothing, else 400 unsupported_parameter.
UNIMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1 and not isinstance(v, bool),
}


def _prompt(value: str | list[Any], vocab_size: int) -> str | list[int]:
    """A non-empty string, or a non-empty list of token ids in the vocabulary."""
    if isinstance(value, str):
        if not value:
            raise ApiError(ErrorCode.BAD_REQUEST, "prompt must not be empty")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = next((t for t in value if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(ErrorCode.BAD_REQUEST,
                           f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
        return list(value)
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                       "prompt: a batch of prompts is not supported by this server; "
                       "send one string or one list of token ids")
    raise ApiError(ErrorCode.BAD_REQUEST, "prompt must be a non-empty string or a non-empty list of token ids")


def _prompt_ids(tokenizer: Any, prompt: str | list[int]) -> Callable[[], list[int]]:
    """What the tokenizer thread runs for the prompt: a string is tokenized as it is (no template)."""
    if isinstance(prompt, list):
        return lambda: prompt
    return lambda: list(tokenizer(prompt)["input_ids"])


class TextCompletion:
    """One response's identity, and its choices' texts, log-probs and token offsets so far."""

    def __init__(self, services: Services, texts: TokenTexts | None) -> None:
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = services.model_name
        self.texts = texts
        self.text: dict[int, str] = {}
        self.logprobs: dict[int, list[TokenLogprob]] = {}
        self.offsets: dict[int, list[int]] = {}

    def add(self, index: int, text: str, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """Record a delta; returns its log-probs in the legacy shape (None unless asked for)."""
        start = len(self.text.get(index, ""))
        self.text[index] = self.text.get(index, "") + text
        if self.texts is None:
            return None
        entries = logprobs or []
        self.logprobs.setdefault(index, []).extend(entries)
        self.offsets.setdefault(index, []).extend([start] * len(entries))
        return legacy(self.texts, entries, [start] * len(entries))

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        payload: dict[str, Any] = {"id": self.id, "object": "text_completion", "created": self.created,
                                   "model": self.model, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return payload

    def full(self, reasons: dict[int, FinishReason], usage: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for i in sorted(set(self.text) | set(reasons)):
            logprobs = (legacy(self.texts, self.logprobs.get(i, []), self.offsets.get(i, []))
                        if self.texts is not None else None)
            choices.append({"index": i, "text": self.text.get(i, ""), "logprobs": logprobs,
                            "finish_reason": finish_reason(reasons.get(i, FinishReason.STOP))})
        return self.body(choices, usage)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


@post("/v1/completions", status_code=200)
async def completions(data: CompletionRequest, services: Services, principal: Principal) -> Response[Any]:
    refuse_unimplemented(data, UNIMPLEMENTED)
    refuse_stream_options_without_stream(data.stream, data.stream_options)
    vocab_size = services.engine.info.vocab_size
    prompt = _prompt(data.prompt, vocab_size)
    # `logprobs: k`: each token's log-prob and its k best alternatives.
    params = sampling_params(data, services.settings, vocab_size=vocab_size, max_tokens=data.max_tokens,
                             logprobs=data.logprobs is not None, top_logprobs=data.logprobs or 0,
                             default_temperature=1.0, default_max_tokens=16)
    events = engine_events(services, principal.tenant_id, _prompt_ids(services.engine.info.tokenizer, prompt), params,
                           data.max_tokens is not None, chars=len(prompt) if isinstance(prompt, str) else 0)
    completion = TextCompletion(services, services.sessions.token_texts if params.logprobs else None)
    if data.stream:
        include_usage = data.stream_options is not None and data.stream_options.include_usage
        first = await anext(events)  # errors before the first event become plain HTTP errors
        return Stream(_stream(completion, first, events, include_usage), media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache"})
    async for kind, value in events:
        if kind == "delta":
            completion.add(*value)
        else:
            reasons, (prompt_tokens, cached, completion_tokens) = value
            return Response(completion.full(reasons, usage(prompt_tokens, cached, completion_tokens)))
    raise ApiError(ErrorCode.INTERNAL, "the request ended without a result")


async def _stream(completion: TextCompletion, first: tuple[str, Any], events: AsyncIterator[tuple[str, Any]],
                  include_usage: bool) -> AsyncIterator[str]:
    async with aclosing(events):
        event: tuple[str, Any] | None = first
        while event is not None:
            kind, value = event
            if kind == "delta":
                index, text, logprobs = value
                legacy_logprobs = completion.add(index, text, logprobs)
                yield _sse(completion.body([{"index": index, "text": text, "logprobs": legacy_logprobs,
                                             "finish_reason": None}]))
            else:
                reasons, (prompt_tokens, cached, completion_tokens) = value
                yield _sse(completion.body([{"index": i, "text": "", "logprobs": None,
                                             "finish_reason": finish_reason(r)} for i, r in sorted(reasons.items())]))
                if include_usage:
                    yield _sse(completion.body([], usage(prompt_tokens, cached, completion_tokens)))
                break
            try:
                event = await anext(events)
            except StopAsyncIteration:
                event = None
            except Exception as exc:  # the stream has begun: its error is its last event
                yield sse_error(exc)
                event = None
    yield "data: [DONE]\n\n"
