"""The model's view of a session: the prompt of its next turn, within the context.

A session keeps every message (the canonical history, for the UI and export), but the model sees
a window: the system prompt, then the exchanges (a user message and its answer) from
`window_start` on. The window only moves forward, and only when a turn would overflow the
context (policy `truncate`): it then drops whole oldest exchanges until the prompt is at most
`low_water` of the context, not just enough to fit. A window that jumps rarely keeps its prefix,
so every turn between two jumps reuses the cached history; one that slid a little every turn
would change its first tokens every turn and recompute everything.

A window that moved is re-rendered from the messages' text, so that turn computes its whole
prompt once; the turns after it extend it as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from chatcore.sessions.template import ChatTemplate

Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class Window:
    prompt: list[int]
    added: int  # the prompt's last `added` tokens are this turn's own (the user message, rendered)
    use_pin: bool  # the session's cached history is a prefix of `prompt`
    window_start: int  # complete exchanges before the model's view


def view(messages: list[Message], window_start: int) -> list[Message]:
    """The messages the model sees: the system prompt (if any), then the exchanges from `window_start`."""
    head = 1 if messages and messages[0]["role"] == "system" else 0
    return messages[:head] + messages[head + 2 * window_start:]


def exchanges(messages: list[Message]) -> int:
    return sum(1 for m in messages if m["role"] == "assistant")


def next_prompt(template: ChatTemplate, tokens: list[int], messages: list[Message], window_start: int,
                system_prompt: str | None, content: str, *, max_tokens: int, context: int,
                policy: Literal["truncate", "reject"], low_water: float) -> Window:
    """The next turn's prompt. `tokens`: the model's view so far (the session's cached history);
    `messages`: every completed message. The result may still overflow `context` (a message too
    large on its own, or policy `reject`): the caller refuses it then."""
    if not tokens:
        prompt = template.first_turn(system_prompt, content)
        return Window(prompt, len(prompt), False, 0)
    delta = template.next_turn(view(messages, window_start), content)
    current = (Window(delta.tokens, len(delta.tokens), False, window_start) if delta.rerendered
               else Window(tokens + delta.tokens, len(delta.tokens), True, window_start))
    total = exchanges(messages)
    if policy != "truncate" or len(current.prompt) + max_tokens <= context or window_start >= total:
        return current
    user = {"role": "user", "content": content}

    def render(start: int) -> list[int]:
        return template.render([*view(messages, start), user], generation_prompt=True)

    def fits(prompt: list[int]) -> bool:
        return len(prompt) + max_tokens <= context and len(prompt) <= low_water * context

    # The smallest start that fits: the prompt only shrinks as the start grows, so bisect.
    lo, hi, found = window_start + 1, total, None
    while lo <= hi:
        mid = (lo + hi) // 2
        prompt = render(mid)
        if fits(prompt):
            found, hi = (mid, prompt), mid - 1
        else:
            lo = mid + 1
    start, prompt = found if found is not None else (total, render(total))
    kept = view(messages, start)
    head = template.render(kept, generation_prompt=False) if kept else []
    added = len(prompt) - len(head) if prompt[: len(head)] == head else len(prompt)
    return Window(prompt, added, False, start)
