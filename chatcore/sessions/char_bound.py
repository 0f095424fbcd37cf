"""Text refused by its length in characters, before it is tokenized.

No token of the vocabulary covers more characters than its longest piece (`longest_token`: a
byte-level piece has a character per byte, and text has no more characters than bytes), so text of
more than `tokens × longest piece` characters is more than `tokens` tokens, whatever it says. Such
text gets the refusal its token count would get (`too_large`), at the cost of a `len`, and never
takes the tokenizer thread that every tenant shares (chatcore/sessions/tokenize_queue.py).
"""

from __future__ import annotations

from chatcore.sessions.errors import TooLarge


def check_chars(chars: int, tokens: int, token_chars: int, what: str, bound: str) -> None:
    """`TooLarge` when `what`, of `chars` characters, cannot fit `tokens` tokens (`bound` names them)."""
    if chars > tokens * token_chars:
        raise TooLarge(f"{what} is {chars} characters, more than {bound} ({tokens} tokens) can hold at "
                       f"{token_chars} characters a token at most")
