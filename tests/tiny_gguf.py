"""A tiny random-weight Llama written as a GGUF file with the `gguf` package's GGUFWriter, as llama.cpp's
converter writes one: q and k rows permuted for its RoPE, the LM head tied to the embedding (no
`output.weight`), the tokenizer (tests/tiny_models.py's byte-level BPE) in the file's metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.tiny_models import CHAT_TEMPLATE, SHAPE, tokenizer

HIDDEN, FFN = SHAPE["hidden_size"], SHAPE["intermediate_size"]
HEADS, KV_HEADS, HEAD_DIM = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"]
LINEARS = {"attn_q": (HEADS * HEAD_DIM, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
           "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HEADS * HEAD_DIM),
           "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
# The default model's mix: Q8_0 embedding and head, Q4_1 layers; one projection in each other type.
QTYPES = {"token_embd": "Q8_0", "attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1",
          "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_1"}


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `permute` (convert_hf_to_gguf.py): each head's two halves interleaved by rows."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weights.shape)


def _add_tokenizer(writer: object) -> int:
    tok = tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([3 if token in tok.all_special_tokens else 1 for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    return len(vocab)


def write_tiny_gguf(path: Path, qtypes: dict[str, str] | None = None, architecture: str = "llama",
                    seed: int = 0, header: dict[str, int] | None = None, weights: bool = True) -> Path:
    """Write the tiny model to `path`; `qtypes` overrides `QTYPES` per tensor kind (an F32 norm stays F32).
    `header` overrides what the header declares (`block_count`, `embedding_length`, `feed_forward_length`)
    without changing the tensors; `weights=False` leaves out the embedding and every linear (norms stay)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    kinds = {**QTYPES, **(qtypes or {})}
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(path, architecture)
    layers = SHAPE["num_hidden_layers"]
    declared = {"block_count": layers, "embedding_length": HIDDEN, "feed_forward_length": FFN, **(header or {})}
    writer.add_block_count(declared["block_count"])
    writer.add_context_length(SHAPE["max_position_embeddings"])
    writer.add_embedding_length(declared["embedding_length"])
    writer.add_feed_forward_length(declared["feed_forward_length"])
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    vocab = _add_tokenizer(writer)

    def add(name: str, kind: str, shape: tuple[int, int]) -> None:
        values = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if kind in ("attn_q", "attn_k"):
            values = _permute(values, HEADS if kind == "attn_q" else KV_HEADS)
        qtype = GGMLQuantizationType[kinds[kind]]
        if weights:
            writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", "token_embd", (vocab, HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for layer in range(layers):
        for kind, shape in LINEARS.items():
            add(f"blk.{layer}.{kind}.weight", kind, shape)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
