"""Logit shaping on the device: presence, frequency and repetition penalties, and logit_bias.

Semantics, for a row of logits `l` of a sequence whose generated tokens so far counted `c[t]` times:
- OpenAI's presence and frequency penalties: `l[t] -= frequency * c[t] + presence * (c[t] > 0)`;
- vLLM's (and transformers') repetition penalty `r` over prompt + generated tokens: a seen token's
  logit is divided by `r` when positive, multiplied by `r` otherwise;
- logit_bias: `l[t] += bias[t]`, after the penalties.

Invariant: nothing here crosses between host and device inside a step. What comes from the host
(the prompt's token set, the bias vector, each request's coefficients) is built once, when the
request is admitted (`admit`, between steps); each step stacks the rows that need shaping into one
[P, vocab] batch and counts the chosen tokens with device ops (`record`). Rows of requests without
penalties or bias are never touched, so they pay nothing and stay exactly as the model gave them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatcore.engine.request import Request, TokenSequence


@dataclass(slots=True)
class _Shaping:
    """A request's device tensors: [presence, frequency, repetition], the bias row, the prompt's token set."""

    coefficients: torch.Tensor
    bias: torch.Tensor
    prompt_seen: torch.Tensor


class Penalties:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._requests: dict[str, _Shaping] = {}
        self._counts: dict[TokenSequence, torch.Tensor] = {}  # float32 [vocab] counts of generated tokens
        self._zeros = torch.zeros(vocab_size, device=device)
        self._unseen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self._one = torch.ones(1, device=device)

    def admit(self, req: Request) -> None:
        """Build a request's shaping tensors (before its first step); a no-op for a request without any.
        Raises `ValueError` for a logit_bias token id outside the vocabulary."""
        params = req.params
        if not params.shapes_logits:
            return
        bad = [token for token, _ in params.logit_bias if token >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        coefficients = torch.tensor([params.presence_penalty, params.frequency_penalty, params.repetition_penalty],
                                    dtype=torch.float32, device=self.device)
        bias = self._zeros
        if params.logit_bias:
            ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long, device=self.device)
            bias = self._zeros.index_put((ids,), torch.tensor([b for _, b in params.logit_bias],
                                                              dtype=torch.float32, device=self.device))
        prompt_seen = self._unseen
        if params.repetition_penalty != 1:
            ids = torch.tensor(sorted(set(req.prompt)), dtype=torch.long, device=self.device)
            prompt_seen = self._unseen.index_put((ids,), torch.ones_like(ids, dtype=torch.bool))
        self._requests[req.request_id] = _Shaping(coefficients, bias, prompt_seen)
        for seq in req.seqs:
            self._counts[seq] = torch.zeros(self.vocab_size, device=self.device)

    def fork(self, parent: TokenSequence, child: TokenSequence) -> None:
        """A forked sample starts from its parent's counts (a device copy)."""
        counts = self._counts.get(parent)
        if counts is not None:
            self._counts[child] = counts.clone()

    def apply(self, logits: torch.Tensor, items: list[tuple[Request, TokenSequence, int]]) -> torch.Tensor:
        """The shaped rows, [len(items), vocab], for (request, sequence, row of `logits`) items that shape."""
        rows = torch.stack([logits[row] for _, _, row in items])
        shaping = [self._requests[req.request_id] for req, _, _ in items]
        coefficients = torch.stack([s.coefficients for s in shaping])
        presence, frequency, repetition = (coefficients[:, i: i + 1] for i in range(3))
        counts = torch.stack([self._counts[seq] for _, seq, _ in items])
        generated = counts > 0
        if any(req.params.repetition_penalty != 1 for req, _, _ in items):
            seen = generated | torch.stack([s.prompt_seen for s in shaping])
            rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
        rows = rows - frequency * counts - presence * generated
        return rows + torch.stack([s.bias for s in shaping])

    def record(self, seq: TokenSequence, token: torch.Tensor) -> None:
        """Count a chosen token (a 0-d device tensor) for a sequence that shapes; a device op. A row
        that held no distribution drew `sampler.NO_TOKEN` (its request fails once the step downloads
        it): it counts at id 0, never at an index outside the row."""
        counts = self._counts.get(seq)
        if counts is not None:
            counts.index_add_(0, token.view(1).clamp(min=0), self._one)

    def release(self, req: Request) -> None:
        self._requests.pop(req.request_id, None)
        for seq in req.seqs:
            self._counts.pop(seq, None)
