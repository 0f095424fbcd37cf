"""A step's sampling, after the forward pass: it computes tokens and changes no request, table or token list.

`StepSampler.sample` is its one entry point. For n > 1 requests whose prompt was just computed it makes
the other samples (`Fork`: each a sequence with its parent's penalty counts and grammar state, drawing
from the first sample's row); it applies the grammar masks, queues every sampling row's choice on the
device (`StepChoices`) and beam search's candidates, and brings all of them to the host in the step's
one download. It returns a `Sampled` (engine/step_types.py): the forks, the beam candidates, the plain
samples' tokens in row order, and the faults of requests' rows as data (`RowFaults`), all of which the
step's update applies (engine/step_update.py). Its own state is what sampling needs next: each sample's
generator, and (in `Penalties`) the counts of the tokens it chose.
"""

from __future__ import annotations

import logging
import time

import torch

from chatcore.engine.beams import Beams
from chatcore.engine.choices import StepChoices
from chatcore.engine.grammar_matchers import GrammarMatchers
from chatcore.engine.mask_budget import MaskBudget
from chatcore.engine.penalties import Penalties
from chatcore.engine.request import Request, TokenSequence
from chatcore.engine.row_faults import RowFaults
from chatcore.engine.sampler import beam_candidates, greedy, make_generator, sample
from chatcore.engine.step_types import BeamCandidates, Fork, Sampled, SampledToken, ScheduledSeq
from chatcore.engine.transfers import DownloadPack, StepTransfers

log = logging.getLogger(__name__)


class StepSampler:
    def __init__(self, beams: Beams, penalties: Penalties, grammars: GrammarMatchers,
                 mask_budget: MaskBudget, transfers: StepTransfers, device: torch.device) -> None:
        self._beams = beams
        self._penalties = penalties
        self.grammars = grammars
        self.mask_budget = mask_budget
        self.transfers = transfers
        self.device = device
        self._generators: dict[TokenSequence, torch.Generator] = {}

    def sample(self, entries: list[ScheduledSeq], logits: torch.Tensor) -> Sampled:
        """The step's sampling rows (n > 1 requests' other samples made first), sampled."""
        faults = RowFaults()
        forks: list[Fork] = []
        rows, groups = self._sampling_rows(entries, faults, forks)
        return self._sample(rows, groups, logits, faults, forks)

    def release(self, req: Request) -> None:
        """Drop a finished request's generators."""
        for seq in req.seqs:
            self._generators.pop(seq, None)

    def _sampling_rows(self, entries: list[ScheduledSeq], faults: RowFaults,
                       forks: list[Fork]) -> tuple[dict[TokenSequence, int], list[list[ScheduledSeq]]]:
        """The row of the step's logits each sampling sequence reads, and the sampling entries by
        request. A request with n > 1 whose prompt was just computed makes its other samples here
        (`_fork`, into `forks`): they join its group and read the first sample's row."""
        rows: dict[TokenSequence, int] = {}
        by_request: dict[str, list[ScheduledSeq]] = {}
        for entry in entries:
            if entry.samples:
                rows[entry.seq] = len(rows)
                by_request.setdefault(entry.req.request_id, []).append(entry)
        for group in by_request.values():
            req = group[0].req
            if req.params.n > 1 and not req.forked:
                made = faults.run(req, "forking its samples", lambda: self._fork(req, forks)) or []
                rows.update({f.seq: rows[req.seqs[0]] for f in made})
                group += made
        return rows, [group for group in by_request.values() if faults.ok(group[0].req)]

    def _sample(self, rows: dict[TokenSequence, int], groups: list[list[ScheduledSeq]], logits: torch.Tensor,
                faults: RowFaults, forks: list[Fork]) -> Sampled:
        """Choose every sampling row's token on the device (`StepChoices`), then bring all choices,
        their log-probs and beam search's candidates to the host in the step's one download. A fault
        of one request's rows fails that request alone (`RowFaults`)."""
        now = time.monotonic()
        plain = [(e.req, e.seq, rows[e.seq]) for group in groups if group[0].req.params.beam_width == 1
                 for e in group]
        beams = [(group[0].req, [rows[e.seq] for e in group]) for group in groups
                 if group[0].req.params.beam_width > 1]
        mask_ms = self._mask(plain, logits, faults)
        plain = [item for item in plain if faults.ok(item[0])]
        argmax = greedy(logits)
        pack = DownloadPack()
        pack.add("argmax", argmax)
        choices = self._choices(plain, logits, argmax, pack, faults)
        candidates = {req: faults.run(req, "beam search", lambda req=req, beam_rows=beam_rows: beam_candidates(
            torch.stack([logits[r] for r in beam_rows]), self._beams.search(req).candidates))
            for req, beam_rows in beams}
        for i, found in enumerate(candidates.values()):
            if found is not None:
                pack.add(f"beam{i}.values", found[0])
                pack.add(f"beam{i}.ids", found[1])
        host = self.transfers.download(pack.packed())
        found_beams = [_candidates(req, pack.segment(host, f"beam{i}.values"), pack.segment(host, f"beam{i}.ids"),
                                   found[0].shape[1])
                       for i, (req, found) in enumerate(candidates.items()) if found is not None]
        tokens = [SampledToken(req, seq, token, logprob) for choice in choices
                  for (req, seq, _), (token, logprob) in zip(choice.items, choice.read(host), strict=True)]
        return Sampled(now, mask_ms, forks, found_beams, tokens, faults)

    def _mask(self, plain: list[tuple[Request, TokenSequence, int]], logits: torch.Tensor, faults: RowFaults) -> float:
        """Fill and apply the grammar masks of the step's constrained rows, before anything reads the logits
        (the grammar's -inf rule them all), each tenant's fill charged to it; a row without a mask fails its
        request. Returns the fill's time in ms."""
        groups: dict[str, list[tuple[object, int]]] = {}
        for req, seq, row in plain:
            if self.grammars.constrained(seq):
                groups.setdefault(req.tenant, []).append((seq, row))
        if not groups:
            return 0.0
        fill = self.grammars.masks(groups, logits.shape[0], torch.get_num_threads())
        for tenant, pairs in groups.items():
            self.mask_budget.charge(tenant, fill.took_ms[tenant], [seq for seq, _ in pairs])
        for req, seq, _ in plain:
            if seq in fill.failed:
                code, message = fill.failed[seq]
                faults.fail(req, message, code)
        masked = sorted({row for pairs in groups.values() for seq, row in pairs if seq not in fill.failed})
        if masked:
            self.grammars.apply(logits, self.transfers.upload_bitmask(fill.bitmask), masked)
        return sum(fill.took_ms.values())

    def _choices(self, plain: list[tuple[Request, TokenSequence, int]], logits: torch.Tensor, argmax: torch.Tensor,
                 pack: DownloadPack, faults: RowFaults) -> list[StepChoices]:
        """The step's choices in one batch; when building them raises, again for each request alone, so
        that only the request that raises fails."""
        try:
            return [StepChoices(plain, logits, argmax, pack, self._penalties, sample, self._generator)]
        except Exception:
            log.warning("the step's choices failed as one batch; making them request by request")
        by_request: dict[Request, list[tuple[Request, TokenSequence, int]]] = {}
        for item in plain:
            by_request.setdefault(item[0], []).append(item)
        made = [faults.run(req, "sampling", lambda i=i, items=items: StepChoices(
            items, logits, argmax, pack, self._penalties, sample, self._generator, key=f"r{i}."))
            for i, (req, items) in enumerate(by_request.items())]
        return [choice for choice in made if choice is not None]

    def _fork(self, req: Request, forks: list[Fork]) -> list[ScheduledSeq]:
        """n > 1: as the prompt's first token is due, the other samples start from the first's tokens,
        penalty counts and grammar state (each one into `forks` as it is made; the update gives each its
        table and its place in the request). They sample from the first sample's row of logits, each
        with its own generator."""
        seq0 = req.seqs[0]
        made = []
        for child in range(1, req.params.n):
            fork = TokenSequence(child, list(seq0.tokens), seq0.prompt_len)
            forks.append(Fork(req, seq0, fork))
            self._penalties.fork(seq0, fork)
            self.grammars.fork(seq0, fork)
            made.append(ScheduledSeq(req, fork, 0, 0, [], []))
        return made

    def _generator(self, req: Request, seq: TokenSequence) -> torch.Generator | None:
        if req.params.greedy:
            return None
        key = seq
        if key not in self._generators:
            self._generators[key] = make_generator(req.params.seed, seq.index, self.device)
        return self._generators[key]


def _candidates(req: Request, flat_values: list[float], flat_ids: list[float], width: int) -> BeamCandidates:
    """A beam search's downloaded candidates, `width` per running beam."""
    return BeamCandidates(req, [flat_values[j: j + width] for j in range(0, len(flat_values), width)],
                          [[int(t) for t in flat_ids[j: j + width]] for j in range(0, len(flat_ids), width)])
