"""tools, tool_choice and role "tool" messages on /v1/chat/completions with the official `openai` client.

The default model's chat template takes no tools: a clear 400. A tiny random-weight Qwen2 model with a
Hermes-style template (tools in its system block, calls as `<tool_call>` blocks) shows the rest: a
required or named call is constrained to valid JSON the function's schema validates, plain and
streamed, and a conversation carrying the call and its result renders and answers.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import openai
import pytest

from chatcore.config import Settings
from chatcore.models.loader import load_model
from chatcore.server.bodies import ChatCompletionRequest, ChatMessage
from chatcore.server.errors import ApiError
from chatcore.server.openai_routes import parse_messages
from chatcore.server.tools import CallReader, parse_tools
from tests.inprocess_server import InProcessServer, serve
from tests.tiny_models import save_tiny_model

TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n"
    "{% endif %}You may call these functions: <tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Call one as <tool_call>\n{\"name\": <name>, \"arguments\": <object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}{% if m['role'] == 'system' %}"
    "{% elif m['role'] == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1,
                                                                              "maximum": 14}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def chat_request(**fields: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **fields}, ChatCompletionRequest)


def test_calls_are_read_from_an_answer_as_it_streams() -> None:
    tools = parse_tools(chat_request(tools=TOOLS))
    assert tools is not None
    reader = CallReader(tools)
    answer = ('Sure. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
              '<tool_call>{"name": "nope", "arguments": {}}</tool_call> <tool_call>{bad json</tool_call> done <tool')
    events = [e for i in range(0, len(answer), 7) for e in reader.feed(answer[i: i + 7])] + reader.close()
    calls = [part for kind, part in events if kind == "call"]
    text = "".join(part for kind, part in events if kind == "text")
    assert calls == [{"name": "get_time", "arguments": {"zone": "UTC"}}]
    assert text == ('Sure. <tool_call>{"name": "nope", "arguments": {}}</tool_call> <tool_call>{bad json</tool_call>'
                    ' done <tool')  # unknown functions and malformed blocks stay text
    single = CallReader(parse_tools(chat_request(tools=TOOLS, parallel_tool_calls=False)))
    twice = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>' * 2
    assert [kind for kind, _ in single.feed(twice)] == ["call"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS * 2}, "distinct"),
])
def test_bad_tool_fields_are_named(fields, message) -> None:
    with pytest.raises(ApiError) as refused:
        parse_tools(chat_request(**fields))
    assert message in refused.value.message


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-tools"), "qwen2", max_position_embeddings=2048)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
async def tiny_server(tmp_path_factory, tiny_folder) -> AsyncIterator[InProcessServer]:
    settings = Settings(model=str(tiny_folder), data_dir=tmp_path_factory.mktemp("tools-data"), dtype="float32",
                        device="cpu", num_blocks=128, kv_disk_gb=0)
    async with serve(settings, load_model(settings)) as running:  # audits the pool at the end
        yield running


@pytest.fixture
async def client(tiny_server) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{tiny_server.port}/v1", api_key="anything",
                                  max_retries=0, timeout=120) as api:
        yield api


async def test_a_required_call_is_valid_json_the_function_validates(client) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris for three days?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        answer = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=choice,
                                                      temperature=0, max_tokens=200)
        picked = answer.choices[0]
        assert picked.finish_reason == "tool_calls" and picked.message.content is None
        [call] = picked.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        if isinstance(choice, dict):
            assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    stream = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                                  temperature=0, max_tokens=200, stream=True)
    chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].index == 0
    plain = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                                 temperature=0, max_tokens=200)
    assert deltas[0][0].function.arguments == plain.choices[0].message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def nested_objects(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(("parameters", "limit"), [
    (nested_objects(300), "the parameters of tool 'deep' is nested more than 32 levels deep (max_schema_depth)"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "$ref"),
    ({"type": "object", "properties": {"a": {"enum": [f"v{i}" for i in range(1001)]}}}, "max_schema_enum_values"),
])
async def test_a_required_call_whose_parameters_break_a_schema_limit_is_a_400(client, tiny_server, parameters,
                                                                              limit) -> None:
    tools = [*TOOLS, {"type": "function", "function": {"name": "deep", "parameters": parameters}}]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], tools=tools,
                                             tool_choice="required", max_tokens=4)
    error = refused.value.response.json()["error"]
    assert error["code"] == "bad_request" and error["message"].startswith("tools: ") and limit in error["message"]
    assert tiny_server.services.engine.grammar_compiler.compiling == 0


async def test_a_conversation_with_a_call_and_its_result_answers(client, tiny_server) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
    answer = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                                  temperature=0, max_tokens=4)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    engine = tiny_server.services.engine
    rendered = engine.info.tokenizer.decode(engine.chat_prompt(parse_messages(msgspec.convert(messages, list[ChatMessage])), TOOLS))  # as the route does
    assert '"arguments": {"city": "Paris", "days": 3}' in rendered and "Sunny, 21 C." in rendered
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        await client.chat.completions.create(model="tiny", max_tokens=2, messages=[
            {"role": "user", "content": "hi"}, {"role": "tool", "content": "orphan"}])


@pytest.mark.model
async def test_a_model_whose_template_takes_no_tools_refuses_them(tmp_path, loaded_fp32) -> None:
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=64, kv_disk_gb=0)
    async with serve(settings, loaded_fp32) as server, openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0) as api:
        for extra in ({"tools": TOOLS}, {"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "tool", "tool_call_id": "c", "content": "x"}]}):
            with pytest.raises(openai.BadRequestError) as refused:
                await api.chat.completions.create(model="m", max_tokens=2, **{
                    "messages": [{"role": "user", "content": "hi"}], **extra})
            body = refused.value.response.json()["error"]
            assert body["code"] == "unsupported_parameter" and "does not support tools" in body["message"]


async def test_a_websocket_session_refuses_tools_clearly(tiny_server) -> None:
    from tests.server_helpers import hello, recv_until

    async with tiny_server.connect() as ws:
        await hello(ws)
        await ws.send(json.dumps({"type": "user", "id": "t", "content": "hi", "params": {"tools": TOOLS}}))
        error = (await recv_until(ws, "error"))[-1]
    assert error["code"] == "unsupported_parameter" and "POST /v1/chat/completions" in error["message"]
