"""Beam search bookkeeping, step for step the rule of transformers' `num_beams` search with
`early_stopping=True`, so the best beam is the same token for token.

Each step takes the top 2 x width continuations over all running beams (summed log-probs).
Those that end in a stop token, or reach max_tokens, become finished hypotheses (only if they
rank in the top `width`), scored by sum of log-probs / generated_length ** length_penalty.
The best `width` others keep running. The search ends when `width` hypotheses are finished
(with early stopping, transformers' "can a running beam still improve" test only matters
once every slot is full, which ends the search anyway), or when every candidate has stopped.

The engine turns the chosen (parent, token) pairs into forks of the parents' block tables,
so shared history stays stored once and diverging blocks are copied on write.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

NEG = -1.0e9


@dataclass(slots=True)
class Hypothesis:
    score: float
    token_ids: list[int]


@dataclass(slots=True)
class BeamChoice:
    parent: int
    token: int
    score: float


@dataclass
class BeamSearch:
    width: int
    length_penalty: float
    max_tokens: int
    stop_ids: frozenset[int]
    finished: list[Hypothesis] = field(default_factory=list)
    done: bool = False
    generated: int = 0

    @property
    def candidates(self) -> int:
        return max(2, 1 + len(self.stop_ids)) * self.width

    def step(self, values: list[list[float]], ids: list[list[int]], scores: list[float],
             outputs: list[list[int]]) -> list[BeamChoice]:
        """One step over the running beams; returns the next running beams.

        `values` and `ids` are each beam's best log-probs and their ids (`beam_candidates`,
        at least `candidates` per beam), `scores` the beams' summed log-probs so far, `outputs`
        their generated ids. The best `candidates` of every beam hold the best `candidates`
        overall, so this ranks as a top-k over all beams' full rows would. Sums are float32
        additions, as transformers makes them.
        """
        per_beam = np.asarray(values, dtype=np.float32) + np.asarray(scores, dtype=np.float32)[:, None]
        flat = [(float(per_beam[b, j]), b, ids[b][j]) for b in range(len(ids)) for j in range(len(ids[b]))]
        flat.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = flat[: self.candidates]
        sums = [c[0] for c in top]
        parents = [c[1] for c in top]
        tokens = [c[2] for c in top]
        length = self.generated + 1
        at_limit = length >= self.max_tokens
        stops = [at_limit or tok in self.stop_ids for tok in tokens]

        ranked = sorted(range(len(sums)), key=lambda i: sums[i] + (NEG if stops[i] else 0.0), reverse=True)
        running = [BeamChoice(parents[i], tokens[i], sums[i]) for i in ranked[: self.width] if not stops[i]]

        for i in range(min(self.width, len(sums))):
            if stops[i]:
                hyp = Hypothesis(sums[i] / (length ** self.length_penalty), outputs[parents[i]] + [tokens[i]])
                self.finished.append(hyp)
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width:]

        self.generated = length
        self.done = len(self.finished) >= self.width or all(stops) or not running
        return [] if self.done else running

    def results(self) -> list[Hypothesis]:
        return list(self.finished)
