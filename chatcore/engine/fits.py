"""What may ever fit: the rule that refuses a request the context or the pool could never serve.

One rule, asked on two threads: the engine thread's scheduler checks each request it adds against
the pool as it is (`KVCacheManager.limits`); callers check before they send one
(`InferenceEngine.check_fits`) against the pool's limits as the engine last published them (a
resize publishes the new ones before its result comes back). Pure arithmetic: nothing here reads
the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatcore.engine.errors import RequestRejected
from chatcore.engine.request import Request


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """The pool's size as admission sees it. `admit_blocks`: the most blocks a prompt may take (the
    pool less its low watermark)."""

    block_size: int
    num_blocks: int
    admit_blocks: int


def worst_case_blocks(req: Request, block_size: int) -> int:
    """The most blocks a request may hold at once: its prompt, and each sequence's output plus a copied block."""
    prompt_blocks = -(-len(req.prompt) // block_size)
    per_seq = -(-req.params.max_tokens // block_size) + 1
    return prompt_blocks + req.params.num_sequences * per_seq


def check_pool_fits(req: Request, limits: PoolLimits) -> None:
    """`RequestRejected` for a request a pool of `limits` could never serve."""
    prompt_blocks = -(-len(req.prompt) // limits.block_size)
    if prompt_blocks > limits.admit_blocks:
        raise RequestRejected(f"the prompt needs {prompt_blocks} KV blocks; the pool admits at most "
                              f"{limits.admit_blocks}")
    worst = worst_case_blocks(req, limits.block_size)
    if worst > limits.num_blocks:
        raise RequestRejected(f"prompt + max_tokens may need {worst} KV blocks; the pool has {limits.num_blocks}")


def check_fits(req: Request, max_context: int, limits: PoolLimits) -> None:
    """`RequestRejected` for an empty prompt, or one that can never fit `max_context` or the pool."""
    if not req.prompt:
        raise RequestRejected("the prompt is empty")
    total = len(req.prompt) + req.params.max_tokens
    if total > max_context:
        raise RequestRejected(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.params.max_tokens}) "
                              f"exceeds the model's context of {max_context} tokens")
    check_pool_fits(req, limits)
