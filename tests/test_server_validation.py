"""Request bodies and WebSocket frames are `msgspec.Struct`s: validated as they are decoded (strictly: no
string passes for a number), unknown fields refused with the documented error body, and every field shown
with its type and limits in `/schema/openapi.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import websockets

from chatcore.config import Settings
from chatcore.server.app import create_app
from chatcore.server.bodies import ChatCompletionRequest
from tests.server_helpers import hello

NULLABLE_NUMBER = [{"type": "number"}, {"type": "null"}]
NULLABLE_INTEGER = [{"type": "integer"}, {"type": "null"}]
HI = [{"role": "user", "content": "hi"}]


def chat_completion_schema(doc: dict[str, Any]) -> dict[str, Any]:
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    return doc["components"]["schemas"]["ChatCompletionRequest"]


def test_the_openapi_document_shows_the_chat_completion_fields_with_their_types_and_limits(tmp_path: Path) -> None:
    doc = create_app(Settings(data_dir=tmp_path)).openapi_schema.to_schema()
    schema = chat_completion_schema(doc)
    props = schema["properties"]
    assert set(props) == {f.encode_name for f in msgspec.structs.fields(ChatCompletionRequest)}
    assert schema["required"] == ["messages"] and schema["additionalProperties"] is False
    assert props["messages"] == {"items": {"$ref": "#/components/schemas/ChatMessage"}, "type": "array",
                                 "minItems": 1}
    assert doc["components"]["schemas"]["ChatMessage"]["properties"]["role"] == {
        "type": "string", "enum": ["system", "user", "assistant", "developer", "tool"]}
    assert props["temperature"] == {"oneOf": NULLABLE_NUMBER, "minimum": 0.0, "maximum": 2.0}
    assert props["top_p"] == {"oneOf": NULLABLE_NUMBER, "exclusiveMinimum": 0.0, "maximum": 1.0}
    assert props["presence_penalty"] == {"oneOf": NULLABLE_NUMBER, "minimum": -2.0, "maximum": 2.0}
    assert props["n"] == {"oneOf": NULLABLE_INTEGER, "minimum": 1, "maximum": 8}
    assert props["top_logprobs"] == {"oneOf": NULLABLE_INTEGER, "minimum": 0, "maximum": 20}
    assert props["max_tokens"] == {"oneOf": NULLABLE_INTEGER, "minimum": 1}
    assert props["stop"] == {"oneOf": [
        {"type": "string", "minLength": 1, "maxLength": 64},
        {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 64}, "maxItems": 4},
        {"type": "null"}]}
    assert props["logit_bias"]["maxProperties"] == 300
    assert props["stream"] == {"type": "boolean", "default": False}
    assert props["top_k"]["minimum"] == 0 and "extension" in props["top_k"]["description"]


@pytest.mark.model
def test_the_served_openapi_document_is_the_same(live_server, tmp_path: Path) -> None:
    status, doc = live_server.get("/schema/openapi.json")
    assert status == 200
    built = create_app(Settings(data_dir=tmp_path)).openapi_schema.to_schema()
    assert chat_completion_schema(doc) == chat_completion_schema(built)


UNKNOWN_FIELD = {"error": {"code": "bad_request", "message": "Object contains unknown field `bogus`"}}


@pytest.mark.model
@pytest.mark.parametrize(("method", "path", "body"), [
    ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "bogus": 1}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "bogus": 1}),
    ("POST", "/v1/sessions", {"title": "t", "bogus": 1}),
    ("POST", "/v1/sessions/import", {"messages": [*HI, {"role": "assistant", "content": "hello"}], "bogus": 1}),
    ("PATCH", "/v1/sessions/any", {"title": "t", "bogus": 1}),
    ("POST", "/v1/sessions/any/branch", {"turns": 0, "bogus": 1}),
])
def test_an_unknown_field_is_refused_by_name(live_server, method: str, path: str, body: dict[str, Any]) -> None:
    assert live_server.request(method, path, body) == (400, UNKNOWN_FIELD)


@pytest.mark.model
@pytest.mark.parametrize(("body", "code", "message"), [
    ({"max_tokens": "1"}, "bad_request", "max_tokens must be an integer or null"),
    ({"temperature": True}, "bad_request", "temperature must be a number or null"),
    ({"temperature": 2.5}, "bad_request", "temperature must be a number <= 2.0"),
    ({"parallel_tool_calls": "yes"}, "bad_request", "parallel_tool_calls must be a boolean or null"),
    ({"tool_choice": {"type": "function", "function": "f"}}, "bad_request", "tool_choice.function must be an object"),
    ({"messages": []}, "bad_request", "messages must be a list of length >= 1"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "bad_request",
     "messages[0].role: Invalid enum value 'robot'"),
    ({"store": True}, "unsupported_parameter",
     "store is not supported by this server; leave it out (or send store: null)"),
    ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "unsupported_parameter",
     "messages[0].name is not supported by this server on user messages; leave it out"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c1"}]}, "unsupported_parameter",
     "messages[0].tool_call_id is not supported by this server on user messages; leave it out"),
    ({"messages": [*HI, {"role": "assistant", "content": "no", "refusal": "no"}, *HI]}, "unsupported_parameter",
     "messages[1].refusal is not supported by this server on assistant messages; leave it out"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "happy"}]}, "bad_request",
     "messages[0]: Object contains unknown field `mood`"),
    ({"stream": True, "stream_options": {"evil": 1}}, "bad_request",
     "stream_options: Object contains unknown field `evil`"),
    ({"tool_choice": {"type": "function", "function": {"name": "f", "strict": True}}}, "bad_request",
     "tool_choice.function: Object contains unknown field `strict`"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}, "extra": 1}}, "bad_request",
     "tool_choice: Object contains unknown field `extra`"),
    ({"logit_bias": {"9" * 5000: 1}}, "bad_request",
     "logit_bias key '99999999999999999999'... is outside the vocabulary (0..49151)"),
    ({"logit_bias": {"0" * 5000 + "7": 200}}, "bad_request", "logit_bias[7] must be in [-100.0, 100.0]"),
    ({"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}, *HI]}, "bad_request",
     "the arguments of tool call 'f' must be a JSON object"),
])
def test_a_bad_chat_completion_field_gets_the_documented_error_body(live_server, body: dict[str, Any], code: str,
                                                                     message: str) -> None:
    status, answer = live_server.request("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 1, **body})
    assert (status, answer) == (400, {"error": {"code": code, "message": message}})


@pytest.mark.model
async def test_a_frame_with_a_bad_field_type_gets_an_error_frame_and_the_socket_stays_open(live_server) -> None:
    async with websockets.connect(live_server.ws_url) as ws:
        await ws.send(json.dumps({"type": "hello", "title": 5}))
        assert json.loads(await ws.recv()) == {"type": "error", "code": "bad_request",
                                               "message": "title must be a string or null"}
        await hello(ws)
        for params, message in (({"temperature": "hot"}, "params.temperature must be a number or null"),
                                ({"frob": 1}, "params: Object contains unknown field `frob`")):
            await ws.send(json.dumps({"type": "user", "id": "x", "content": "hi", "params": params}))
            assert json.loads(await ws.recv()) == {"type": "error", "code": "bad_request", "message": message}
        await ws.send(json.dumps({"type": "user", "id": 7, "content": "hi"}))
        assert json.loads(await ws.recv()) == {"type": "error", "code": "bad_request", "message": "id must be a string"}
        for frame in ({"type": "ping", "at": 1}, {"type": "user", "id": "y", "content": "hi", "stream": True}):
            await ws.send(json.dumps(frame))  # a field the frame does not define: refused, never ignored
            answer = json.loads(await ws.recv())
            assert answer["type"] == "error" and answer["code"] == "bad_request", answer
            assert "unknown field" in answer["message"] and list(frame)[-1] in answer["message"], answer
        await ws.send(json.dumps({"type": "ping"}))
        assert json.loads(await ws.recv()) == {"type": "pong"}


@pytest.mark.model
def test_an_assistant_message_sent_back_as_received_is_taken(live_server) -> None:
    """What the official client's `message.model_dump()` holds: its empty fields ask for nothing."""
    echoed = {"role": "assistant", "content": "Hello!", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None}
    status, answer = live_server.request("POST", "/v1/chat/completions",
                                         {"messages": [*HI, echoed, *HI], "max_tokens": 1})
    assert status == 200 and answer["usage"]["prompt_tokens"] > 0, answer
