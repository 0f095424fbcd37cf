"""The review's two ways for one cheap request to end every running turn (issue 47, defect 1), on a real keyed
server: while alice streams an answer, mallory sends `repetition_penalty: 1e-300` with `temperature: 1`, and a
`response_format` schema that refers only to itself. Both are refused with a 400 that says why, and alice's
answer runs to its end, whole."""

from __future__ import annotations

import json
import os
import types
from typing import Any

import httpx
import pytest

from tests.reliability_helpers import log_problems
from tests.server_helpers import create_key, start_server

pytestmark = pytest.mark.model
TOKENS = 40


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    data = tmp_path_factory.mktemp("fault-isolation")
    cli = types.SimpleNamespace(env={**os.environ, "CHATCORE_DATA_DIR": str(data)})
    keys = {"alice": create_key(cli, "alice"), "mallory": create_key(cli, "mallory")}
    server = start_server(data, max_tokens_limit=TOKENS)
    server.keys = keys
    yield server
    server.stop()


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 4, **fields}


HOSTILE = [  # (the request, what its refusal names)
    (chat(repetition_penalty=1e-300, temperature=1), "repetition_penalty"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"allOf": [{"$ref": "#"}]}}}),
     "no output satisfies it"),
]


async def test_hostile_sampling_requests_are_refused_and_another_tenants_stream_ends_whole(keyed) -> None:
    alice = {"Authorization": f"Bearer {keyed.keys['alice']}"}
    mallory = {"Authorization": f"Bearer {keyed.keys['mallory']}"}
    refusals, chunks, final, usage = [], 0, None, {}
    async with httpx.AsyncClient(base_url=keyed.base_url, timeout=120) as client:
        body = chat(max_tokens=TOKENS, temperature=0, ignore_eos=True, stream=True,
                    stream_options={"include_usage": True})
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=alice) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event["choices"] and event["choices"][0]["delta"].get("content"):
                    chunks += 1
                    if chunks == 1:  # alice is decoding: now mallory's requests
                        for request, names in HOSTILE:
                            answer = await client.post("/v1/chat/completions", json=request, headers=mallory)
                            refusals.append((answer.status_code, names in answer.text, answer.text))
                if event["choices"] and event["choices"][0].get("finish_reason"):
                    final = event["choices"][0]["finish_reason"]
                if event.get("usage"):
                    usage = event["usage"]
        ready = await client.get("/readyz")
    assert [(status, named) for status, named, _ in refusals] == [(400, True)] * len(HOSTILE), refusals
    assert final == "length" and usage["completion_tokens"] == TOKENS
    assert ready.status_code == 200
    assert not log_problems(keyed)
