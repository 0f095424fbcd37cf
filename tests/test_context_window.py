"""Conversations that outlive the context window: the context policy (`truncate` or `reject`)."""

from __future__ import annotations

import json

import pytest

from chatcore.config import Settings
from chatcore.sessions.template import ChatTemplate
from chatcore.sessions.window import next_prompt, view
from tests.inprocess_server import serve
from tests.server_helpers import hello, recv_until, turn

SYSTEM = "You are a terse assistant who answers in one short sentence."
TOPICS = ["rivers", "mountains", "bread", "violins", "comets", "glaciers", "owls", "trains", "tea", "maps"]


def message(i: int) -> str:
    topic = TOPICS[i % len(TOPICS)]
    return f"Question {i}: tell me one fact about {topic}, and say why {topic} matter to people who travel."


def conversation(exchanges: int) -> list[dict[str, str]]:
    out = [{"role": "system", "content": SYSTEM}]
    for i in range(exchanges):
        out += [{"role": "user", "content": message(i)},
                {"role": "assistant", "content": f"Answer {i}: {TOPICS[i % len(TOPICS)]} are old and useful."}]
    return out


@pytest.fixture(scope="module")
def template(loaded_fp32) -> ChatTemplate:
    return ChatTemplate(loaded_fp32.tokenizer, loaded_fp32.stop_token_ids)


def test_truncate_drops_the_fewest_whole_exchanges_that_reach_the_low_water_mark(template) -> None:
    messages = conversation(12)
    tokens = template.render(messages, generation_prompt=False)
    context, max_tokens = len(tokens) + 20, 40
    window = next_prompt(template, tokens, messages, 0, SYSTEM, message(12), max_tokens=max_tokens,
                         context=context, policy="truncate", low_water=0.5)
    start = window.window_start
    assert 0 < start < 12
    user = {"role": "user", "content": message(12)}
    assert window.prompt == template.render([*view(messages, start), user], generation_prompt=True)
    system = template.render(messages[:1], generation_prompt=False)
    assert window.prompt[: len(system)] == system == tokens[: len(system)]  # the system prompt stays
    assert len(window.prompt) <= context // 2 and len(window.prompt) + max_tokens <= context
    one_fewer = template.render([*view(messages, start - 1), user], generation_prompt=True)
    assert len(one_fewer) > context // 2  # not one exchange more than needed
    assert not window.use_pin
    head = template.render(view(messages, start), generation_prompt=False)
    assert window.prompt[len(window.prompt) - window.added:] == window.prompt[len(head):]


def test_a_turn_that_fits_extends_the_cached_history_and_reject_never_truncates(template) -> None:
    messages = conversation(6)
    tokens = template.render(messages, generation_prompt=False)
    fits = next_prompt(template, tokens, messages, 2, SYSTEM, "And?", max_tokens=8, context=len(tokens) + 64,
                       policy="truncate", low_water=0.5)
    assert fits.use_pin and fits.window_start == 2 and fits.prompt[: len(tokens)] == tokens
    rejected = next_prompt(template, tokens, messages, 2, SYSTEM, "And?", max_tokens=64, context=len(tokens),
                           policy="reject", low_water=0.5)
    assert rejected.window_start == 2 and rejected.prompt[: len(tokens)] == tokens  # the caller refuses it


def test_a_message_too_large_on_its_own_drops_every_exchange_and_still_overflows(template) -> None:
    messages = conversation(3)
    tokens = template.render(messages, generation_prompt=False)
    huge = " ".join(message(i) for i in range(20))
    window = next_prompt(template, tokens, messages, 0, SYSTEM, huge, max_tokens=8, context=200,
                         policy="truncate", low_water=0.5)
    assert window.window_start == 3
    assert len(window.prompt) + 8 > 200


@pytest.mark.model
async def test_a_long_chat_truncates_rarely_caches_its_new_window_and_keeps_everything(tmp_path, loaded_fp32,
                                                                                       template) -> None:
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=256, kv_disk_gb=0, max_context=384)
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    async with serve(settings, loaded_fp32) as server:
        async with server.connect() as ws:
            session = await hello(ws, system_prompt=SYSTEM)
            dones, starts = [], []
            for i in range(14):
                await ws.send(json.dumps({"type": "user", "id": f"m{i}", "content": message(i), "params": params}))
                frames = await recv_until(ws, "done")
                starts.append(next(f for f in frames if f["type"] == "start"))
                dones.append(frames[-1])
                assert dones[-1]["finish_reason"] == "length", frames
            truncated = [d["usage"]["truncated_turns"] for d in dones]
            assert [s["truncated_turns"] for s in starts] == truncated
            jumps = [i for i in range(1, len(truncated)) if truncated[i] != truncated[i - 1]]
            assert jumps, truncated
            system_tokens = len(template.first_turn(SYSTEM, "x"))
            for i in jumps:
                usage = dones[i]["usage"]
                assert truncated[i] > truncated[i - 1]
                assert usage["prompt_tokens"] <= 384 // 2
                assert usage["cached_tokens"] <= system_tokens  # the new window computes once
                if i + 1 < len(dones) and i + 1 not in jumps:  # the next turn reuses this turn's blocks
                    after = dones[i + 1]["usage"]
                    assert after["cached_tokens"] >= usage["prompt_tokens"] + usage["completion_tokens"] - 1
            # A window jumps rarely: most turns extend the cached history.
            assert len(jumps) <= len(dones) // 3
            for i in range(1, len(dones)):
                if i not in jumps:
                    assert dones[i]["usage"]["cached_tokens"] >= dones[i - 1]["usage"]["prompt_tokens"]
        manager = server.services.sessions
        state = manager.live[session["session_id"]]
        await manager.go_cold(state)
        async with server.connect() as ws:
            resumed = await hello(ws, session_id=session["session_id"], resume_token=session["resume_token"])
            assert resumed["truncated_turns"] == truncated[-1]
            assert [m["content"] for m in resumed["history"] if m["role"] == "user"] == [message(i) for i in range(14)]
            _, done = await turn(ws, message(14), params)
            assert done["finish_reason"] == "length"
            assert done["usage"]["truncated_turns"] >= truncated[-1]
        detail = await manager.detail(state.tenant_id, session["session_id"])
        assert len(detail["history"]) == 30 and detail["truncated_turns"] == done["usage"]["truncated_turns"]


@pytest.mark.model
async def test_reject_refuses_the_overflowing_turn_and_an_unset_max_tokens_takes_what_remains(tmp_path,
                                                                                              loaded_fp32) -> None:
    settings = Settings(data_dir=tmp_path, dtype="float32", num_blocks=128, kv_disk_gb=0, max_context=256,
                        context_policy="reject")
    long_message = " ".join(message(i) for i in range(5))
    async with serve(settings, loaded_fp32) as server, server.connect() as ws:
        session = await hello(ws, system_prompt=SYSTEM)
        _, done = await turn(ws, long_message, {"temperature": 0, "ignore_eos": True})
        usage = done["usage"]
        assert 128 < usage["prompt_tokens"] < 256
        assert usage["completion_tokens"] == 256 - usage["prompt_tokens"]  # not the default 256
        await ws.send(json.dumps({"type": "user", "id": "next", "content": "And then?",
                                  "params": {"temperature": 0, "max_tokens": 4}}))
        error = json.loads(await ws.recv())
        assert error["type"] == "error" and error["code"] == "too_large", error
        detail = await server.services.sessions.detail(server.services.sessions.live[session["session_id"]].tenant_id,
                                                       session["session_id"])
        assert [m["role"] for m in detail["history"]] == ["user", "assistant"] and detail["truncated_turns"] == 0

