"""Token selection on the device: greedy, or temperature with top-k and top-p, with
per-sequence generators; beam search's candidates. Nothing here reads device data back: the
engine downloads what these return in its step's one copy (`StepTransfers.download`).

A request's `seed` seeds one generator per sample index (on the engine's device), so the same
seed gives the same samples whatever else shares the batch.
"""

from __future__ import annotations

import secrets

import torch

from chatcore.engine.request import SamplingParams


def make_generator(seed: int | None, index: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    base = seed if seed is not None else secrets.randbits(62)
    generator.manual_seed((base * 1_000_003 + index) % (1 << 63))
    return generator


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest logit, the first where several tie (a NaN counts as largest).

    On the CPU `max(dim=-1).indices` gives argmax's indices, ties and NaNs included, in a fraction
    of its time: a 64-chat step's bfloat16 logits of SmolLM2 (64 x 49,152), 2 threads, 5.8 against
    1.3 ms (float32: 2.5 against 0.9). Elsewhere argmax, whose ties the docs settle.
    """
    return logits.max(dim=-1).indices if logits.device.type == "cpu" else logits.argmax(dim=-1)


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
        drop_sorted[0] = False  # the likeliest token stays, whatever top_p (one below float32's range is 0 here)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled


NO_TOKEN = -1  # what `sample` draws from a row that holds no distribution


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """One token id (a 0-d tensor on the device) from one row of float32 logits, or `NO_TOKEN` where
    the row's probabilities are not a distribution (a NaN or an infinity among them, or all zero).

    Such a row never reaches `multinomial` as it is: on the CPU it raises, and on a GPU it may trip
    a device-side assert, which loses the device for every request. The check stays on the device
    (no read-back); the engine fails the row's request alone when it downloads `NO_TOKEN`.
    """
    probs = torch.softmax(filter_logits(logits, params), dim=-1)
    valid = torch.isfinite(probs).all() & (probs.sum() > 0)
    drawn = torch.multinomial(torch.where(valid, probs, 1.0), 1, generator=generator)[0]
    return torch.where(valid, drawn, NO_TOKEN)


def beam_candidates(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each beam row's `count` best log-probs and their token ids, [beams, count] each."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return torch.topk(log_probs, min(count, log_probs.shape[-1]), dim=-1)
