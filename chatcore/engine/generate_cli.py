"""`chatcore generate`: one chat prompt through the engine, in-process."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from chatcore.config import Settings
from chatcore.engine.core import EngineCore
from chatcore.engine.errors import RequestRejected
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.request import SamplingParams
from chatcore.models.loader import load_model


def run_generate(args: argparse.Namespace, settings: Settings) -> int:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, n=args.n, beam_width=args.beam_width)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    core = EngineCore(load_model(settings), settings)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": args.prompt})
    ids = core.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    request = core.make_request(list(ids), params)
    try:
        core.add(request)
    except RequestRejected as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    final: RequestOutput | None = None
    while final is None:
        for out in core.step():
            if not args.as_json and params.beam_width == 1 and params.n == 1:
                for delta in out.deltas:
                    print(delta.text, end="", flush=True)
            if out.finished:
                final = out
    core.audit()
    if args.as_json:
        assert final.usage is not None
        print(json.dumps({
            "outputs": [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
                        for o in final.outputs],
            "usage": {"prompt_tokens": final.usage.prompt_tokens, "cached_tokens": final.usage.cached_tokens,
                      "completion_tokens": final.usage.completion_tokens},
        }))
    elif params.beam_width > 1 or params.n > 1:
        for o in final.outputs:
            print(f"[{o.index}] {o.text}")
    else:
        print()
    return 0 if final.error is None else 1
