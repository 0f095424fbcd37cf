"""Branching a session (regenerate, edit and resend): a new session with the first exchanges of another,
whose next turn reuses the original's cached blocks."""

from __future__ import annotations

import pytest

from chatcore.config import Settings
from tests.inprocess_server import serve
from tests.server_helpers import hello, turn

pytestmark = pytest.mark.model
SYSTEM = "You are a concise geography tutor. Answer in one sentence."
PARAMS = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
QUESTIONS = ["What is the capital of France?", "And of Italy?", "And of Spain?"]


async def post(server, path: str, body: object) -> tuple[int, dict]:
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
        response = await http.post(path, json=body)
    return response.status_code, response.json()


async def test_a_branch_keeps_the_first_exchanges_and_reuses_their_blocks(tmp_path, loaded_fp32) -> None:
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=256, kv_disk_gb=0)
    async with serve(settings, loaded_fp32) as server:
        async with server.connect() as ws:
            source = await hello(ws, system_prompt=SYSTEM, title="capitals")
            dones = [(await turn(ws, q, PARAMS))[1] for q in QUESTIONS[:2]]
        status, made = await post(server, f"/v1/sessions/{source['session_id']}/branch", {"turns": 1})
        assert status == 201 and made["title"] == "capitals (branch)" and made["system_prompt"] == SYSTEM
        first_history = dones[0]["usage"]["prompt_tokens"] + dones[0]["usage"]["completion_tokens"]
        assert made["history_tokens"] >= first_history  # the first exchange's own tokens, end of turn included
        async with server.connect() as ws:
            branched = await hello(ws, session_id=made["id"], resume_token=made["resume_token"])
            assert [m["content"] for m in branched["history"] if m["role"] == "user"] == QUESTIONS[:1]
            _, done = await turn(ws, "And of Germany?", PARAMS)  # an edited second message
        usage = done["usage"]
        assert usage["cached_tokens"] >= made["history_tokens"] // 16 * 16 > 0  # the original's blocks, by hash
        assert usage["recomputed_tokens"] < 32
        manager = server.services.sessions
        original = await manager.detail(branched_tenant(server, source), source["session_id"])
        assert [m["content"] for m in original["history"] if m["role"] == "user"] == QUESTIONS[:2]  # untouched
        status, regenerate = await post(server, f"/v1/sessions/{source['session_id']}/branch", {"turns": 0})
        assert status == 201 and regenerate["history_tokens"] == 0
        async with server.connect() as ws:
            await hello(ws, session_id=regenerate["id"], resume_token=regenerate["resume_token"])
            _, again = await turn(ws, QUESTIONS[0], PARAMS)  # the first question, regenerated
        assert again["usage"]["cached_tokens"] >= dones[0]["usage"]["prompt_tokens"] // 16 * 16


@pytest.mark.parametrize("body", [{"turns": 3}, {"turns": -1}, {"turns": "1"}, {"turns": True}, {}, {"turns": 1, "x": 2}])
async def test_a_branch_point_outside_the_exchanges_is_refused(tmp_path, loaded_fp32, body) -> None:
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=128, kv_disk_gb=0)
    async with serve(settings, loaded_fp32) as server:
        async with server.connect() as ws:
            source = await hello(ws)
            await turn(ws, QUESTIONS[0], PARAMS)
            await turn(ws, QUESTIONS[1], PARAMS)
        status, error = await post(server, f"/v1/sessions/{source['session_id']}/branch", body)
        assert status == 400 and error["error"]["code"] == "bad_request"
        assert len(await server.services.sessions.list(branched_tenant(server, source))) == 1  # nothing made


def branched_tenant(server, session: dict) -> str:
    return server.services.sessions.live[session["session_id"]].tenant_id
