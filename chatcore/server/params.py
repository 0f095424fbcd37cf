"""Validation of sampling parameters from clients, with messages a client can act on."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

from chatcore.config import Settings
from chatcore.engine.grammar import GrammarError, Grammars, ResponseFormat, parse_response_format
from chatcore.engine.request import MAX_TOP_LOGPROBS, SamplingParams
from chatcore.server.errors import ApiError

MAX_N = 8
MAX_STOPS = 4
MAX_STOP_CHARS = 64
MAX_LOGIT_BIAS = 300
SHAPING_PARAMS = {"presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"}
WS_PARAMS = ({"max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "ignore_eos", "logprobs",
              "top_logprobs", "response_format"} | SHAPING_PARAMS)


def _int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError("bad_request", f"{name} must be an integer")
    if not low <= value <= high:
        raise ApiError("bad_request", f"{name} must be between {low} and {high}")
    return value


def _float(name: str, value: Any, low: float, high: float, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError("bad_request", f"{name} must be a finite number")
    if value > high or value < low or (low_open and value == low):
        raise ApiError("bad_request", f"{name} must be in {'(' if low_open else '['}{low}, {high}]")
    return float(value)


def parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError("bad_request", "stop must be a non-empty string or a list of them")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError("bad_request", f"at most {MAX_STOPS} stop strings of {MAX_STOP_CHARS} characters")
    return tuple(stops)


def parse_logit_bias(value: Any, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token id strings to biases in [-100, 100]; ids are checked against the
    vocabulary when its size is given (else by the engine, when the request is added)."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise ApiError("bad_request", f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids")
    pairs = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise ApiError("bad_request", f"logit_bias key {key!r} is not a token id")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise ApiError("bad_request", f"logit_bias token id {token} is outside the vocabulary "
                                          f"(0..{vocab_size - 1})")
        pairs.append((token, _float(f"logit_bias[{key}]", bias, -100.0, 100.0)))
    return tuple(sorted(pairs))


def _logprobs(raw: dict[str, Any]) -> tuple[bool, int]:
    logprobs = raw.get("logprobs", False)
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise ApiError("bad_request", "logprobs must be a boolean")
    top = _int("top_logprobs", raw["top_logprobs"], 0, MAX_TOP_LOGPROBS) if raw.get("top_logprobs") is not None else 0
    if top and not logprobs:
        raise ApiError("bad_request", "top_logprobs needs logprobs: true")
    return logprobs, top


def sampling_params(raw: Any, settings: Settings, *, allowed: set[str] = WS_PARAMS, vocab_size: int | None = None,
                    default_max_tokens: int = 256, default_temperature: float = 0.7) -> SamplingParams:
    """Build `SamplingParams` from a client's dict; `ApiError` names the first bad field."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ApiError("bad_request", "params must be an object")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ApiError("bad_request", f"unknown params: {', '.join(unknown)}")
    max_tokens = raw.get("max_tokens")
    if max_tokens is None:
        max_tokens = min(default_max_tokens, settings.max_tokens_limit)
    elif isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens > settings.max_tokens_limit:
        raise ApiError("too_large", f"max_tokens is limited to {settings.max_tokens_limit}")
    max_tokens = _int("max_tokens", max_tokens, 1, settings.max_tokens_limit)
    temperature = (_float("temperature", raw["temperature"], 0.0, 2.0) if raw.get("temperature") is not None
                   else default_temperature)
    top_p = _float("top_p", raw["top_p"], 0.0, 1.0, low_open=True) if raw.get("top_p") is not None else 1.0
    top_k = _int("top_k", raw["top_k"], 0, 1_000_000) if raw.get("top_k") is not None else 0
    seed = _int("seed", raw["seed"], -(2**63), 2**63 - 1) if raw.get("seed") is not None else None
    n = _int("n", raw["n"], 1, MAX_N) if raw.get("n") is not None else 1
    ignore_eos = raw.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError("bad_request", "ignore_eos must be a boolean")
    penalties = {name: _float(name, raw[name], -2.0, 2.0) for name in ("presence_penalty", "frequency_penalty")
                 if raw.get(name) is not None}
    if raw.get("repetition_penalty") is not None:
        penalties["repetition_penalty"] = _float("repetition_penalty", raw["repetition_penalty"], 0.0, 2.0,
                                                 low_open=True)
    logprobs, top_logprobs = _logprobs(raw)
    try:
        response_format = parse_response_format(raw.get("response_format"))
    except ValueError as exc:
        raise ApiError("bad_request", str(exc)) from exc
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, n=n,
                          stop=parse_stop(raw.get("stop")), ignore_eos=ignore_eos,
                          logit_bias=parse_logit_bias(raw.get("logit_bias"), vocab_size),
                          logprobs=logprobs, top_logprobs=top_logprobs, response_format=response_format,
                          **penalties)


async def compile_response_format(grammars: Grammars, fmt: ResponseFormat | None,
                                  tokenize: Callable[[Callable[[], None]], Awaitable[None]]) -> None:
    """Compile a request's grammar now, on the tokenizer thread (the first one builds the vocabulary's
    tables), so that a schema the compiler cannot use is a 400, not a failed turn. A request without
    one never waits for that thread."""
    if fmt is None:
        return

    def work() -> None:
        try:
            grammars.compile(fmt)
        except GrammarError as exc:
            raise ApiError("bad_request", f"response_format: {exc}") from exc

    await tokenize(work)
