"""The tenant's store quota (`max_stored_chars_per_tenant`) counts every write: imports, branches (and
so edits), new sessions' system prompts and turns. A write past it is refused with `too_large`, stores
nothing, and a write that fits still succeeds (issue 47, defect 5: four branches of a 276,000-character
import under a 300,000 quota all returned 201, and the tenant then stored 1,380,000)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from chatcore.config import Settings
from tests.inprocess_server import InProcessServer, serve
from tests.server_helpers import hello, recv_until, turn

pytestmark = pytest.mark.model
QUOTA = 300_000
BIG = 276_000  # the review's import
SMALL = 5_000  # a small session, copied by the branches
TOKEN_CHARS = 81  # SmolLM2's longest token, in characters: what one generated token may add at most


@pytest.fixture
async def server(tmp_path, loaded_fp32) -> AsyncIterator[InProcessServer]:
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=128, kv_disk_gb=0,
                        max_stored_chars_per_tenant=QUOTA)
    async with serve(settings, loaded_fp32) as running:
        yield running


async def call(server: InProcessServer, method: str, path: str, body: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=120) as http:
        response = await http.request(method, path, json=body, headers=headers)
    return response.status_code, response.json() if response.content else None


async def imported(server: InProcessServer, chars: int, exchanges: int = 1) -> dict[str, Any]:
    """A session imported with `exchanges` exchanges of `chars` characters in all, in equal messages."""
    size = chars // (2 * exchanges)
    sizes = [size] * (2 * exchanges - 1) + [chars - size * (2 * exchanges - 1)]
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": ("hello world " * (n // 12 + 1))[:n]}
                for i, n in enumerate(sizes)]
    status, made = await call(server, "POST", "/v1/sessions/import", {"messages": messages})
    assert status == 201, made
    return made


async def stored(server: InProcessServer) -> int:
    """The tenant's stored characters as the API shows them: every message and system prompt."""
    total = 0
    for item in (await call(server, "GET", "/v1/sessions"))[1]:
        detail = (await call(server, "GET", f"/v1/sessions/{item['id']}"))[1]
        total += len(detail["system_prompt"] or "") + sum(len(m["content"]) for m in detail["history"])
    return total


async def snapshot(server: InProcessServer) -> dict[str, Any]:
    """Every session of the tenant with its history: what a refused write must leave as it was."""
    sessions = (await call(server, "GET", "/v1/sessions"))[1]
    return {s["id"]: (await call(server, "GET", f"/v1/sessions/{s['id']}"))[1]["history"] for s in sessions}


def refused_for_quota(status: int, answer: dict[str, Any]) -> bool:
    message = answer["error"]["message"]
    return (status == 413 and answer["error"]["code"] == "too_large"
            and "max_stored_chars_per_tenant" in message and str(QUOTA) in message)


async def test_a_branch_is_refused_once_its_copy_would_pass_the_quota(server) -> None:
    big = await imported(server, BIG)
    assert await stored(server) == BIG
    before = await snapshot(server)
    status, answer = await call(server, "POST", f"/v1/sessions/{big['id']}/branch", {"turns": 1})
    assert refused_for_quota(status, answer), answer
    assert f"the branch adds {BIG}" in answer["error"]["message"]
    assert await snapshot(server) == before  # no session made, nothing copied

    small = await imported(server, SMALL)
    total = BIG + SMALL
    while total + SMALL <= QUOTA:  # each copy that fits is made
        status, made = await call(server, "POST", f"/v1/sessions/{small['id']}/branch", {"turns": 1})
        assert status == 201 and made["turns"] == 1, made
        total += SMALL
        assert await stored(server) == total
    assert total == BIG + 4 * SMALL
    before = await snapshot(server)
    status, answer = await call(server, "POST", f"/v1/sessions/{small['id']}/branch", {"turns": 1})
    assert refused_for_quota(status, answer), answer
    assert await snapshot(server) == before and await stored(server) == total <= QUOTA
    status, made = await call(server, "POST", f"/v1/sessions/{small['id']}/branch", {"turns": 0})
    assert status == 201, made  # a branch that copies nothing adds nothing


async def test_branches_at_once_never_pass_the_quota_together(server) -> None:
    await imported(server, BIG)
    small = await imported(server, SMALL)
    room = QUOTA - BIG - SMALL
    results = await asyncio.gather(*(call(server, "POST", f"/v1/sessions/{small['id']}/branch", {"turns": 1})
                                     for _ in range(6)))
    made = sum(status == 201 for status, _ in results)
    assert all(status == 201 or refused_for_quota(status, answer) for status, answer in results), results
    assert 0 < made <= room // SMALL  # each counted while the others were being written
    assert await stored(server) == BIG + SMALL * (1 + made) <= QUOTA
    # One after another, the copies that still fit are made, and the quota is reached, never passed.
    while (status := (await call(server, "POST", f"/v1/sessions/{small['id']}/branch", {"turns": 1}))[0]) == 201:
        made += 1
    assert status == 413 and made == room // SMALL
    assert await stored(server) == BIG + SMALL * (1 + made) <= QUOTA


async def test_a_turn_reserves_its_message_and_its_answer_before_generating(server) -> None:
    await imported(server, QUOTA - 4_000)  # 4,000 characters left
    async with server.connect() as ws:
        session = (await hello(ws))["session_id"]
        before = await snapshot(server)
        # 256 tokens may hold 256 × 81 characters: refused before generating, nothing stored.
        for content, params in (("Name a colour.", {"temperature": 0, "max_tokens": 256}),
                                ("x" * 4_001, {"temperature": 0, "max_tokens": 1})):
            await ws.send(json.dumps({"type": "user", "id": uuid.uuid4().hex, "content": content, "params": params}))
            frames = await recv_until(ws, "error")
            assert [f["type"] for f in frames] == ["error"], frames  # no start, no token
            assert frames[0]["code"] == "too_large" and "max_stored_chars_per_tenant" in frames[0]["message"]
            assert await snapshot(server) == before
        # The same turn with 8 tokens (648 characters at most) fits.
        answer, done = await turn(ws, "Name a colour.", {"temperature": 0, "max_tokens": 8})
    assert done["finish_reason"] in ("stop", "length")
    history = (await call(server, "GET", f"/v1/sessions/{session}"))[1]["history"]
    assert [m["content"] for m in history] == ["Name a colour.", answer]
    assert await stored(server) == QUOTA - 4_000 + len("Name a colour.") + len(answer) <= QUOTA

    # The OpenAI route's session turns take the same check: 413, and nothing stored.
    before = await snapshot(server)
    body = {"messages": [{"role": "user", "content": "And another?"}], "max_tokens": 256, "temperature": 0}
    status, refused = await call(server, "POST", "/v1/chat/completions", body, headers={"X-Session-Id": session})
    assert refused_for_quota(status, refused), refused
    assert await snapshot(server) == before
    status, completion = await call(server, "POST", "/v1/chat/completions", {**body, "max_tokens": 8},
                                    headers={"X-Session-Id": session})
    assert status == 200, completion
    assert await stored(server) <= QUOTA


async def test_an_edit_is_a_branch_then_a_turn_and_both_are_counted(server) -> None:
    # A session of two exchanges of 1,000 characters, and a tenant 1,600 characters short of its quota.
    source = await imported(server, 2_000, exchanges=2)
    await imported(server, QUOTA - 2_000 - 1_600)
    # Editing the second message: a branch keeping the first exchange (1,000 characters), then the
    # edited message as its turn.
    status, branch = await call(server, "POST", f"/v1/sessions/{source['id']}/branch", {"turns": 1})
    assert status == 201, branch
    async with server.connect() as ws:
        await hello(ws, session_id=branch["id"], resume_token=branch["resume_token"])
        before = await snapshot(server)
        await ws.send(json.dumps({"type": "user", "id": uuid.uuid4().hex, "content": "Name a colour.",
                                  "params": {"temperature": 0, "max_tokens": 8}}))
        frames = await recv_until(ws, "error")  # 600 left: 14 characters and 8 × 81 do not fit
        assert frames[-1]["code"] == "too_large" and "max_stored_chars_per_tenant" in frames[-1]["message"]
        assert await snapshot(server) == before
        answer, done = await turn(ws, "Name a colour.", {"temperature": 0, "max_tokens": 6})  # 500 fits
    assert done["finish_reason"] in ("stop", "length")
    assert await stored(server) == QUOTA - 600 + len("Name a colour.") + len(answer) <= QUOTA
    # A second edit of that message would copy the first exchange again: past the quota now.
    before = await snapshot(server)
    status, answer_ = await call(server, "POST", f"/v1/sessions/{source['id']}/branch", {"turns": 1})
    assert refused_for_quota(status, answer_), answer_
    assert await snapshot(server) == before


async def test_a_system_prompt_counts_against_the_quota(server) -> None:
    await imported(server, QUOTA - 1_000)
    before = await snapshot(server)
    status, answer = await call(server, "POST", "/v1/sessions", {"system_prompt": "s" * 1_001})
    assert refused_for_quota(status, answer), answer
    async with server.connect() as ws:
        await ws.send(json.dumps({"type": "hello", "session_id": None, "resume_token": None, "last_seq": None,
                                  "system_prompt": "s" * 1_001}))
        frame = json.loads(await ws.recv())
        assert frame["type"] == "error" and frame["code"] == "too_large", frame
        assert "max_stored_chars_per_tenant" in frame["message"]
    assert await snapshot(server) == before
    status, made = await call(server, "POST", "/v1/sessions", {"system_prompt": "s" * 1_000})
    assert status == 201, made
    assert await stored(server) == QUOTA


async def test_room_made_by_a_deletion_is_seen_at_once(server) -> None:
    """The quota keeps an upper bound of the stored total between reads (chatcore/sessions/quota.py); a write the
    bound would refuse reads the total again, so a deletion's room is usable at once, not after the bound expires."""
    big = await imported(server, BIG)
    assert refused_for_quota(*await call(server, "POST", f"/v1/sessions/{big['id']}/branch", {"turns": 1}))
    status, _ = await call(server, "DELETE", f"/v1/sessions/{big['id']}")
    assert status in (200, 204)
    again = await imported(server, BIG)
    assert await stored(server) == BIG and again["id"] != big["id"]
