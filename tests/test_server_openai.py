"""`POST /v1/chat/completions` and `GET /v1/models` with the official `openai` client, against a real server."""

from __future__ import annotations

import json
import uuid

import httpx
import openai
import pytest

from tests.server_helpers import SYSTEM

pytestmark = pytest.mark.model
BLOCK = 16
# A long system prompt; each test adds a nonce in front so that its first request is a cold miss.


@pytest.fixture(autouse=True)
def audit_after(live_server):
    yield
    status, body = live_server.get("/v1/admin/cache")
    assert status == 200 and body["audit"]["ok"], body["audit"]


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    # Open mode: the client's "Bearer anything" must be ignored.
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="anything", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, content: str, system: str | None = None, **params):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return client.chat.completions.create(model="chatcore", messages=messages, **params)


def warm(client: openai.OpenAI, content: str, system: str | None = None) -> None:
    """Put the prompt's full blocks in the prefix cache. The default dtype on a CPU with bf16 is
    bfloat16, where a greedy answer can depend on how much of the prompt came from the cache;
    requests made after this one all find the same cached prefix, so they compare like with like."""
    ask(client, content, system=system, max_tokens=1, temperature=0)


def nonce_system() -> str:
    return f"Conversation {uuid.uuid4().hex}. {SYSTEM}"


def test_models_lists_the_served_model(client, live_server) -> None:
    models = client.models.list().data
    assert len(models) == 1
    assert models[0].id and models[0].owned_by == "chatcore"
    response = ask(client, "Say hello.", max_tokens=2, temperature=0)
    assert response.model == models[0].id


def test_non_streaming_greedy_is_deterministic_and_obeys_max_tokens(client) -> None:
    warm(client, "Write a short poem about the sea.")
    first = ask(client, "Write a short poem about the sea.", max_tokens=12, temperature=0)
    second = ask(client, "Write a short poem about the sea.", max_tokens=12, temperature=0)
    assert first.object == "chat.completion" and first.id.startswith("chatcmpl-") and first.id != second.id
    assert len(first.choices) == 1
    choice = first.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.message.content == second.choices[0].message.content
    usage = first.usage
    assert usage.completion_tokens == 12 and choice.finish_reason == "length"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    short = ask(client, "Write a short poem about the sea.", max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert choice.message.content.startswith(short.choices[0].message.content)


def test_ignore_eos_runs_past_the_end_of_the_answer(client) -> None:
    question = "Reply with the single word: yes."
    natural = ask(client, question, max_tokens=200, temperature=0)
    assert natural.choices[0].finish_reason == "stop"
    ended_at = natural.usage.completion_tokens
    forced = ask(client, question, max_tokens=ended_at + 8, temperature=0, extra_body={"ignore_eos": True})
    assert forced.choices[0].finish_reason == "length" and forced.usage.completion_tokens == ended_at + 8
    with pytest.raises(openai.BadRequestError, match="ignore_eos must be a boolean"):
        ask(client, question, max_tokens=4, extra_body={"ignore_eos": "yes"})


def test_streaming_matches_non_streaming(client) -> None:
    question = "Name three colours."
    warm(client, question)
    plain = ask(client, question, max_tokens=16, temperature=0)
    chunks = list(ask(client, question, max_tokens=16, temperature=0, stream=True,
                      stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_streaming_wire_format_is_sse_ending_with_done(live_server) -> None:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "stream": True, "max_tokens": 4,
            "temperature": 0}
    with httpx.stream("POST", live_server.base_url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = "".join(resp.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), raw
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "usage" not in payloads[-1]  # only with stream_options.include_usage


def test_n_and_seed(client) -> None:
    params = {"max_tokens": 10, "temperature": 1.0, "n": 2, "seed": 1234}
    warm(client, "Invent a name for a cat.")
    first = ask(client, "Invent a name for a cat.", **params)
    again = ask(client, "Invent a name for a cat.", **params)
    assert [c.index for c in first.choices] == [0, 1]
    assert all(c.message.content for c in first.choices)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]
    assert 2 <= first.usage.completion_tokens <= 20
    # Streamed, both samples arrive, each under its own index.
    stream = ask(client, "Invent a name for a cat.", stream=True, **params)
    texts: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert texts == {c.index: c.message.content for c in first.choices}


def test_stop_strings_end_the_answer_before_the_match(client) -> None:
    question = "Count from 1 to 20, separated by commas."
    warm(client, question)
    reference = ask(client, question, max_tokens=20, temperature=0).choices[0].message.content
    # A two-character stop string from the middle of the greedy answer, whose first match is not at its start.
    candidates = [reference[k:k + 2] for k in range(len(reference) // 3, len(reference) * 2 // 3)]
    stop = next(c for c in candidates if c.strip() and reference.index(c) > 0)
    stopped = ask(client, question, max_tokens=20, temperature=0, stop=[stop, "never-appears"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == reference[:reference.index(stop)]
    assert stopped.usage.completion_tokens < 20


def test_cached_tokens_on_a_shared_long_system_prompt(client) -> None:
    system = nonce_system()
    first = ask(client, "When are you open?", system=system, max_tokens=4, temperature=0)
    second = ask(client, "Can I get a refund?", system=system, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    system_tokens = first.usage.prompt_tokens - 12  # the question and the chat markup around it
    assert cached >= (system_tokens // BLOCK) * BLOCK >= 4 * BLOCK
    assert cached < second.usage.prompt_tokens


def test_x_session_id_appends_the_exchange_to_a_session(client, live_server) -> None:
    system = nonce_system()
    status, session = live_server.request("POST", "/v1/sessions", {"title": "via openai", "system_prompt": system})
    assert status == 201
    headers = {"X-Session-Id": session["id"]}
    q1, q2 = "Can I get a refund?", "What about luggage?"
    first = ask(client, q1, system=system, max_tokens=12, temperature=0, extra_headers=headers)
    a1 = first.choices[0].message.content
    messages = [{"role": "system", "content": system}, {"role": "user", "content": q1},
                {"role": "assistant", "content": a1}, {"role": "user", "content": q2}]
    chunks = list(client.chat.completions.create(model="chatcore", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_headers=headers))
    a2 = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    status, detail = live_server.get(f"/v1/sessions/{session['id']}")
    assert status == 200
    assert [(m["role"], m["content"]) for m in detail["history"]] == [
        ("user", q1), ("assistant", a1), ("user", q2), ("assistant", a2)]
    assert detail["history"][1]["usage"]["completion_tokens"] == first.usage.completion_tokens
    # The second request reuses the whole first exchange (all but its last sampled token).
    exchange1 = first.usage.prompt_tokens + first.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= exchange1 - 1
    assert usage.prompt_tokens > exchange1
    assert detail["history"][3]["usage"]["cached_tokens"] == usage.prompt_tokens_details.cached_tokens
    live_server.request("DELETE", f"/v1/sessions/{session['id']}")


def test_x_session_id_of_an_unknown_session_is_not_found(client) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        ask(client, "Hello?", max_tokens=2, extra_headers={"X-Session-Id": "no-such-session"})
    assert err.value.response.json()["error"]["code"] == "not_found"


UNIMPLEMENTED = {  # a value that asks for the feature, and one that asks for nothing
    # tools: this model's chat template takes none (tests/test_openai_tools.py has one that does)
    "tools": ([{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}], []),
    "store": (True, False),
    "metadata": ({"team": "a"}, {}), "service_tier": ("flex", "auto"),
}


@pytest.mark.parametrize("field", sorted(UNIMPLEMENTED))
def test_a_field_that_is_not_implemented_is_refused_not_ignored(client, field: str) -> None:
    asks, neutral = UNIMPLEMENTED[field]
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, "Say hi.", max_tokens=1, temperature=0, extra_body={field: asks})
    assert refused.value.status_code == 400
    assert refused.value.body["code"] == "unsupported_parameter" and field in refused.value.body["message"]
    answer = ask(client, "Say hi.", max_tokens=1, temperature=0, extra_body={field: neutral})
    assert answer.usage.completion_tokens == 1


def test_each_turn_logs_one_line_of_what_it_cost(client, live_server) -> None:
    import re

    stateless = ask(client, "Name a fruit.", max_tokens=3, temperature=0)
    status, session = live_server.request("POST", "/v1/sessions", {"title": "logged"})
    assert status == 201
    turn = ask(client, "Name a colour.", max_tokens=3, temperature=0, extra_headers={"X-Session-Id": session["id"]})
    lines = re.findall(r"turn tenant=(\S+) session=(\S+) request=(\S+) prompt=(\d+) cached_device=(\d+) "
                       r"cached_disk=(\d+) recomputed=(\d+) ttft_ms=(\d+) generated=(\d+) finish=(\S+)", live_server.log())
    by_session = {line[1]: line for line in lines}
    for answer, key in ((stateless, "-"), (turn, session["id"])):
        _, _, request_id, prompt, device, disk, recomputed, _, generated, finish = by_session[key]
        assert request_id and int(prompt) == answer.usage.prompt_tokens
        assert int(device) + int(disk) == answer.usage.prompt_tokens_details.cached_tokens
        assert int(recomputed) == int(prompt) - int(device) - int(disk)
        assert int(generated) == answer.usage.completion_tokens and finish == answer.choices[0].finish_reason
    live_server.request("DELETE", f"/v1/sessions/{session['id']}")
