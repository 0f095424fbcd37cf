"""The tokens a step chooses for its plain (not beam search) samples, and their log-probs.

On the device: rows of requests with penalties or logit_bias are shaped in one batch
(`Penalties.apply`), sampled rows are drawn, and rows that ask for log-probs get a log-softmax,
their chosen token's log-prob and their top-k, all added to the step's `DownloadPack`. On the
host, after the one download, `read` gives each sample its token and log-probs.

Greedy rows without shaping take their token from the step's argmax of the raw logits, as they
always did, and cost nothing more unless they ask for log-probs.

Nothing here changes a sequence's state until all its device work is queued (`Penalties.record`
comes last), so when building the choices raises, the engine can build them again for each
request alone, and fail only the one that raises. `key` keeps such choices' segments of the step's
one download apart.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from chatcore.engine.outputs import TokenLogprob
from chatcore.engine.penalties import Penalties
from chatcore.engine.request import Request, SamplingParams, TokenSequence
from chatcore.engine.sampler import greedy
from chatcore.engine.transfers import DownloadPack

Item = tuple[Request, TokenSequence, int]  # a sample: its request, its sequence, its row of logits
Draw = Callable[[torch.Tensor, SamplingParams, torch.Generator | None], torch.Tensor]


class StepChoices:
    def __init__(self, items: list[Item], logits: torch.Tensor, argmax: torch.Tensor, pack: DownloadPack,
                 penalties: Penalties, draw: Draw,
                 generator: Callable[[Request, TokenSequence], torch.Generator | None], key: str = "") -> None:
        """Queue the device work and add its results to `pack` under names prefixed by `key` (nothing is
        read back here)."""
        self.items = items
        self.pack = pack
        self.key = key
        shaping = [i for i, (req, _, _) in enumerate(items) if req.params.shapes_logits]
        self.shaped_at = {item: j for j, item in enumerate(shaping)}
        shaped = penalties.apply(logits, [items[i] for i in shaping]) if shaping else None

        def row(i: int) -> torch.Tensor:
            return shaped[self.shaped_at[i]] if shaped is not None and i in self.shaped_at else logits[items[i][2]]

        drawn = {i: draw(row(i), req.params, generator(req, seq))
                 for i, (req, seq, _) in enumerate(items) if not req.params.greedy}
        self.drawn_at = {item: j for j, item in enumerate(drawn)}
        shaped_argmax = greedy(shaped) if shaped is not None else None
        if shaped_argmax is not None:
            pack.add(key + "shaped", shaped_argmax)
        if drawn:
            pack.add(key + "drawn", torch.stack(list(drawn.values())))

        def token(i: int) -> torch.Tensor:
            if i in drawn:
                return drawn[i]
            if shaped_argmax is not None and i in self.shaped_at:
                return shaped_argmax[self.shaped_at[i]]
            return argmax[items[i][2]]

        self.wanted = [i for i, (req, _, _) in enumerate(items) if req.params.logprobs]
        self.top = max((items[i][0].params.top_logprobs for i in self.wanted), default=0)
        if self.wanted:
            log_probs = torch.log_softmax(torch.stack([row(i) for i in self.wanted]), dim=-1)
            chosen = torch.stack([token(i) for i in self.wanted]).clamp(min=0)  # NO_TOKEN's row fails anyway
            pack.add(key + "logprob", log_probs.gather(1, chosen.view(-1, 1)))
            if self.top:
                values, ids = torch.topk(log_probs, self.top, dim=-1)
                pack.add(key + "top_values", values)
                pack.add(key + "top_ids", ids)
        for i in shaping:  # last: the state changes once nothing above can raise
            penalties.record(items[i][1], token(i))

    def read(self, host: list[float]) -> list[tuple[int, TokenLogprob | None]]:
        """Each item's chosen token id (`NO_TOKEN` where its row held no distribution) and, if its
        request asks, its log-probs; in item order."""
        key = self.key

        def segment(host: list[float], name: str) -> list[float]:
            return self.pack.segment(host, name if name == "argmax" else key + name)

        argmax = segment(host, "argmax")
        shaped = segment(host, "shaped") if self.shaped_at else []
        drawn = segment(host, "drawn") if self.drawn_at else []
        tokens = []
        for i, (_, _, row) in enumerate(self.items):
            if i in self.drawn_at:
                tokens.append(int(drawn[self.drawn_at[i]]))
            elif i in self.shaped_at:
                tokens.append(int(shaped[self.shaped_at[i]]))
            else:
                tokens.append(int(argmax[row]))
        logprobs: list[TokenLogprob | None] = [None] * len(self.items)
        if self.wanted:
            chosen = segment(host, "logprob")
            values = segment(host, "top_values") if self.top else []
            ids = segment(host, "top_ids") if self.top else []
            for j, i in enumerate(self.wanted):
                at = j * self.top
                top = tuple((int(ids[at + m]), values[at + m]) for m in range(self.items[i][0].params.top_logprobs))
                logprobs[i] = TokenLogprob(tokens[i], chosen[j], top)
        return list(zip(tokens, logprobs, strict=True))
