"""A step's outputs, and a finished request's report: it builds outputs and changes no request,
table or token list.

`OutputProcessor.process` is its one entry point in a step: each token the step's update appended
(`Updated.appended`, in row order) becomes a delta of its request's `RequestOutput`, with the text the
update's detokenizing released. `finish` builds a finished request's one final output (its completed
sequences and their texts, usage, timings) once the engine's exit path has released it.
"""

from __future__ import annotations

import time
from typing import Any

from chatcore.engine.beams import Beams
from chatcore.engine.detok import Detokenizers
from chatcore.engine.outputs import CompletedSeq, RequestOutput, SeqDelta, Timings, Usage
from chatcore.engine.request import Request, TokenSequence
from chatcore.engine.step_types import Updated
from chatcore.outcomes import FinishReason


class OutputProcessor:
    def __init__(self, tokenizer: Any, texts: Detokenizers, beams: Beams) -> None:
        self.tokenizer = tokenizer
        self.texts = texts
        self._beams = beams

    @staticmethod
    def process(updated: Updated, outputs: dict[str, RequestOutput]) -> None:
        """The step's appended tokens as their requests' deltas in `outputs`."""
        for req in updated.beams:
            outputs.setdefault(req.request_id, RequestOutput(req.request_id))
        for done in updated.appended:
            out = outputs.setdefault(done.req.request_id, RequestOutput(done.req.request_id))
            out.deltas.append(SeqDelta(done.seq.index, [done.token], done.text,
                                       [done.logprob] if done.logprob is not None else None))

    # ----- finishing ---------------------------------------------------------------------------
    def finish(self, req: Request, pinned: list[bytes]) -> RequestOutput:
        """A released request's final output (`pinned`: the hashes of the chain its session keeps);
        its detokenizers go."""
        out = RequestOutput(req.request_id, finished=True, error=req.error, error_code=req.error_code,
                            pinned_hashes=pinned)
        out.outputs = self._beams.finish(req, self._decode) or [self._completed(req, seq) for seq in req.seqs]
        for seq in req.seqs:
            self.texts.release(seq)
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
        try:
            return self.texts.text(seq)
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
