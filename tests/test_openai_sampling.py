"""logprobs, top_logprobs, penalties and logit_bias on `POST /v1/chat/completions` with the official
`openai` client (and penalties as WebSocket params), against the real app and model in fp32."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch

from tests.engine_helpers import chat_ids
from tests.server_helpers import hello, recv_until, turn

pytestmark = pytest.mark.model
QUESTION = "Why is the sky blue?"
REPEAT = "Write the word 'apple' twenty times, separated by spaces."


async def ask(client: openai.AsyncOpenAI, content: str, **params):
    return await client.chat.completions.create(model="chatcore", messages=[{"role": "user", "content": content}],
                                                temperature=0, **params)


def first_token_logits(hf_model, loaded_fp32, content: str) -> torch.Tensor:
    prompt = chat_ids(loaded_fp32.tokenizer, content)
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0, -1].float()


async def test_logprobs_and_top_logprobs_match_transformers(client, hf_model, loaded_fp32) -> None:
    answer = await ask(client, QUESTION, max_tokens=5, logprobs=True, top_logprobs=5)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 5
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs) == entry.top_logprobs[0].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy chose the most likely token
        assert all(math.exp(t.logprob) <= 1.0 for t in entry.top_logprobs)
        assert sum(math.exp(t.logprob) for t in entry.top_logprobs) <= 1.0 + 1e-5
    assert bytes(b for entry in content for b in entry.bytes).decode() == answer.choices[0].message.content
    expected = torch.log_softmax(first_token_logits(hf_model, loaded_fp32, QUESTION), dim=-1)
    top = torch.topk(expected, 5)
    tokenizer = loaded_fp32.tokenizer
    assert [t.token for t in content[0].top_logprobs] == [tokenizer.decode([i]) for i in top.indices.tolist()]
    assert [t.logprob for t in content[0].top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)


async def test_streamed_logprobs_equal_the_plain_answers(client) -> None:
    plain = await ask(client, QUESTION, max_tokens=6, logprobs=True, top_logprobs=2)
    stream = await ask(client, QUESTION, max_tokens=6, logprobs=True, top_logprobs=2, stream=True)
    streamed = [entry async for chunk in stream for choice in chunk.choices
                if choice.logprobs is not None for entry in choice.logprobs.content]
    expected = plain.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in expected]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in expected], abs=1e-5)
    assert [len(e.top_logprobs) for e in streamed] == [2] * 6
    without = await ask(client, QUESTION, max_tokens=2)
    assert without.choices[0].logprobs is None


def _most_repeated(content) -> int:
    tokens = [e.token for e in content]
    return max(tokens.count(t) for t in tokens)


@pytest.mark.parametrize("penalty", [{"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                                     {"extra_body": {"repetition_penalty": 2.0}}])
async def test_a_penalty_changes_a_greedy_answer_that_repeats(client, penalty) -> None:
    plain = await ask(client, REPEAT, max_tokens=12, logprobs=True)
    penalized = await ask(client, REPEAT, max_tokens=12, logprobs=True, **penalty)
    assert _most_repeated(plain.choices[0].logprobs.content) >= 5  # the plain answer does repeat
    assert penalized.choices[0].message.content != plain.choices[0].message.content
    assert _most_repeated(penalized.choices[0].logprobs.content) < _most_repeated(plain.choices[0].logprobs.content)


async def test_logit_bias_forces_and_bans_tokens(client, hf_model, loaded_fp32) -> None:
    tokenizer = loaded_fp32.tokenizer
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    answer = await ask(client, QUESTION, max_tokens=3, logit_bias={str(forced): 100})
    assert answer.choices[0].message.content == tokenizer.decode([forced]) * 3
    greedy = int(first_token_logits(hf_model, loaded_fp32, QUESTION).argmax())
    plain = await ask(client, QUESTION, max_tokens=1, logprobs=True, top_logprobs=5)
    banned = await ask(client, QUESTION, max_tokens=1, logprobs=True, top_logprobs=5, logit_bias={str(greedy): -100})
    assert plain.choices[0].logprobs.content[0].token == tokenizer.decode([greedy])
    assert banned.choices[0].logprobs.content[0].token != tokenizer.decode([greedy])
    assert tokenizer.decode([greedy]) not in [t.token for t in banned.choices[0].logprobs.content[0].top_logprobs]


BAD = {  # (fields, the code, a word the message names)
    "top_logprobs over 20": ({"logprobs": True, "top_logprobs": 21}, "bad_request", "top_logprobs"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, "bad_request", "logprobs"),
    "logprobs not a boolean": ({"logprobs": 1}, "bad_request", "logprobs"),
    "presence_penalty over 2": ({"presence_penalty": 2.5}, "bad_request", "presence_penalty"),
    "frequency_penalty under -2": ({"frequency_penalty": -3}, "bad_request", "frequency_penalty"),
    "repetition_penalty 0": ({"repetition_penalty": 0}, "bad_request", "repetition_penalty"),
    "repetition_penalty over 2": ({"repetition_penalty": 2.5}, "bad_request", "repetition_penalty"),
    "logit_bias id outside the vocabulary": ({"logit_bias": {"999999": 1}}, "bad_request", "999999"),
    "logit_bias value over 100": ({"logit_bias": {"5": 101}}, "bad_request", "logit_bias[5]"),
    "logit_bias key not an id": ({"logit_bias": {"abc": 1}}, "bad_request", "abc"),
    "a field still not implemented": ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                                      "unsupported_parameter", "tools"),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_values_are_refused_with_a_clear_400(client, case: str) -> None:
    fields, code, named = BAD[case]
    with pytest.raises(openai.BadRequestError) as refused:
        await ask(client, QUESTION, max_tokens=1, extra_body=fields)
    assert refused.value.body["code"] == code and named in refused.value.body["message"]


async def test_logprobs_with_a_session_are_refused(client, server) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await ask(client, QUESTION, max_tokens=1, logprobs=True, extra_headers={"X-Session-Id": "any"})
    assert refused.value.body["code"] == "unsupported_parameter" and "logprobs" in refused.value.body["message"]


async def test_websocket_params_shape_logits_and_carry_logprobs(server, loaded_fp32) -> None:
    tokenizer = loaded_fp32.tokenizer
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    async with server.connect() as ws:
        await hello(ws)
        text, done = await turn(ws, QUESTION, {"temperature": 0, "max_tokens": 3, "logit_bias": {str(forced): 100},
                                               "frequency_penalty": 0.5})
        assert text == tokenizer.decode([forced]) * 3 and done["finish_reason"] == "length"
        await ws.send(json.dumps({"type": "user", "id": "lp", "content": "Hi",
                                  "params": {"temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 3,
                                             "ignore_eos": True}}))
        frames = await recv_until(ws, "done")
        entries = [e for f in frames if f["type"] == "token" for e in f["logprobs"]]
        assert len(entries) == frames[-1]["usage"]["completion_tokens"] == 4
        assert "".join(f["text"] for f in frames if f["type"] == "token") == "".join(e["token"] for e in entries)
        for entry in entries:  # greedy: the chosen token is the most likely one
            assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["token"] == entry["token"]
            assert entry["logprob"] == entry["top_logprobs"][0]["logprob"] <= 0
        await ws.send(json.dumps({"type": "user", "id": "bad", "content": "Hi", "params": {"top_logprobs": 2}}))
        frame = json.loads(await ws.recv())
        assert frame["type"] == "error" and frame["code"] == "bad_request" and "logprobs" in frame["message"]
