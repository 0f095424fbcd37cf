"""The sampling fields clients send, as a `msgspec.Struct` with their types and limits, and their
translation into `SamplingParams`, with messages a client can act on."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from chatcore.config import Settings
from chatcore.engine.grammar import GrammarCompiler, parse_response_format
from chatcore.engine.request import MAX_TOP_LOGPROBS, MIN_REPETITION_PENALTY, SamplingParams
from chatcore.engine.schema_limits import SchemaLimits
from chatcore.outcomes import ErrorCode
from chatcore.server.errors import ApiError

MAX_N = 8
MAX_STOPS = 4
MAX_STOP_CHARS = 64
MAX_LOGIT_BIAS = 300
MAX_TOP_K = 1_000_000

Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]


class Sampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The sampling fields every generating request takes (its max_tokens limit is the server's setting)."""

    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=MAX_TOP_K, description="0: no top-k cut (an extension)")] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] | None = None
    stop: StopString | Annotated[list[StopString], Meta(max_length=MAX_STOPS)] | None = None
    ignore_eos: Annotated[bool, Meta(description="do not stop at end-of-sequence tokens (an extension)")] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(ge=MIN_REPETITION_PENALTY, le=2.0, description=(
        "an extension; below 0.01 a seen token's logit would overflow float32"))] | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS,
                                                 description="token id -> bias in [-100, 100]")] | None = None
    response_format: Annotated[dict[str, Any], Meta(
        description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                    '{"name", "schema", "strict", "description"}}')] | None = None


class ChatSampling(Sampling, kw_only=True):
    """The sampling fields with chat log-probs: a boolean, and how many alternatives each token lists."""

    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


def parse_logit_bias(value: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id strings to biases in [-100, 100]; ids are checked against the vocabulary."""
    if value is None:
        return ()
    pairs = []
    digits = len(str(vocab_size - 1))
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError(ErrorCode.BAD_REQUEST, f"logit_bias key {key[:20]!r} is not a token id")
        significant = key.lstrip("0") or "0"
        if len(significant) > digits:  # checked before int(), which refuses strings of over 4,300 digits
            raise ApiError(ErrorCode.BAD_REQUEST,
                           f"logit_bias key {key[:20]!r}... is outside the vocabulary "
                           f"(0..{vocab_size - 1})")
        token = int(significant)
        if token >= vocab_size:
            raise ApiError(ErrorCode.BAD_REQUEST,
                           f"logit_bias token id {token} is outside the vocabulary "
                           f"(0..{vocab_size - 1})")
        if not -100.0 <= bias <= 100.0:
            raise ApiError(ErrorCode.BAD_REQUEST, f"logit_bias[{token}] must be in [-100.0, 100.0]")
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


def sampling_params(fields: Sampling, settings: Settings, *, vocab_size: int, max_tokens: int | None,
                    logprobs: bool, top_logprobs: int, default_max_tokens: int,
                    default_temperature: float) -> SamplingParams:
    """`SamplingParams` from a request's fields (their types and fixed limits checked when it was decoded);
    `ApiError` names the first bad field. `max_tokens` and the log-probs are given apart: each API names
    them its own way."""
    if max_tokens is None:
        max_tokens = min(default_max_tokens, settings.max_tokens_limit)
    elif max_tokens > settings.max_tokens_limit:
        raise ApiError(ErrorCode.TOO_LARGE, f"max_tokens is limited to {settings.max_tokens_limit}")
    if top_logprobs and not logprobs:
        raise ApiError(ErrorCode.BAD_REQUEST, "top_logprobs needs logprobs: true")
    stop = fields.stop
    penalties = {name: value for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
                 if (value := getattr(fields, name)) is not None}
    try:
        response_format = parse_response_format(fields.response_format, schema_limits(settings))
    except ValueError as exc:
        raise ApiError(ErrorCode.BAD_REQUEST, str(exc)) from exc
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=default_temperature if fields.temperature is None else fields.temperature,
        top_p=1.0 if fields.top_p is None else fields.top_p, top_k=fields.top_k or 0, seed=fields.seed,
        n=fields.n or 1, stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        ignore_eos=bool(fields.ignore_eos), logit_bias=parse_logit_bias(fields.logit_bias, vocab_size),
        logprobs=logprobs, top_logprobs=top_logprobs, response_format=response_format, **penalties)


def schema_limits(settings: Settings) -> SchemaLimits:
    return SchemaLimits(settings.max_schema_bytes, settings.max_schema_depth, settings.max_schema_enum_values)


async def compile_response_format(compiler: GrammarCompiler, params: SamplingParams, tenant_id: str) -> SamplingParams:
    """`params` with its grammar compiled (on the compile pool: chatcore/engine/grammar.py), so that a
    schema the compiler cannot use is a 400, not a failed turn. Called once the request holds its
    tenant's turn slot: a compile counts against `max_turns_per_tenant`. A request without a
    `response_format` never waits."""
    if params.response_format is None:
        return params
    # `GrammarError` (`bad_request`) or `GrammarBusy` (`busy`): each carries its code (`to_api_error`)
    compiled = await compiler.compile_async(params.response_format, tenant_id)
    return replace(params, response_format=compiled)
