"""Helpers shared by the engine tests: chat prompts, running a core to completion, HF references."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from chatcore.engine.commands import Command
from chatcore.engine.core import EngineCore
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.request import Request, SamplingParams

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


def reference_continuations(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """`model`'s greedy continuation of each prompt, `new_tokens` long (EOS suppressed until then): the
    text every path is then fed, teacher forced."""
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def reference_logits(model: Any, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """`model`'s float32 logits for each continuation's tokens, given the text before each: one
    forward of prompt + continuation, the rows that predict the continuation."""
    with torch.inference_mode():
        return [model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:].float()
                for prompt, out in zip(prompts, continuations, strict=True)]


def forced_logits(core: EngineCore, prompts: list[list[int]], continuations: list[list[int]]) -> list[torch.Tensor]:
    """The engine's logits for each continuation's tokens, teacher forced: every request decodes its
    continuation whatever its logits say, so each path is fed the same tokens at every position and
    only the logits differ. The engine's own forward (prompt chunks, then decode rows batched
    together) computes them; each step's sampling rows are recorded, then steered to the forced token."""
    requests = [core.make_request(prompt, SamplingParams(max_tokens=len(out), ignore_eos=True))
                for prompt, out in zip(prompts, continuations, strict=True)]
    forced = {req.request_id: (len(prompt), out) for req, prompt, out in zip(requests, prompts, continuations)}
    rows: dict[str, list[torch.Tensor]] = {req.request_id: [] for req in requests}
    execute = core.runner.execute

    def forcing(plan: Any) -> torch.Tensor:
        logits = execute(plan).clone()  # the forward's own is an inference tensor: steer a copy
        for row, entry in enumerate(e for e in plan.decode + plan.prefill if e.samples):
            prompt_length, out = forced[entry.req.request_id]
            rows[entry.req.request_id].append(logits[row].clone())
            logits[row] = float("-inf")
            logits[row, out[entry.start + entry.num_tokens - prompt_length]] = 0.0
        return logits

    core.runner.execute = forcing  # type: ignore[method-assign]
    try:
        add_all(core, requests)
        finals = run_to_end(core)
    finally:
        del core.runner.execute
    for req, out in zip(requests, continuations, strict=True):
        assert finals[req.request_id].outputs[0].token_ids == out  # the forcing held: same text everywhere
    return [torch.stack(rows[req.request_id]) for req in requests]


@dataclass(frozen=True)
class Fidelity:
    """How far one path's teacher-forced logits are from the reference's, over every position:
    `top1` the share of positions where both rank the same token first; `error` the largest
    |difference| of any logit, `median_error` the median over positions of each position's largest,
    `scale` the largest |reference logit| (errors read against it)."""
    top1: float
    error: float
    median_error: float
    scale: float
    positions: int

    def __str__(self) -> str:
        return (f"top-1 {self.top1:.4f} over {self.positions} positions; logits' error max {self.error:.4f}, "
                f"median {self.median_error:.4f}, at scale {self.scale:.2f}")


def fidelity(ours: list[torch.Tensor], reference: list[torch.Tensor]) -> Fidelity:
    """`ours` against `reference` (both from `forced_logits`/`reference_logits` on the same text)."""
    mine, theirs = torch.cat(ours), torch.cat(reference)
    errors = (mine - theirs).abs().max(dim=-1).values
    agree = (mine.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    return Fidelity(agree, errors.max().item(), errors.median().item(), theirs.abs().max().item(), len(theirs))


def hf_beam(model: Any, prompt: list[int], max_new_tokens: int, width: int, eos: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         num_beams=width, early_stopping=True, length_penalty=1.0)
    generated = out[0, len(prompt):].tolist()
    return generated[: generated.index(eos) + 1] if eos in generated else generated


def add_all(core: EngineCore, requests: list[Request]) -> None:
    for req in requests:
        core.add(req)


@dataclass(frozen=True, slots=True)
class OnCore(Command[Any]):
    """White-box tests only: a command the door does not know, which runs `fn(core)`."""

    fn: Callable[[EngineCore], Any]


async def on_engine_thread(engine: Any, fn: Callable[[EngineCore], Any]) -> Any:
    """White-box tests only: `fn(core)` on the engine thread, between two steps. The engine's door has
    no such command (callers send the closed set); tests that look inside the pool add `OnCore` to this
    engine's handlers and send it."""
    engine._handlers._table[OnCore] = lambda command: command.fn(engine._core)
    return await engine.send(OnCore(fn))
