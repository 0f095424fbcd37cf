"""`stream_options` only shapes a stream (issue 47): on a request that does not stream, both OpenAI routes
refuse it with a 400 naming it, as OpenAI does, instead of ignoring it; `null` asks for nothing and is taken;
with `stream: true` it still adds the usage chunk. The real app and model, over HTTP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.inprocess_server import InProcessServer

pytestmark = pytest.mark.model
ROUTES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hi."}]},
          "/v1/completions": {"prompt": "Say hi."}}
REFUSED = "stream_options is only allowed when stream is true"


@pytest.fixture
async def http(server: InProcessServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as client:
        yield client


def body(route: str, **fields: Any) -> dict[str, Any]:
    return {**ROUTES[route], "max_tokens": 2, "temperature": 0, **fields}


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("stream", [{}, {"stream": False}], ids=["stream left out", "stream false"])
@pytest.mark.parametrize("options", [{"include_usage": True}, {"include_usage": False}, {}])
async def test_stream_options_without_a_stream_is_refused_naming_it(http: httpx.AsyncClient, route: str,
                                                                    stream: dict[str, Any],
                                                                    options: dict[str, Any]) -> None:
    resp = await http.post(route, json=body(route, stream_options=options, **stream))
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {"code": "bad_request", "message": REFUSED}


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_null_stream_options_asks_for_nothing_and_is_taken(http: httpx.AsyncClient, route: str) -> None:
    resp = await http.post(route, json=body(route, stream_options=None))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_stream_options_with_a_stream_still_adds_the_usage_chunk(http: httpx.AsyncClient, route: str) -> None:
    streamed = body(route, stream=True, stream_options={"include_usage": True})
    async with http.stream("POST", route, json=streamed) as resp:
        assert resp.status_code == 200
        lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2].removeprefix("data: "))
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2
