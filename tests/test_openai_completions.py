"""`POST /v1/completions` (OpenAI's legacy route) with the official `openai` client, against the real
app and model in fp32: a string or token ids, plain and streamed, legacy logprobs, cached_tokens."""

from __future__ import annotations

import openai
import pytest

from tests.server_helpers import SYSTEM

pytestmark = pytest.mark.model
PROMPT = SYSTEM + "\n\nCustomer: Can I get a refund?\nAtlas:"


async def complete(client: openai.AsyncOpenAI, prompt: str | list[int], **params):
    return await client.completions.create(model="chatcore", prompt=prompt, temperature=0, **params)


async def test_a_string_prompt_continues_with_legacy_logprobs_and_cached_tokens(client) -> None:
    first = await complete(client, PROMPT, max_tokens=6, logprobs=3)
    again = await complete(client, PROMPT, max_tokens=6, logprobs=3)
    assert first.object == "text_completion" and first.id.startswith("cmpl-")
    choice = first.choices[0]
    assert choice.text and choice.finish_reason == "length" and again.choices[0].text == choice.text
    assert first.usage.completion_tokens == 6
    assert first.usage.total_tokens == first.usage.prompt_tokens + 6
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * (first.usage.prompt_tokens // 16) - 16 > 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(6)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) == 3 and top[token] == logprob == max(top.values()) and logprob <= 0


async def test_token_ids_give_the_string_prompts_answer(client, loaded_fp32) -> None:
    ids = loaded_fp32.tokenizer(PROMPT)["input_ids"]
    by_text = await complete(client, PROMPT, max_tokens=5)
    by_ids = await complete(client, ids, max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    assert by_ids.choices[0].logprobs is None


async def test_streamed_completion_equals_the_plain_one(client, loaded_fp32) -> None:
    plain = await complete(client, PROMPT, max_tokens=6, logprobs=1)
    ids = loaded_fp32.tokenizer(PROMPT)["input_ids"]
    stream = await complete(client, ids, max_tokens=6, logprobs=1, stream=True,
                            stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    streamed_tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed_tokens == plain.choices[0].logprobs.tokens
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 6 and usage.prompt_tokens == len(ids)
    assert usage.prompt_tokens_details.cached_tokens > 0


async def test_penalties_and_logit_bias_apply_to_completions(client, loaded_fp32) -> None:
    forced = loaded_fp32.tokenizer.encode(" banana", add_special_tokens=False)[0]
    answer = await complete(client, PROMPT, max_tokens=2, logit_bias={str(forced): 100}, frequency_penalty=0.1)
    assert answer.choices[0].text == loaded_fp32.tokenizer.decode([forced]) * 2


BAD = {  # (fields, the code, a word the message names)
    "echo": ({"echo": True}, "unsupported_parameter", "echo"),
    "suffix": ({"suffix": "The end."}, "unsupported_parameter", "suffix"),
    "best_of": ({"best_of": 2}, "unsupported_parameter", "best_of"),
    "a batch of prompts": ({"prompt": ["one", "two"]}, "unsupported_parameter", "prompt"),
    "a token id outside the vocabulary": ({"prompt": [1, 2, 10**7]}, "bad_request", str(10**7)),
    "an empty prompt": ({"prompt": ""}, "bad_request", "prompt"),
    "logprobs over 5": ({"logprobs": 6}, "bad_request", "logprobs"),
    "an unknown field": ({"tools": []}, "bad_request", "tools"),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_requests_are_refused_with_a_clear_400(client, case: str) -> None:
    fields, code, named = BAD[case]
    body = {"prompt": "Hello", **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        await client.completions.create(model="chatcore", max_tokens=1, prompt=body.pop("prompt"), extra_body=body)
    assert refused.value.body["code"] == code and named in refused.value.body["message"]


async def test_fields_that_ask_for_nothing_are_accepted(client) -> None:
    answer = await client.completions.create(model="chatcore", prompt="Hello", max_tokens=1, echo=False, best_of=1,
                                             suffix="", logprobs=None)
    assert answer.usage.completion_tokens == 1


@pytest.mark.parametrize("params", [{"top_p": 2.2e-277}, {"temperature": 1e-300}, {"temperature": 1e-40, "top_p": 0.5}],
                         ids=["top_p below float32", "temperature below float32", "logits past float32"])
async def test_extreme_but_valid_sampling_values_still_sample(client, params: dict) -> None:
    """A top_p that rounds to 0 in float32 kept no token, and a tiny temperature overflowed the logits: NaN
    probabilities and a 500 (found by schemathesis in `make stress`). The likeliest token now always stays,
    and temperatures below 1e-5 are greedy."""
    greedy = await client.completions.create(model="chatcore", prompt="The capital of France is", max_tokens=4,
                                             temperature=0)
    reply = await client.completions.create(model="chatcore", prompt="The capital of France is", max_tokens=4,
                                            **params)
    assert reply.choices[0].text == greedy.choices[0].text
