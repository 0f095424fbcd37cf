"""The one place a step's outcome changes state (like vLLM's `update_from_output`, nano-vllm's `postprocess`).

`StepUpdate.update_from_output(plan, sampled)` runs once a step, after the sampler and before the output
processor, and in this order:
1. each scheduled sequence's computed tokens advance, and its full blocks are hashed (`cache_blocks`);
2. n > 1 requests whose prompt was just computed take their other samples (`Fork`s the sampler drew
   from the first sample's row): each forks the first sample's table and joins the request;
3. beam searches step: the first child of a parent is the parent itself, grown by one token; each
   other child forks the parent's table (shared history stored once, the diverging last block copied
   on write); a parent no child continues ends and its table goes back;
4. each plain sample's token: its grammar advances, the token (and its log-probs) join the sequence,
   its text is detokenized (stop strings are matched on text), and the stop checks run (stop ids, stop
   strings, a grammar's end, `max_tokens`); a sample that stops gives its table back at once, except a
   session's turn's first sample, which the manager keeps to the end as the session's pin;
5. the faults the step recorded (`RowFaults`) fail their requests.
It returns what the output processor reports (`Updated`): the tokens appended with their text, and the
requests left with no live sequence, which the engine ends through its one exit path (`_finish`).
Outside this module nothing appends to a sequence's tokens, and a sequence's table changes only as
the scheduler reserves slots or preempts and as the exit path releases (tests/test_step_update.py).
"""

from __future__ import annotations

import time

from chatcore.engine.beams import Beams
from chatcore.engine.detok import Detokenizers
from chatcore.engine.grammar_matchers import GrammarMatchers
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.request import SamplingParams, TokenSequence
from chatcore.engine.row_faults import RowFaults
from chatcore.engine.sampler import NO_TOKEN
from chatcore.engine.step_types import Appended, BeamCandidates, Fork, Sampled, SampledToken, StepPlan, Updated
from chatcore.outcomes import FinishReason


class StepUpdate:
    def __init__(self, kv_cache: KVCacheManager, grammars: GrammarMatchers, texts: Detokenizers,
                 stop_token_ids: frozenset[int]) -> None:
        self.kv_cache = kv_cache
        self.grammars = grammars
        self.texts = texts
        self.stop_token_ids = stop_token_ids
        self.beams = Beams(lambda req: self.stop_ids(req.params))

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        if params.ignore_eos:
            return frozenset(params.stop_token_ids)
        return self.stop_token_ids | frozenset(params.stop_token_ids)

    def update_from_output(self, plan: StepPlan, sampled: Sampled) -> Updated:
        """Apply a step's outcome (see the module's docstring for what, in which order)."""
        entries = plan.entries
        for entry in entries:
            entry.seq.num_computed = entry.start + entry.num_tokens
            self.kv_cache.cache_blocks(entry.req, entry.seq)
        faults = sampled.faults
        for fork in sampled.forks:
            self._fork(fork, faults)
        for found in sampled.beams:
            faults.run(found.req, "beam search", lambda found=found: self._step_beams(found))
        appended: list[Appended] = []
        for sample in sampled.tokens:
            done = self._take(sample, sampled.now, faults)
            if done is not None:
                appended.append(done)
        faults.apply()
        ended = [req for req in dict.fromkeys(e.req for e in entries) if not req.finished and not req.live_seqs]
        return Updated(appended, [found.req for found in sampled.beams], ended)

    def _fork(self, fork: Fork, faults: RowFaults) -> None:
        """The sample joins its request (whatever befell the request: its exit path releases the sample),
        with a table sharing its parent's blocks (the last copied on write)."""
        fork.req.forked = True
        fork.child.num_computed = fork.parent.num_computed
        fork.req.seqs.append(fork.child)
        faults.run(fork.req, "forking its samples", lambda: self.kv_cache.fork(fork.req, fork.parent, fork.child))

    def _step_beams(self, found: BeamCandidates) -> None:
        """Advance the request's beams by one token each, from each beam's best candidates."""
        req = found.req
        beams = req.live_seqs
        choices = self.beams.choose(req, found.values, found.ids)
        if req.first_token is None:
            req.first_token = time.monotonic()
        snapshots = [list(s.tokens) for s in beams]
        reused: set[int] = set()
        next_beams: list[TokenSequence] = []
        for i, choice in enumerate(choices):
            parent = beams[choice.parent]
            if choice.parent not in reused:
                reused.add(choice.parent)
                parent.tokens.append(choice.token)
                child = parent
            else:
                child = TokenSequence(i, snapshots[choice.parent] + [choice.token], parent.prompt_len,
                                      num_computed=parent.num_computed)
                self.kv_cache.fork(req, parent, child)
            child.cum_logprob = choice.score
            next_beams.append(child)
        for pos, beam in enumerate(beams):
            if pos not in reused:
                beam.finish_reason = FinishReason.STOP
                self.kv_cache.free_seq(req, beam)
        for index, beam in enumerate(next_beams):
            beam.index = index
        req.seqs = next_beams
        self.kv_cache.rename(req)
        if self.beams.done(req):
            for beam in next_beams:
                beam.finish_reason = FinishReason.STOP

    def _take(self, sample: SampledToken, now: float, faults: RowFaults) -> Appended | None:
        """A plain sample's token into its sequence, or None when its request failed (a row without a
        distribution fails it here, in row order)."""
        if sample.token == NO_TOKEN and faults.ok(sample.req):
            faults.fail(sample.req, "sampling failed: the row's probabilities are not a distribution (a NaN or an "
                                    "infinity after penalties, logit_bias and temperature)")
        return faults.run(sample.req, "choosing its token", lambda: self._append_token(sample, now))

    def _append_token(self, sample: SampledToken, now: float) -> Appended:
        """The token's grammar advances, then it joins the sequence; the stop checks decide whether the
        sequence ends (`complete`: its grammar has accepted its whole output, EOS ignored or not)."""
        req, seq, token = sample.req, sample.seq, sample.token
        complete = self.grammars.constrained(seq) and self.grammars.accept(seq, token)
        seq.tokens.append(token)
        if sample.logprob is not None:
            seq.logprobs.append(sample.logprob)
        if req.first_token is None:
            req.first_token = now
        if seq.index == 0:
            req.token_times.append(now)
        text, stopped = self.texts.push(seq, req.params.stop, token)
        if token in self.stop_ids(req.params) or stopped or complete:
            seq.finish_reason = FinishReason.STOP
        elif seq.num_generated >= req.params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        if seq.finished:
            text += self.texts.flush(seq)
            self.kv_cache.finish_seq(req, seq)  # a session's turn keeps its first sample's to the end
        return Appended(req, seq, token, text, sample.logprob)
