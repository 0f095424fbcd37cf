"""The engine's running beam searches: each request's `BeamSearch`, its step's choices, its hypotheses.

Nothing here changes a beam: the step's update (`engine/step_update.py`) turns the chosen (parent, token)
pairs into the next beams, their tokens and their tables.
"""

from __future__ import annotations

from collections.abc import Callable

from chatcore.engine.beam import BeamChoice, BeamSearch
from chatcore.engine.outputs import CompletedSeq
from chatcore.engine.request import Request
from chatcore.outcomes import FinishReason


class Beams:
    def __init__(self, stop_ids: Callable[[Request], frozenset[int]]) -> None:
        self._stop_ids = stop_ids
        self._searches: dict[str, BeamSearch] = {}

    def search(self, req: Request) -> BeamSearch:
        search = self._searches.get(req.request_id)
        if search is None:
            search = self._searches[req.request_id] = BeamSearch(
                req.params.beam_width, req.params.length_penalty, req.params.max_tokens, self._stop_ids(req))
        return search

    def choose(self, req: Request, values: list[list[float]], ids: list[list[int]]) -> list[BeamChoice]:
        """One step of the request's search over its running beams, from each beam's best candidates
        (`values`, `ids`): the next beams' (parent, token, score) choices; [] once the search is done."""
        beams = req.live_seqs
        return self.search(req).step(values, ids, [s.cum_logprob for s in beams], [s.output_ids for s in beams])

    def done(self, req: Request) -> bool:
        return self.search(req).done

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
