"""Tiny random-weight causal LMs built from configs and saved with a small trained tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
          "A paged cache keeps the keys and values of every token in fixed-size blocks.",
          "Travel insurance is optional but recommended; refunds are possible before departure."] * 20
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "initializer_range": 0.2}


def tokenizer() -> Any:
    """A byte-level BPE of about 300 tokens with ChatML specials (ids 0, 1, 2; EOS is `<|im_end|>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|im_start|>", chat_template=CHAT_TEMPLATE)


def save_tiny_model(folder: Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """Build `model_type` from a tiny config with random weights (fp32) and save it with a tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tokenizer()
    config = AutoConfig.for_model(model_type, **{**SHAPE, "vocab_size": len(tok), "bos_token_id": 1,
                                                 "eos_token_id": 2, "pad_token_id": 0, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
