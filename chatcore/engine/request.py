"""Requests, their sequences, and the state machine they move through.

A request holds one sequence until its prompt is computed; then `n > 1` sampling or beam
search forks it. Sequences of one request are scheduled, preempted and re-admitted together.

    WAITING --admit--> RUNNING --finish--> FINISHED
       ^                  |
       +----preempt-------+          (any state) --abort/error--> FINISHED

A sequence's KV covers positions [0, num_computed). Each step computes the next chunk of
tokens; when a sequence's KV covers all its tokens but the last sampled one, it samples.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from chatcore.cache import chain_hashes
from chatcore.engine.grammar import ResponseFormat
from chatcore.engine.outputs import TokenLogprob
from chatcore.outcomes import ErrorCode, FinishReason

MAX_TOP_LOGPROBS = 20


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


GREEDY_TEMPERATURE = 1e-5
# The smallest repetition penalty. A seen token's positive logit is divided by it, and sampling then
# divides by a temperature of at least GREEDY_TEMPERATURE: at these floors a row is scaled by at most
# 1e7, so every float32 logit below 3e31 stays finite. A penalty of 1e-300 is 0 in float32 (a division
# by zero: infinities, then NaN probabilities).
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    beam_width: int = 1
    length_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Logit shaping (chatcore/engine/penalties.py): OpenAI's presence and frequency penalties over
    # the generated tokens, vLLM's repetition penalty over prompt + generated, and (token id, bias) pairs.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Report each chosen token's log-prob, and its `top_logprobs` best alternatives.
    logprobs: bool = False
    top_logprobs: int = 0
    # Only output this grammar accepts (chatcore/engine/grammar.py): JSON, or JSON a schema validates.
    response_format: ResponseFormat | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError("temperature must be a finite number >= 0")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.n < 1 or self.beam_width < 1:
            raise ValueError("n and beam_width must be >= 1")
        if self.n > 1 and self.beam_width > 1:
            raise ValueError("n > 1 and beam search cannot be combined")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not all(math.isfinite(p) and -2 <= p <= 2 for p in (self.presence_penalty, self.frequency_penalty)):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if not (math.isfinite(self.repetition_penalty) and MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2):
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2]")
        if any(token < 0 or not (math.isfinite(bias) and -100 <= bias <= 100) for token, bias in self.logit_bias):
            raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS or (self.top_logprobs and not self.logprobs):
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, and needs logprobs")
        if self.beam_width > 1 and (self.shapes_logits or self.logprobs):
            raise ValueError("beam search does not combine with penalties, logit_bias or logprobs")
        if self.beam_width > 1 and self.response_format is not None:
            raise ValueError("beam search does not combine with response_format")

    @property
    def shapes_logits(self) -> bool:
        """Whether penalties or a logit bias change this request's logits before it samples."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
                or bool(self.logit_bias))

    @property
    def greedy(self) -> bool:
        """Below `GREEDY_TEMPERATURE` sampling is greedy: logits divided by a smaller temperature overflow
        float32 (inf, then NaN probabilities), and the distribution is one token anyway."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def num_sequences(self) -> int:
        return max(self.n, self.beam_width)


@dataclass(eq=False)
class TokenSequence:
    """One output stream. `tokens` = prompt + generated; KV covers tokens[:num_computed]."""

    index: int
    tokens: list[int]
    prompt_len: int
    num_computed: int = 0
    finish_reason: FinishReason | None = None
    stop_text_cut: int | None = None
    cum_logprob: float = 0.0
    # One entry per generated token when the request asks for logprobs.
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def to_compute(self) -> int:
        return len(self.tokens) - self.num_computed


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    state: RequestState = RequestState.WAITING
    seqs: list[TokenSequence] = field(default_factory=list)
    # The cache salt (model, block size, dtype, scope): set by the engine, per tenant if scoped.
    salt: bytes = b""
    # Whose request it is: the account its grammar masks are charged to (chatcore/engine/mask_budget.py).
    tenant: str = "local"
    # Prompt tokens served from the cache at first admission (device), and from the disk tier.
    cached_tokens: int = 0
    cached_disk_tokens: int = 0
    # The session whose turn this is: when it ends well, its first sample's table becomes the
    # session's pin (`KVCacheManager.free`, by `chatcore.engine.pins.keeps_pin`) instead of being released.
    session_id: str | None = None
    forked: bool = False
    preemptions: int = 0
    waiting_since: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    error: str | None = None
    error_code: ErrorCode | None = None  # set with `error`, when the request failed
    _prompt_hashes: list[bytes] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.seqs:
            self.seqs = [TokenSequence(0, list(self.prompt), len(self.prompt))]

    def prompt_hashes(self, block_size: int) -> list[bytes]:
        """The prefix-cache keys of the prompt's full blocks (set `salt` first); computed once."""
        if self._prompt_hashes is None:
            self._prompt_hashes = chain_hashes(self.prompt, block_size, self.salt)
        return self._prompt_hashes

    def fail(self, code: ErrorCode, message: str, reason: FinishReason) -> None:
        """Mark the request failed: `code` for the caller to act on, `message` for people, and
        `reason` on every sequence still live."""
        self.error, self.error_code = message, code
        for seq in self.live_seqs:
            seq.finish_reason = reason

    @property
    def live_seqs(self) -> list[TokenSequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED
