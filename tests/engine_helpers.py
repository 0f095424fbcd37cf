"""Helpers shared by the engine tests: chat prompts, running a core to completion, HF references."""

from __future__ import annotations

from typing import Any

import torch

from chatcore.engine.core import EngineCore
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.request import Request

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 2+2?",
    "Name three colors.",
    "Why is the sky blue?",
    "Give me a tip for learning Python.",
    "What do cats eat?",
    "Translate 'good morning' into Spanish.",
]

LONG_SYSTEM = (
    "You are Atlas, the support assistant of the Northwind travel agency. "
    "Always answer politely and briefly. Our offices are open Monday to Friday from nine to five. "
    "Refunds are possible up to fourteen days before departure, minus a handling fee of twenty euros. "
    "Bookings can be changed online or by phone; changes within three days of departure cost extra. "
    "Luggage rules depend on the airline; we recommend checking the ticket for the exact allowance. "
    "Travel insurance is optional but strongly recommended for trips outside the European Union. "
    "Our loyalty programme gives one point per euro spent, and one hundred points equal five euros. "
    "Never share personal data of other customers, and never promise prices that are not on the website. "
    "If a question is about visas, refer the customer to the embassy of the destination country. "
    "If you do not know the answer, say so and offer to connect the customer to a human agent. "
    "Keep every answer under one hundred words unless the customer explicitly asks for details. "
    "Use the customer's name if they give it, and end with a short offer of further help."
)


def chat_ids(tokenizer: Any, question: str, system: str | None = None) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def run_to_end(core: EngineCore, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step until no work is left; returns the final output of each request."""
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not core.has_work:
            return finals
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError("the engine did not finish within max_steps")


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def top1_agreement(reference: Any, prompts: list[list[int]], outputs: list[list[int]]) -> tuple[float, list[int]]:
    """The share of `outputs`' tokens that `reference` ranks first given the text before each (teacher
    forced), and the index of the prompt of each token where it does not."""
    agree, total, where = 0, 0, []
    with torch.inference_mode():
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            logits = reference(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
            same = (logits.argmax(-1) == torch.tensor(out)).tolist()
            agree += sum(same)
            total += len(out)
            where += [i] * (len(out) - sum(same))
    return agree / total, where


def hf_beam(model: Any, prompt: list[int], max_new_tokens: int, width: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         num_beams=width, early_stopping=True, length_penalty=1.0)
    generated = out[0, len(prompt):].tolist()
    return generated[: generated.index(eos) + 1] if eos in generated else generated


def add_all(core: EngineCore, requests: list[Request]) -> None:
    for req in requests:
        core.add(req)


async def on_engine_thread(engine: Any, fn: Any) -> Any:
    """White-box tests only: `fn(core)` on the engine thread, between two steps. The engine's door has
    no such call (callers send commands); tests that look inside the pool use this."""
    return await engine._run_on_thread(lambda: fn(engine._core))
