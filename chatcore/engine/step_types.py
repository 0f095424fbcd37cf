"""A step's records, as plain data: what the scheduler planned, what the sampler chose, what the
update appended. Each stage of `EngineCore.step` hands the next one of these and nothing else.

This is a leaf of the engine: it imports requests, outputs and row faults, never a module that holds
state of the step (scheduler, KV cache manager, runner, sampler, update, output processor), so every
stage can name every record without importing another stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chatcore.engine.outputs import TokenLogprob
from chatcore.engine.request import Request, TokenSequence
from chatcore.engine.row_faults import RowFaults


@dataclass(slots=True)
class ScheduledSeq:
    req: Request
    seq: TokenSequence
    start: int
    num_tokens: int
    slots: list[int]
    copies: list[tuple[int, int]]
    # The sequence's physical blocks, in logical order (`KVCacheManager.block_ids`): the step's block table row.
    block_ids: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """After this chunk the sequence's KV covers all its tokens: its logits are needed."""
        return self.start + self.num_tokens == len(self.seq.tokens)


@dataclass(slots=True)
class StepPlan:
    decode: list[ScheduledSeq] = field(default_factory=list)
    prefill: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def entries(self) -> list[ScheduledSeq]:
        """Every row of the step, decode rows first (the order of the step's logits)."""
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(s.num_tokens for s in self.prefill)

    @property
    def copies(self) -> list[tuple[int, int]]:
        return [c for entry in (*self.decode, *self.prefill) for c in entry.copies]

    def drop(self, req: Request) -> int:
        """Remove a preempted request's entries; returns the tokens they had taken."""
        dropped = [e for e in (*self.decode, *self.prefill) if e.req is req]
        self.decode = [e for e in self.decode if e.req is not req]
        self.prefill = [e for e in self.prefill if e.req is not req]
        return sum(e.num_tokens for e in dropped)


@dataclass(frozen=True, slots=True)
class Fork:
    """An n > 1 request's other sample, made from its first as the prompt's first token is due: the
    sampler drew its token; the update gives it its table and its place in the request."""
    req: Request
    parent: TokenSequence
    child: TokenSequence


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A plain sample's chosen token (`sampler.NO_TOKEN` where its row held no distribution) and log-probs."""
    req: Request
    seq: TokenSequence
    token: int
    logprob: TokenLogprob | None


@dataclass(frozen=True, slots=True)
class BeamCandidates:
    """A beam search's best continuations, per running beam: their log-probs and token ids."""
    req: Request
    values: list[list[float]]
    ids: list[list[int]]


@dataclass(slots=True)
class Sampled:
    """A step's sampling, on the host: its time (`now`), the masks' fill time, the forks to make, the
    beam searches' candidates, the plain samples' tokens in row order, and the faults of requests'
    rows (data: the update fails those requests)."""
    now: float
    mask_ms: float
    forks: list[Fork]
    beams: list[BeamCandidates]
    tokens: list[SampledToken]
    faults: RowFaults


@dataclass(frozen=True, slots=True)
class Appended:
    """A token the update appended to its sequence, with the text it released (stop strings cut)."""
    req: Request
    seq: TokenSequence
    token: int
    text: str
    logprob: TokenLogprob | None


@dataclass(slots=True)
class Updated:
    """A step's outcome once applied: the tokens appended, the beam searches stepped (they stream nothing
    until the end), and the requests left with no live sequence, for the engine's one exit path."""
    appended: list[Appended]
    beams: list[Request]
    ended: list[Request]
