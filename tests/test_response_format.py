"""`response_format` (JSON, and JSON a schema validates) by grammar-constrained decoding: in the engine,
on `/v1/chat/completions` with the official `openai` client, and as WebSocket params."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from chatcore.engine.grammar import GrammarError, ResponseFormat, parse_response_format
from chatcore.engine.request import SamplingParams
from tests.engine_helpers import add_all, chat_ids, run_to_end
from tests.server_helpers import hello, recv_until, turn

pytestmark = pytest.mark.model

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer", "minimum": 0,
                                                                              "maximum": 100_000_000},
                   "capital": {"type": "boolean"}, "rating": {"enum": ["low", "medium", "high"]}},
    "required": ["city", "population", "capital", "rating"],
    "additionalProperties": False,
}
QUESTIONS = ["Describe Paris as JSON: its name, population, whether it is a capital, and a rating.",
             "Tell me about a small fishing town, as JSON.",
             "What is your favourite city? Answer in JSON."]
OK_OBJECT = "Give me a JSON object with a key 'ok' set to true."


def schema_format(schema: dict) -> ResponseFormat:
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert fmt is not None
    return fmt


def test_the_engine_only_emits_json_the_schema_validates(make_core, loaded_fp32) -> None:
    """Greedy and sampled (n=2) requests in one batch; the unconstrained one beside them is untouched."""
    core = make_core()
    tok = loaded_fp32.tokenizer
    fmt = schema_format(CITY)
    constrained = [core.make_request(chat_ids(tok, q), SamplingParams(max_tokens=96, response_format=fmt))
                   for q in QUESTIONS]
    sampled = core.make_request(chat_ids(tok, QUESTIONS[0]),
                                SamplingParams(max_tokens=96, temperature=1.0, seed=7, n=2, response_format=fmt))
    plain = core.make_request(chat_ids(tok, QUESTIONS[0]), SamplingParams(max_tokens=12))
    add_all(core, [*constrained, sampled, plain])
    outs = run_to_end(core)
    answers = [c for r in [*constrained, sampled] for c in outs[r.request_id].outputs]
    assert len(answers) == 5
    for answer in answers:
        assert answer.finish_reason == "stop", answer
        jsonschema.validate(json.loads(answer.text), CITY)
    alone = make_core()  # the unconstrained request's answer equals one computed alone
    reference = alone.make_request(chat_ids(tok, QUESTIONS[0]), SamplingParams(max_tokens=12))
    add_all(alone, [reference])
    assert outs[plain.request_id].outputs[0].token_ids == run_to_end(alone)[reference.request_id].outputs[0].token_ids


def test_json_object_ends_when_the_object_is_complete_even_with_eos_ignored(make_core, loaded_fp32) -> None:
    core = make_core()
    req = core.make_request(chat_ids(loaded_fp32.tokenizer, OK_OBJECT),
                            SamplingParams(max_tokens=64, ignore_eos=True,
                                           response_format=ResponseFormat("json_object")))
    add_all(core, [req])
    answer = run_to_end(core)[req.request_id].outputs[0]
    assert answer.finish_reason == "stop"
    assert isinstance(json.loads(answer.text), dict)


def test_schemas_are_checked_before_anything_runs(make_core) -> None:
    core = make_core()
    with pytest.raises(GrammarError, match='Unsupported type "frob"'):
        core.grammar_compiler.compile(schema_format({"type": "frob"}))
    for bad in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": []}},
                {"type": "yaml"}, {"type": "json_object", "schema": {}}, "json"):
        with pytest.raises(ValueError):
            parse_response_format(bad)
    assert parse_response_format({"type": "text"}) is None


async def test_json_schema_with_the_official_client_plain_and_streamed(client) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    answer = await client.chat.completions.create(model="chatcore", messages=messages, temperature=0, max_tokens=96,
                                                  response_format=response_format)
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), CITY)
    stream = await client.chat.completions.create(model="chatcore", messages=messages, temperature=0, max_tokens=96,
                                                  response_format=response_format, stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text == answer.choices[0].message.content
    obj = await client.chat.completions.create(model="chatcore", temperature=0, max_tokens=64,
                                               messages=[{"role": "user", "content": OK_OBJECT}],
                                               response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


@pytest.mark.parametrize(("response_format", "message"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}, "frob"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "xml"}, "response_format.type"),
])
async def test_a_schema_that_cannot_be_used_is_a_400(client, response_format, message) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="chatcore", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, response_format=response_format)
    assert message in refused.value.response.json()["error"]["message"]


# Compiles, and allows a first token (`[`), but every item refers only to itself: nothing can follow.
DEAD_END = {"type": "json_schema", "json_schema": {"name": "loop", "schema": {
    "type": "array", "items": {"allOf": [{"$ref": "#/items"}]}, "minItems": 1}}}


async def test_a_schema_that_dead_ends_after_its_first_token_is_a_client_error(client, server) -> None:
    """Refused as the client's (400 `bad_request` naming the schema), plain, streamed and on a socket; never
    500 `internal`."""
    messages = [{"role": "user", "content": "A list, please."}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="chatcore", messages=messages, max_tokens=8,
                                             response_format=DEAD_END)
    error = refused.value.response.json()["error"]
    assert error["code"] == "bad_request" and "schema allows no output to be completed" in error["message"]
    stream = await client.chat.completions.create(model="chatcore", messages=messages, max_tokens=8,
                                                  response_format=DEAD_END, stream=True)
    with pytest.raises(openai.APIError) as failed:
        async for _ in stream:
            pass
    assert "schema allows no output to be completed" in str(failed.value) and "internal" not in str(failed.value)
    async with server.connect() as ws:
        await hello(ws)
        await ws.send(json.dumps({"type": "user", "id": "loop", "content": "A list, please.",
                                  "params": {"max_tokens": 8, "response_format": DEAD_END}}))
        frames = await recv_until(ws, "done")
        errors = [f for f in frames if f["type"] == "error"]
        assert frames[-1]["finish_reason"] == "error" and len(errors) == 1, frames
        assert errors[0]["code"] == "bad_request" and "schema allows no output" in errors[0]["message"], frames


async def test_response_format_as_a_websocket_param(server) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    async with server.connect() as ws:
        await hello(ws)
        text, done = await turn(ws, QUESTIONS[2], {"temperature": 0, "max_tokens": 96, "response_format": fmt})
        assert done["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text), CITY)
        await ws.send(json.dumps({"type": "user", "id": "bad", "content": "Hi",
                                  "params": {"response_format": {"type": "json_schema", "json_schema": {
                                      "schema": {"type": "frob"}}}}}))
        frames = await recv_until(ws, "error")
        assert frames[-1]["code"] == "bad_request" and "frob" in frames[-1]["message"]


async def test_a_stream_that_dead_ends_after_it_began_ends_with_one_error_event_on_every_route(server) -> None:
    """Chat, legacy completions and a session's turn (X-Session-Id, whose failure the sessions layer hands
    on as a typed outcome) alike: the schema dead-ends after its first token, so the stream has begun, and
    its last event before `[DONE]` is the error body, `bad_request` naming the schema."""
    ask = {"model": "chatcore", "max_tokens": 8, "response_format": DEAD_END, "stream": True}
    chat = {**ask, "messages": [{"role": "user", "content": "A list, please."}]}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as http:
        session = (await http.post("/v1/sessions", json={})).json()["id"]
        for path, body, headers in [("/v1/chat/completions", chat, {}),
                                    ("/v1/completions", {**ask, "prompt": "A list, please."}, {}),
                                    ("/v1/chat/completions", chat, {"X-Session-Id": session})]:
            async with http.stream("POST", path, json=body, headers=headers) as resp:
                assert resp.status_code == 200, (path, headers, await resp.aread())
                events = [line.removeprefix("data: ") async for line in resp.aiter_lines() if line.startswith("data:")]
            assert events[-1] == "[DONE]", (path, headers, events)
            *chunks, error = [json.loads(event) for event in events[:-1]]
            assert chunks and not [chunk for chunk in chunks if "error" in chunk], (path, headers, events)
            assert list(error) == ["error"] and error["error"]["code"] == "bad_request", (path, headers, events)
            assert "schema allows no output to be completed" in error["error"]["message"], (path, headers, events)
