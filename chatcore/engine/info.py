"""What the engine is: the facts its door hands out, fixed when it starts.

`EngineInfo` is all that code outside the engine learns of the model and the cache's shape: names,
sizes, the tokenizer and the fingerprint, never the loaded model, its modules or a tensor (the
weights and the KV stay behind the door). It is frozen and built before the engine thread starts,
so any thread may read it. What changes while the engine runs (the pool's size, pins, failures)
is state, which the engine thread publishes (`chatcore.engine.snapshot`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """`model_dtype` and `kv_dtype`: torch dtype names ("bfloat16"); `kv_bytes_per_token`: the KV
    one token takes over every layer; `max_context`: the longest prompt + max_tokens, in tokens;
    `max_num_seqs`: sequences running at once at most; `vocab_size`: the width of a row of logits."""

    model_name: str
    device: str
    model_dtype: str
    fingerprint: str
    tokenizer: Any  # the model's Hugging Face tokenizer (the callers encode and render with it)
    stop_token_ids: frozenset[int]
    block_size: int
    max_context: int
    max_num_seqs: int
    vocab_size: int
    kv_dtype: str
    kv_bytes_per_token: int
