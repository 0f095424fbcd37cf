"""The engine's running beam searches: each request's `BeamSearch`, and its beams' tables.

A step's chosen (parent, token) pairs become the next beams: the first child of a parent is the
parent itself, grown by one token; each other child forks the parent's table (shared history is
stored once, the diverging last block is copied on write); a parent no child continues ends, and
its table goes back to the KV cache manager.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from chatcore.engine.beam import BeamSearch
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.outputs import CompletedSeq
from chatcore.engine.request import Request, TokenSequence
from chatcore.outcomes import FinishReason


class Beams:
    def __init__(self, kv_cache: KVCacheManager, stop_ids: Callable[[Request], frozenset[int]]) -> None:
        self.kv_cache = kv_cache
        self._stop_ids = stop_ids
        self._searches: dict[str, BeamSearch] = {}

    def search(self, req: Request) -> BeamSearch:
        search = self._searches.get(req.request_id)
        if search is None:
            search = self._searches[req.request_id] = BeamSearch(
                req.params.beam_width, req.params.length_penalty, req.params.max_tokens, self._stop_ids(req))
        return search

    def step(self, req: Request, values: list[list[float]], ids: list[list[int]]) -> None:
        """Advance the request's beams by one token each, from each beam's best candidates."""
        search = self.search(req)
        beams = req.live_seqs
        choices = search.step(values, ids, [s.cum_logprob for s in beams], [s.output_ids for s in beams])
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
        self._renumber(req, next_beams)
        self.kv_cache.rename(req)
        if search.done:
            for beam in next_beams:
                beam.finish_reason = FinishReason.STOP

    @staticmethod
    def _renumber(req: Request, beams: list[TokenSequence]) -> None:
        for i, beam in enumerate(beams):
            beam.index = i
        req.seqs = beams

    def finish(self, req: Request, decode: Callable[[list[int]], str]) -> list[CompletedSeq] | None:
        """The finished search's hypotheses, best first; None when the request ran no search (or none finished)."""
        search = self._searches.pop(req.request_id, None)
        if search is None or not search.results():
            return None
        out = []
        for i, hyp in enumerate(search.results()):
            ended = bool(hyp.token_ids) and hyp.token_ids[-1] in search.stop_ids
            out.append(CompletedSeq(i, decode(hyp.token_ids), hyp.token_ids,
                                    FinishReason.STOP if ended else FinishReason.LENGTH))
        return out
