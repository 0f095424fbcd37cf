"""A step's outputs: each sampled token appended, its stop checks, its text, and a request's final report.

`OutputProcessor.process` is its one entry point in a step: for each plain sample's token (`Sampled.tokens`,
in row order) the sequence's grammar advances, the token joins the sequence, the stop checks run (stop
ids, stop strings, a grammar's end, `max_tokens`) and the detokenizer's new text goes into the step's
`RequestOutput` deltas. A sequence that finishes gives its table back at once, except a session's
turn's first sample, which the engine keeps to the end as the session's pin. A fault of one request's
token fails that request alone (`RowFaults`). `finish` builds a finished request's one final output
(its completed sequences, usage, timings) once the engine's exit path has released it.
"""

from __future__ import annotations

import time
from typing import Any

from chatcore.engine.beams import Beams
from chatcore.engine.detok import IncrementalDetokenizer
from chatcore.engine.grammar_matchers import GrammarMatchers
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.outputs import CompletedSeq, RequestOutput, SeqDelta, Timings, TokenLogprob, Usage
from chatcore.engine.request import Request, SamplingParams, TokenSequence
from chatcore.engine.row_faults import RowFaults
from chatcore.engine.step_sampler import Sampled
from chatcore.outcomes import FinishReason


class OutputProcessor:
    def __init__(self, tokenizer: Any, stop_token_ids: frozenset[int], kv_cache: KVCacheManager,
                 grammars: GrammarMatchers, beams: Beams) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.kv_cache = kv_cache
        self.grammars = grammars
        self._beams = beams
        self._detok: dict[TokenSequence, IncrementalDetokenizer] = {}

    def process(self, sampled: Sampled, outputs: dict[str, RequestOutput], faults: RowFaults) -> None:
        """The step's sampled tokens into their sequences and `outputs`."""
        for req in sampled.beams:
            outputs.setdefault(req.request_id, RequestOutput(req.request_id))
        for req, seq, token, logprob in sampled.tokens(faults):
            faults.run(req, "choosing its token", lambda req=req, seq=seq, token=token, logprob=logprob:
                       self._take(req, seq, token, sampled.now, outputs, logprob))

    def _take(self, req: Request, seq: TokenSequence, token: int, now: float, outputs: dict[str, RequestOutput],
              logprob: TokenLogprob | None) -> None:
        """A plain sample's chosen token: its grammar advances, then it joins the sequence."""
        complete = self.grammars.constrained(seq) and self.grammars.accept(seq, token)
        self._append_token(req, seq, token, now, outputs, logprob, complete)

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        if params.ignore_eos:
            return frozenset(params.stop_token_ids)
        return self.stop_token_ids | frozenset(params.stop_token_ids)

    def _append_token(self, req: Request, seq: TokenSequence, token: int, now: float,
                      outputs: dict[str, RequestOutput], logprob: TokenLogprob | None = None,
                      complete: bool = False) -> None:
        """`complete`: the sequence's grammar has accepted its whole output (it stops, EOS ignored or not)."""
        seq.tokens.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if req.first_token is None:
            req.first_token = now
        if seq.index == 0:
            req.token_times.append(now)
        detok = self._detok.get(seq)
        if detok is None:
            detok = self._detok[seq] = IncrementalDetokenizer(self.tokenizer, req.params.stop)
        text = detok.push(token)
        if token in self.stop_ids(req.params) or detok.stopped or complete:
            seq.finish_reason = FinishReason.STOP
        elif seq.num_generated >= req.params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        if seq.finished:
            text += detok.flush()
            self.kv_cache.finish_seq(req, seq)  # a session's turn keeps its first sample's to the end
        out = outputs.setdefault(req.request_id, RequestOutput(req.request_id))
        out.deltas.append(SeqDelta(seq.index, [token], text, [logprob] if logprob is not None else None))

    # ----- finishing ---------------------------------------------------------------------------
    def finish(self, req: Request, pinned: list[bytes]) -> RequestOutput:
        """A released request's final output (`pinned`: the hashes of the chain its session keeps);
        its detokenizers go."""
        out = RequestOutput(req.request_id, finished=True, error=req.error, error_code=req.error_code,
                            pinned_hashes=pinned)
        out.outputs = self._beams.finish(req, self._decode) or [self._completed(req, seq) for seq in req.seqs]
        for seq in req.seqs:
            self._detok.pop(seq, None)
        completion = sum(len(o.token_ids) for o in out.outputs)
        out.usage = Usage(len(req.prompt), req.cached_tokens, completion, req.cached_disk_tokens)
        out.timings = self._timings(req)
        return out

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _completed(self, req: Request, seq: TokenSequence) -> CompletedSeq:
        return CompletedSeq(seq.index, self._text(req, seq), seq.output_ids, seq.finish_reason or FinishReason.CANCELLED,
                            list(seq.logprobs) if req.params.logprobs else None)

    def _text(self, req: Request, seq: TokenSequence) -> str:
        """The sequence's text so far. A failed request's detokenizer may be the part that failed: its text
        is then empty (the deltas already streamed stand), so that its exit path still completes."""
        detok = self._detok.get(seq)
        try:
            return detok.text if detok is not None else ""
        except Exception:
            if req.error is None:
                raise
            return ""

    @staticmethod
    def _timings(req: Request) -> Timings:
        start, end = req.arrival, req.finished_at or time.monotonic()
        return Timings(
            queue_ms=1000 * ((req.first_scheduled or end) - start),
            ttft_ms=1000 * (req.first_token - start) if req.first_token is not None else None,
            total_ms=1000 * (end - start),
            inter_token_ms=[1000 * (b - a) for a, b in zip(req.token_times, req.token_times[1:])],
        )

    @staticmethod
    def merge(first: RequestOutput | None, final: RequestOutput) -> RequestOutput:
        if first is not None:
            final.deltas = first.deltas + final.deltas
            final.preempted = first.preempted
        return final
