"""The model's chat template, turned into token deltas that extend a canonical history.

A session's canonical history is the exact token sequence the model saw: the rendered
turns, the assistant's generated ids as generated, and the template's end-of-turn tokens.
A new user turn appends only its own tokens (plus the generation prompt), computed as the
difference between two renderings. That is sound only if the template is prefix-stable:
rendering a conversation and then one more turn must extend the first rendering. This is
checked once per model; where it fails, each turn re-renders the whole conversation and the
prefix hash match reuses whatever still matches.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)
# The tool-call blocks of Hermes-style templates (Qwen 2.5, Qwen 3, ...), the one format chatcore reads.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PROBE_TOOL = "chatcore_probe_tool"
PROBE = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "U2"},
]


def _ids(rendered: Any) -> list[int]:
    return list(rendered["input_ids"] if isinstance(rendered, dict) else rendered)


@dataclass
class TurnDelta:
    tokens: list[int]
    rerendered: bool  # True: `tokens` is the whole conversation, not an extension


class ChatTemplate:
    def __init__(self, tokenizer: Any, stop_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = stop_token_ids
        self.prefix_stable = self._check_prefix_stable()
        self.end_of_turn = self._end_of_turn()
        if not self.prefix_stable:
            log.warning("the chat template is not prefix-stable: each turn re-renders the conversation "
                        "and relies on the prefix hash match")

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the template shows tools to the model and asks for `<tool_call>` blocks."""
        source = self.tokenizer.chat_template if isinstance(self.tokenizer.chat_template, str) else ""
        if TOOL_CALL_OPEN not in source:
            return False
        probe = [{"type": "function", "function": {"name": PROBE_TOOL, "parameters": {"type": "object"}}}]
        try:
            rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe,
                                                          tokenize=False, add_generation_prompt=True)
        except Exception:  # a template that fails with tools does not take them
            return False
        return PROBE_TOOL in rendered

    def render(self, messages: Sequence[dict[str, str]], generation_prompt: bool) -> list[int]:
        return _ids(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt,
                                                       tokenize=True, return_dict=False))

    def _check_prefix_stable(self) -> bool:
        try:
            for cut in (2, 3):
                head = self.render(PROBE[:cut], generation_prompt=PROBE[cut - 1]["role"] == "user")
                if self.render(PROBE[: cut + 1], generation_prompt=cut + 1 == len(PROBE))[: len(head)] != head:
                    return False
        except Exception:  # a template that rejects the probe is treated as unstable
            log.exception("chat template probe failed")
            return False
        return True

    def _end_of_turn(self) -> list[int]:
        """The tokens the template puts after an assistant message's content (e.g. <|im_end|> \\n)."""
        marker = "Zq"
        head = self.render(PROBE[:2], generation_prompt=True)
        full = self.render([*PROBE[:2], {"role": "assistant", "content": marker}], generation_prompt=False)
        body = self.tokenizer.encode(marker, add_special_tokens=False)
        if full[: len(head)] != head or full[len(head): len(head) + len(body)] != body:
            return []
        return full[len(head) + len(body):]

    def first_turn(self, system_prompt: str | None, user: str) -> list[int]:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        return self.render([*messages, {"role": "user", "content": user}], generation_prompt=True)

    def next_turn(self, history: Sequence[dict[str, str]], user: str) -> TurnDelta:
        """Tokens that extend a history ending with an assistant turn by one user turn."""
        full = self.render([*history, {"role": "user", "content": user}], generation_prompt=True)
        if self.prefix_stable:
            head = self.render(history, generation_prompt=False)
            if full[: len(head)] == head:
                return TurnDelta(full[len(head):], rerendered=False)
        return TurnDelta(full, rerendered=True)

    def close_answer(self, generated: Sequence[int]) -> list[int]:
        """The end-of-turn tokens still missing after an answer's generated ids."""
        eot = self.end_of_turn
        if not eot:
            return []
        if generated and generated[-1] == eot[0]:
            return eot[1:]
        return eot
