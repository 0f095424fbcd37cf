"""The engine's `TokenLogprob`s in OpenAI's two wire shapes: chat completions' `logprobs.content`
and the legacy completions' `{tokens, token_logprobs, top_logprobs, text_offset}`.

A token's `bytes` are its own bytes, which may be part of one UTF-8 character (byte-level BPE
splits characters); its `token` text is those bytes decoded, with U+FFFD for an incomplete one.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from tokenizers import decoders

from chatcore.engine.outputs import TokenLogprob

# JSON has no -Infinity: OpenAI reports a token with no probability as this.
FLOOR = -9999.0


@cache
def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the other bytes for the code points from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_in = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in stand_in):
        stand_in[b] = chr(256 + extra)
    return {char: b for b, char in stand_in.items()}


class TokenTexts:
    """Token ids to (text, bytes), for one tokenizer; remembered, since a vocabulary is finite."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)
        self._seen: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        found = self._seen.get(token_id)
        if found is None:
            found = self._seen[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> tuple[str, bytes]:
        if self.byte_level and token_id not in self.tokenizer.all_special_ids:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            alphabet = _byte_alphabet()
            if isinstance(piece, str) and all(c in alphabet for c in piece):
                raw = bytes(alphabet[c] for c in piece)
                return raw.decode("utf-8", errors="replace"), raw
        text = self.tokenizer.decode([token_id])
        return text, text.encode("utf-8")


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text, raw = texts(token_id)
    return {"token": text, "logprob": max(logprob, FLOOR), "bytes": list(raw)}


def chat_content(texts: TokenTexts, logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat completions' `choices[i].logprobs.content` for these tokens."""
    return [{**_entry(texts, e.token_id, e.logprob), "top_logprobs": [_entry(texts, t, lp) for t, lp in e.top]}
            for e in logprobs]


def legacy(texts: TokenTexts, logprobs: list[TokenLogprob], offsets: list[int]) -> dict[str, Any]:
    """The legacy completions' `choices[i].logprobs`; `offsets` are each token's start in the choice's text."""
    return {
        "tokens": [texts(e.token_id)[0] for e in logprobs],
        "token_logprobs": [max(e.logprob, FLOOR) for e in logprobs],
        "top_logprobs": [{texts(t)[0]: max(lp, FLOOR) for t, lp in e.top} for e in logprobs],
        "text_offset": offsets,
    }
