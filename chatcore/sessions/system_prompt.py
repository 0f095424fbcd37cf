"""A new session's system prompt must leave room for a turn.

The context policy never drops the system prompt, so a session whose system prompt fills the context
could run no turn at all: each one would fail `too_large`. The smallest turn is a one-character user
message and one token of answer; the system prompt passes when that turn fits, by the same check every
turn's request meets (`InferenceEngine.check_fits`: the context, `max_context`, and the KV pool). Checked
before anything is stored, so a refused system prompt creates no session.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from chatcore.engine.errors import RequestRejected
from chatcore.engine.request import SamplingParams
from chatcore.sessions.errors import TooLarge
from chatcore.sessions.template import ChatTemplate

if TYPE_CHECKING:
    from chatcore.engine.engine import InferenceEngine

SMALLEST_MESSAGE = "x"  # a one-character user message: the smallest turn a client can send
Tokenize = Callable[[Callable[[], list[int]]], Awaitable[list[int]]]  # runs tokenizer work off the event loop


async def check_room_for_a_turn(system_prompt: str, template: ChatTemplate, engine: InferenceEngine,
                                tokenize: Tokenize) -> None:
    """`TooLarge`, naming the context and the system prompt's tokens, when the smallest turn after
    `system_prompt` cannot fit."""
    prompt = await tokenize(lambda: template.first_turn(system_prompt, SMALLEST_MESSAGE))
    try:
        engine.check_fits(engine.make_request(prompt, SamplingParams(max_tokens=1)))
    except RequestRejected as exc:
        own = await tokenize(lambda: template.render([{"role": "system", "content": system_prompt}],
                                                     generation_prompt=False))
        context = engine.info.max_context
        why = (f"the model's context is {context} tokens (max_context)" if len(prompt) + 1 > context
               else f"the KV pool cannot hold it ({exc})")
        raise TooLarge(f"the system prompt takes {len(own)} tokens, and the smallest turn after it "
                       f"({len(prompt)} tokens of prompt with a one-character message, and one token of answer) "
                       f"does not fit: {why}") from exc
