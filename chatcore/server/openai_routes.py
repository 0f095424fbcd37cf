"""OpenAI-compatible routes: `POST /v1/chat/completions` (plain and SSE) and `GET /v1/models`.

Without `X-Session-Id` a request is stateless but still shares the prefix cache (under the
tenant's scope). With it, the last user message becomes the session's next turn, so the
history's KV is reused the same way as over the WebSocket.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Stream

from chatcore.engine.outputs import RequestOutput, TokenLogprob
from chatcore.engine.request import SamplingParams
from chatcore.engine.token_logprobs import TokenTexts, chat_content
from chatcore.outcomes import ErrorCode, FinishReason
from chatcore.server.auth import Principal
from chatcore.server.bodies import ChatCompletionRequest, ChatMessage, StreamOptions
from chatcore.server.errors import ApiError, sse_error, turn_error
from chatcore.server.params import compile_response_format, sampling_params, schema_limits
from chatcore.server.services import Services
from chatcore.server.tools import Tools, parse_tools, read_calls
from chatcore.sessions.frames import TurnError
from chatcore.turnlog import log_turn

# OpenAI fields chatcore does not implement. Each is accepted only at the value that asks for nothing
# (clients that send every default keep working) and is otherwise refused, never silently dropped.
UNIMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    "store": lambda v: v is False,
    "metadata": lambda v: v == {},
    "service_tier": lambda v: v in ("auto", "default"),
}


def refuse_unimplemented(data: msgspec.Struct, unimplemented: dict[str, Callable[[Any], bool]]) -> None:
    for name, neutral in unimplemented.items():
        value = getattr(data, name)
        if value is not None and not neutral(value):
            raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           f"{name} is not supported by this server; "
                           f"leave it out (or send {name}: null)")


def refuse_stream_options_without_stream(stream: bool, stream_options: StreamOptions | None) -> None:
    """`stream_options` shapes a stream: on a request that does not stream it would do nothing, so it is
    refused, as OpenAI refuses it (`null` is taken: it asks for nothing)."""
    if stream_options is not None and not stream:
        raise ApiError(ErrorCode.BAD_REQUEST, "stream_options is only allowed when stream is true")


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, str):
        return content
    if content is not None:
        parts = [p.get("text") for p in content if p.get("type") == "text"]
        if all(isinstance(p, str) for p in parts) and parts:
            return "".join(parts)
    raise ApiError(ErrorCode.BAD_REQUEST, "message content must be a string or a list of text parts")


def _tool_calls(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, with their arguments as objects (as chat templates render them)."""
    if not raw:
        raise ApiError(ErrorCode.BAD_REQUEST, "tool_calls must be a non-empty list")
    calls = []
    for call in raw:
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise ApiError(ErrorCode.BAD_REQUEST,
                           "each tool call needs a function with a name and its arguments as a string")
        try:
            arguments = json.loads(fn["arguments"])
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the decoder goes
            arguments = None
        if not isinstance(arguments, dict):
            raise ApiError(ErrorCode.BAD_REQUEST,
                           f"the arguments of tool call {fn['name']!r} must be a JSON object")
        calls.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return calls


def parse_messages(raw: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template. An assistant message may carry `tool_calls` (then its content
    may be null), and a `tool` message answers one by its `tool_call_id`."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        _refuse_unrenderable(i, item)
        role = "system" if item.role == "developer" else item.role
        if role == "assistant" and item.tool_calls is not None:
            content = "" if item.content is None else _text(item.content)
            out.append({"role": role, "content": content, "tool_calls": _tool_calls(item.tool_calls)})
        elif role == "tool":
            if item.tool_call_id is None:
                raise ApiError(ErrorCode.BAD_REQUEST, "a tool message needs the tool_call_id it answers")
            out.append({"role": role, "content": _text(item.content), "tool_call_id": item.tool_call_id})
        else:
            out.append({"role": role, "content": _text(item.content)})
    return out


def _refuse_unrenderable(index: int, item: ChatMessage) -> None:
    """A message field the chat template has no place for, unless it asks for nothing."""
    unrenderable = {"name": item.name is not None, "refusal": item.refusal is not None,
                    "audio": item.audio is not None, "function_call": item.function_call is not None,
                    "annotations": bool(item.annotations),
                    "tool_calls": item.tool_calls is not None and item.role != "assistant",
                    "tool_call_id": item.tool_call_id is not None and item.role != "tool"}
    for field, refused in unrenderable.items():
        if refused:
            raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           f"messages[{index}].{field} is not supported by this server "
                           f"on {item.role} messages; leave it out")


def uses_tools(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def finish_reason(reason: FinishReason) -> FinishReason:
    """OpenAI's finish reasons are stop, length and tool_calls: a cancelled answer reports stop."""
    return reason if reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.TOOL_CALLS) else FinishReason.STOP


def usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Completion:
    def __init__(self, services: Services, texts: TokenTexts | None) -> None:
        """`texts` is given when the request asks for log-probs."""
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = services.model_name
        self.texts = texts

    def logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any] | None:
        return {"content": chat_content(self.texts, entries)} if self.texts is not None else None

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                   "model": self.model, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def full(self, texts: dict[int, str], logprobs: dict[int, list[TokenLogprob]], calls: dict[int, list[Any]],
             reasons: dict[int, FinishReason], usage: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": i, "message": message(texts.get(i, ""), calls.get(i, [])),
                         "logprobs": self.logprobs(logprobs.get(i, [])),
                         "finish_reason": finish_reason(reasons.get(i, FinishReason.STOP))}
                        for i in sorted(set(texts) | set(reasons))],
            "usage": usage,
        }


def message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """An answer's message; with tool calls, its content is the text around them, or null."""
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text.strip() or None, "tool_calls": calls}


async def engine_events(services: Services, principal_tenant: str, prompt_of: Callable[[], list[int]],
                        params: SamplingParams, max_tokens_given: bool = True, *,
                        chars: int) -> AsyncIterator[tuple[str, Any]]:
    """Stateless: ('delta', (index, text, logprobs or None)) events, then ('done', (reasons, usage
    triple)). `prompt_of` gives the prompt's token ids, on the tokenizer thread, from text of `chars`
    characters (0 for token ids), refused before it is tokenized if it cannot fit the context; `params`'
    grammar is compiled here, within the tenant's slot. A default `max_tokens` (not `max_tokens_given`)
    shrinks to the context the prompt leaves."""
    engine = services.engine
    services.sessions.check_chars(chars, engine.info.max_context, "the prompt", "the context")
    slots = services.sessions.slots  # the same per-tenant bound as session turns, in sequences
    slots.take(principal_tenant, params.num_sequences)  # before the first await: tokenizing and compiling count too
    final: RequestOutput | None = None
    try:
        prompt = await services.sessions.tokenize(principal_tenant, prompt_of)
        params = await compile_response_format(engine.grammar_compiler, params, principal_tenant)
        context = engine.info.max_context
        if not max_tokens_given and len(prompt) < context:
            params = replace(params, max_tokens=min(params.max_tokens, context - len(prompt)))
        request = engine.make_request(prompt, params, scope_key=services.sessions.scope_key(principal_tenant),
                                      tenant=principal_tenant)
        engine.check_fits(request)  # `RequestRejected` (`too_large`) and `QueueFull` (`busy`) carry their code
        async with aclosing(engine.generate(request)) as stream:
            async for out in stream:
                for delta in out.deltas:
                    if delta.text or delta.logprobs:
                        yield "delta", (delta.index, delta.text, delta.logprobs)
                if out.finished:
                    final = out
    finally:
        slots.give(principal_tenant, params.num_sequences)
    assert final is not None and final.usage is not None and final.timings is not None
    reasons = {o.index: o.finish_reason for o in final.outputs}
    if final.error_code is not None:
        raise ApiError(final.error_code, final.error or "the request failed")
    usage, timings = final.usage, final.timings
    services.metrics.record_request(next(iter(reasons.values()), FinishReason.STOP), usage.prompt_tokens,
                                    usage.cached_tokens - usage.cached_disk_tokens, usage.cached_disk_tokens,
                                    timings.queue_ms, timings.ttft_ms, timings.inter_token_ms)
    log_turn(tenant_id=principal_tenant, session_id=None, request_id=request.request_id,
             prompt_tokens=usage.prompt_tokens, cached_device=usage.cached_tokens - usage.cached_disk_tokens,
             cached_disk=usage.cached_disk_tokens, ttft_ms=timings.ttft_ms, completion_tokens=usage.completion_tokens,
             finish_reason=",".join(sorted(set(reasons.values()))))
    yield "done", (reasons, (usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens))


async def _session_events(services: Services, tenant_id: str, session_id: str, messages: list[dict[str, Any]],
                          params: SamplingParams, max_tokens_given: bool) -> AsyncIterator[tuple[str, Any]]:
    """With X-Session-Id: the last user message is the session's next turn."""
    if messages[-1]["role"] != "user":
        raise ApiError(ErrorCode.BAD_REQUEST, "with X-Session-Id the last message must be the user's new turn")
    state = await services.sessions.open(tenant_id, session_id)
    frames = await services.turns.start(state, messages[-1]["content"], params, client_id=None,
                                        max_tokens_given=max_tokens_given)
    queue = frames.subscribe(None)
    error = ApiError(ErrorCode.INTERNAL, "the turn failed")
    try:
        while True:
            frame = await queue.get()
            if isinstance(frame, TurnError):  # precedes a failed turn's done: busy (no capacity), conflict, ...
                error = turn_error(frame)
            elif frame["type"] == "token":
                yield "delta", (frame["index"], frame["text"], None)
            elif frame["type"] == "done":
                usage = frame["usage"]
                if frame["finish_reason"] == FinishReason.ERROR:
                    raise error
                reasons = {i: frame["finish_reason"] for i in range(params.n)}
                yield "done", (reasons, (usage["prompt_tokens"], usage["cached_tokens"], usage["completion_tokens"]))
                return
    finally:
        frames.unsubscribe(queue)
        if not frames.finished.is_set() and frames.attached == 0:
            services.turns.arm_grace(state)  # the HTTP client left mid-answer, like a dropped socket


def _tools(services: Services, data: ChatCompletionRequest, messages: list[dict[str, Any]]) -> Tools | None:
    """The request's tools; a 400 where the model's chat template cannot take them."""
    tools = parse_tools(data)
    if (tools is not None or uses_tools(messages)) and not services.sessions.template.takes_tools:
        raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                       "tools: this model's chat template does not support tools (it "
                       "neither shows them to the model nor defines <tool_call> blocks)")
    return tools


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request[Any, Any, Any], data: ChatCompletionRequest, services: Services,
                           principal: Principal) -> Response[Any]:
    refuse_unimplemented(data, UNIMPLEMENTED)
    refuse_stream_options_without_stream(data.stream, data.stream_options)
    messages = parse_messages(data.messages)
    max_tokens = data.max_completion_tokens if data.max_completion_tokens is not None else data.max_tokens
    params = sampling_params(data, services.settings, vocab_size=services.engine.info.vocab_size,
                             max_tokens=max_tokens, logprobs=bool(data.logprobs), top_logprobs=data.top_logprobs or 0,
                             default_temperature=1.0, default_max_tokens=512)
    tools = _tools(services, data, messages)
    call_format = tools.grammar(schema_limits(services.settings)) if tools is not None else None
    if call_format is not None:
        if params.response_format is not None:
            raise ApiError(ErrorCode.BAD_REQUEST, "response_format cannot be combined with a required tool call")
        params = replace(params, response_format=call_format)
    session_id = request.headers.get("x-session-id")
    if session_id:
        if params.logprobs:
            raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           "logprobs is not supported with X-Session-Id; leave it out "
                           "(or send logprobs: false)")
        if tools is not None or uses_tools(messages):
            raise ApiError(ErrorCode.UNSUPPORTED_PARAMETER,
                           "tools are not supported with X-Session-Id (a session keeps "
                           "no tool calls); send the whole conversation instead")
        events = _session_events(services, principal.tenant_id, session_id, messages, params, max_tokens is not None)
    else:
        engine = services.engine
        shown = tools.for_template if tools is not None else None
        events = engine_events(services, principal.tenant_id, lambda: engine.chat_prompt(messages, shown), params,
                               max_tokens is not None, chars=sum(len(m.get("content") or "") for m in messages))
        if tools is not None and tools.choice != "none":
            events = read_calls(events, tools)
    completion = Completion(services, services.sessions.token_texts if params.logprobs else None)
    if data.stream:
        include_usage = data.stream_options is not None and data.stream_options.include_usage
        first = await anext(events)  # errors before the first event become plain HTTP errors
        return Stream(_sse(completion, first, events, params.n, include_usage), media_type="text/event-stream",
                      headers={"Cache-Control": "no-cache"})
    return await _whole(completion, events)


async def _whole(completion: Completion, events: AsyncIterator[tuple[str, Any]]) -> Response[Any]:
    """A completion that is not streamed: the events gathered into one response."""
    texts: dict[int, str] = {}
    logprobs: dict[int, list[TokenLogprob]] = {}
    calls: dict[int, list[Any]] = {}
    async for kind, value in events:
        if kind == "delta":
            index, text, token_logprobs = value
            texts[index] = texts.get(index, "") + text
            logprobs.setdefault(index, []).extend(token_logprobs or ())
        elif kind == "call":
            index, _, call = value
            calls.setdefault(index, []).append(call)
        else:
            reasons, (prompt, cached, completion_tokens) = value
            return Response(completion.full(texts, logprobs, calls, reasons, usage(prompt, cached, completion_tokens)))
    raise ApiError(ErrorCode.INTERNAL, "the request ended without a result")


async def _sse(completion: Completion, first: tuple[str, Any], events: AsyncIterator[tuple[str, Any]], n: int,
               include_usage: bool) -> AsyncIterator[str]:
    async with aclosing(events):
        for i in range(n):
            yield completion.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        pending: list[tuple[str, Any]] = [first]
        while True:
            if pending:
                kind, value = pending.pop()
            else:
                try:
                    kind, value = await anext(events)
                except StopAsyncIteration:
                    break
                except Exception as exc:  # the stream has begun: its error is its last event
                    yield sse_error(exc)
                    break
            if kind == "delta":
                index, text, logprobs = value
                yield completion.chunk([{"index": index, "delta": {"content": text},
                                         "logprobs": completion.logprobs(logprobs or []), "finish_reason": None}])
            elif kind == "call":
                index, number, call = value
                yield completion.chunk([{"index": index, "delta": {"tool_calls": [{"index": number, **call}]},
                                         "finish_reason": None}])
            else:
                reasons, (prompt, cached, completion_tokens) = value
                yield completion.chunk([{"index": i, "delta": {}, "finish_reason": finish_reason(r)}
                                        for i, r in sorted(reasons.items())])
                if include_usage:
                    yield completion.chunk([], usage(prompt, cached, completion_tokens))
                break
    yield "data: [DONE]\n\n"


@get("/v1/models")
async def list_models(services: Services) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": services.model_name, "object": "model", "created": 0,
                                        "owned_by": "chatcore"}]}
