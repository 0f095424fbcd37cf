"""What the engine reports: streamed deltas, and the final result of each request."""

from __future__ import annotations

from dataclasses import dataclass, field

from chatcore.outcomes import ErrorCode, FinishReason


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A chosen token's log-prob and the `top_logprobs` best tokens' (best first), from the
    distribution the token was chosen from before temperature, top-k and top-p: the model's
    log-softmax after penalties and logit_bias."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class SeqDelta:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids, when the request asks


@dataclass(slots=True)
class CompletedSeq:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None  # aligned with token_ids, when the request asks


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cached_disk_tokens: int = 0

    @property
    def recomputed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(slots=True)
class Timings:
    queue_ms: float
    ttft_ms: float | None
    total_ms: float
    inter_token_ms: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    deltas: list[SeqDelta] = field(default_factory=list)
    finished: bool = False
    outputs: list[CompletedSeq] = field(default_factory=list)
    usage: Usage | None = None
    timings: Timings | None = None
    error: str | None = None  # for people; `error_code` is what callers act on
    error_code: ErrorCode | None = None
    preempted: bool = False
    # A session's turn: the hashes of the chain its table, now the session's pin, holds (for the disk tier).
    pinned_hashes: list[bytes] = field(default_factory=list)
