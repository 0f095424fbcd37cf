"""What `make gpu-check` runs, at which sizes: the plan every stage reads (issue 35, item 5).

The full plan is the workload of docs/benchmarks.md's "GPU check": 64 and 256 chats, a shared ~170-token
system prompt plus a distinct ~90-token message each (~266 prompt tokens with the chat framing), 128 new
tokens, EOS ignored, bf16, default engine settings. The rehearsal is the same stages at toy sizes on the
CPU in fp32 (tests/test_gpu_check.py runs it in `make test`). A plan travels to each stage's child process
as JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# The rehearsal's model: the default model's config (its vocabulary and tokenizer) at a toy shape.
TOY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}


@dataclass(frozen=True)
class Plan:
    device: str
    dtype: str  # the throughput stages' dtype; fidelity always runs in float32
    model: str  # the folder every stage loads (made by the model stage when weights are random)
    model_source: str  # where the config and tokenizer come from
    random_weights: bool
    shape: dict[str, int] = field(default_factory=dict)  # config overrides for the random model
    chats: tuple[int, int] = (64, 256)  # the summary's "64" and "256"
    system_tokens: int = 170
    user_tokens: int = 90
    new_tokens: int = 128
    warmup_tokens: int = 4
    fidelity_prompts: int = 8
    fidelity_tokens: int = 48
    fidelity_blocks: int = 4096
    num_blocks: int | None = None  # None: the engine's default pool sizing
    profile_warm_steps: int = 3  # decode steps after the prefill, before the timed ones
    profile_steps: int = 5
    kernel_case: dict[str, Any] = field(default_factory=lambda: {
        "num_seqs": 32, "max_context": 4096, "num_heads": 9, "num_kv_heads": 3, "head_dim": 64, "block_size": 16,
        "dtype": "float16"})
    copy_bytes: int = 1 << 30
    timing_reps: int = 5
    rehearsal: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_file(cls, path: Path) -> Plan:
        data = json.loads(path.read_text())
        data["chats"] = tuple(data["chats"])
        return cls(**data)


def full_plan(model: Path, source: Path, random_weights: bool) -> Plan:
    return Plan(device="cuda", dtype="bfloat16", model=str(model), model_source=str(source),
                random_weights=random_weights)


def rehearsal_plan(model: Path, source: Path) -> Plan:
    """Every stage at toy sizes on the CPU, fp32, a toy random model; the pool sized so it fits anywhere."""
    return Plan(device="cpu", dtype="float32", model=str(model), model_source=str(source), random_weights=True,
                shape=TOY_SHAPE, chats=(4, 8), system_tokens=40, user_tokens=24, new_tokens=8, warmup_tokens=2,
                fidelity_tokens=8, fidelity_blocks=512, num_blocks=512, profile_warm_steps=1, profile_steps=2,
                kernel_case={"num_seqs": 2, "max_context": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                             "block_size": 16, "dtype": "float32"},
                copy_bytes=1 << 20, timing_reps=2, rehearsal=True)
