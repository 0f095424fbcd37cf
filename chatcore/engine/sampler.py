"""Token selection: greedy, or temperature with top-k and top-p, with per-sequence generators.

A request's `seed` seeds one generator per sample index, so the same seed gives the same
samples whatever else shares the batch.
"""

from __future__ import annotations

import secrets

import torch

from chatcore.engine.request import SamplingParams


def make_generator(seed: int | None, index: int) -> torch.Generator:
    generator = torch.Generator()
    base = seed if seed is not None else secrets.randbits(62)
    generator.manual_seed((base * 1_000_003 + index) % (1 << 63))
    return generator


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), on one row of float32 logits."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Keep the smallest set whose mass reaches top_p: drop a token once the mass before it does.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits` [N, vocab] (float32)."""
    greedy = logits.argmax(dim=-1).tolist()
    out: list[int] = []
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            out.append(int(greedy[row]))
            continue
        probs = torch.softmax(filter_logits(logits[row], p), dim=-1)
        out.append(int(torch.multinomial(probs, 1, generator=generator).item()))
    return out
