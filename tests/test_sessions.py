"""Sessions over the real engine and a real SQLite file: history reuse, sharing, scopes, eviction, disk tier."""

from __future__ import annotations

import pytest

from chatcore.config import Settings
from chatcore.engine.commands import Audit, BlockMap, ResetPrefixCache
from chatcore.engine.request import SamplingParams
from chatcore.server.services import Services
from tests.engine_helpers import LONG_SYSTEM

pytestmark = pytest.mark.model
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture
async def make_services(tmp_path, loaded_fp32):
    started: list[Services] = []

    async def factory(**overrides) -> Services:
        settings = Settings(**{"data_dir": tmp_path / f"data{len(started)}", "dtype": "float32", "num_blocks": 256,
                               "debug_audit": True, "kv_disk_gb": 0, **overrides})
        services = await Services.start(settings, loaded_fp32)
        started.append(services)
        return services

    yield factory
    for services in started:
        report = await services.engine.send(Audit())
        assert report.ok, report.format()
        await services.stop()


async def run_turn(services: Services, state, content: str, params: SamplingParams = GREEDY) -> dict:
    frames = await services.turns.start(state, content, params)
    await frames.finished.wait()
    done = frames.done_frame
    assert done is not None
    done["text"] = "".join(f["text"] for f in frames.frames if f["type"] == "token")
    return done


async def test_ten_turns_recompute_only_the_new_tokens(make_services) -> None:
    services = await make_services()
    state, _ = await services.sessions.create(services.local_tenant_id, system_prompt="You are concise.")
    computed = 0
    for i in range(10):
        question = f"Tell me one fact about the number {i + 1}."
        history = len(state.tokens)
        delta = services.sessions.template.next_turn(state.messages, question) if i else None
        done = await run_turn(services, state, question)
        usage = done["usage"]
        # Everything already computed is reused; only the tail of the last answer
        # (its last sampled token and the end-of-turn tokens) and the new turn are computed.
        assert usage["cached_tokens"] == computed, (i, usage)
        assert usage["recomputed_tokens"] == usage["prompt_tokens"] - computed
        if delta is not None:
            assert usage["prompt_tokens"] - history == len(delta.tokens)
            assert history - computed <= 3
        computed = usage["prompt_tokens"] + usage["completion_tokens"] - 1
    assert len(state.tokens) > 300


async def test_same_system_prompt_blocks_are_shared_then_not_under_tenant_scope(make_services) -> None:
    for scope in ("global", "tenant"):
        services = await make_services(cache_scope=scope)
        tenants = []
        async with services.sessionmaker() as db, db.begin():
            from chatcore.store.repos import Repos

            for name in ("alice", "bob"):
                tenants.append((await Repos(db).tenants.get_or_create_tenant(f"{scope}-{name}")).id)
        states = []
        for tenant in tenants:
            state, _ = await services.sessions.create(tenant, system_prompt=LONG_SYSTEM)
            await run_turn(services, state, "Hello, who are you?")
            states.append(state)
        bs = services.settings.block_size
        system_blocks = len(services.sessions.template.first_turn(LONG_SYSTEM, "x")) // bs - 1

        # each session's blocks in table order, as the operators' block map gives them: its pin's
        mapped = {s["id"]: s["blocks"] for s in (await services.engine.send(BlockMap({})))["sessions"]}
        a_blocks, b_blocks = (mapped[s.id][:system_blocks] for s in states)
        report = await services.engine.send(Audit())
        assert report.ok
        if scope == "global":
            assert a_blocks == b_blocks and all(report.refs[b] == 2 for b in a_blocks)
        else:
            assert not set(a_blocks) & set(b_blocks)
            assert all(report.refs[b] == 1 for b in a_blocks + b_blocks)


async def test_cold_and_back_answers_like_a_session_that_stayed(make_services) -> None:
    services = await make_services(hot_window_s=0)
    tenant = services.local_tenant_id
    questions = ["Name a large animal.", "Where does it live?", "What does it eat?"]
    stayed, _ = await services.sessions.create(tenant)
    left, _ = await services.sessions.create(tenant)
    for q in questions[:2]:
        await run_turn(services, stayed, q)
        await run_turn(services, left, q)
    await services.sessions.go_cold(left)
    assert left.id not in services.sessions.live
    await services.engine.send(ResetPrefixCache())  # nothing of it left in the pool
    reopened = await services.sessions.open(tenant, left.id)
    assert reopened is not left and reopened.tokens == left.tokens
    back = await run_turn(services, reopened, questions[2])
    same = await run_turn(services, stayed, questions[2])
    assert back["text"] == same["text"]
    assert back["usage"]["cached_tokens"] == 0 and same["usage"]["cached_tokens"] > 0


async def one_turn_then_only_on_disk(make_services):
    """A session with one turn, gone cold, whose blocks are on disk and no longer in the pool."""
    services = await make_services(kv_disk_gb=1, hot_window_s=0)
    state, _ = await services.sessions.create(services.local_tenant_id, system_prompt=LONG_SYSTEM)
    await run_turn(services, state, "Can I change my booking?")
    await services.residency.background_idle()
    await services.sessions.go_cold(state)
    await services.engine.send(ResetPrefixCache())
    return services, state


async def test_disk_tier_serves_a_cold_session_and_rejects_bad_files(make_services, tmp_path) -> None:
    services, state = await one_turn_then_only_on_disk(make_services)
    tenant = services.local_tenant_id
    files = sorted((services.settings.resolved_kv_disk_dir).rglob("*.kvb"))
    assert len(files) >= len(state.tokens) // services.settings.block_size - 1

    reopened = await services.sessions.open(tenant, state.id)
    done = await run_turn(services, reopened, "And how much does it cost?")
    assert done["usage"]["cached_disk_tokens"] > 0
    assert done["usage"]["cached_tokens"] == done["usage"]["cached_disk_tokens"]

    # Round 2: a bit flip in block 1's file; round 3: block 2's file written for another model.
    from chatcore.cache import chain_hashes
    from chatcore.kv.disk import DiskBlocks

    bs = services.settings.block_size
    salt = services.engine.salt(reopened.scope_key)
    for round_, (index, damage) in enumerate([(1, "bitflip"), (2, "foreign")]):
        await services.residency.background_idle()
        await services.sessions.go_cold(reopened)
        await services.engine.send(ResetPrefixCache())
        chain = chain_hashes(reopened.tokens, bs, salt)
        path = services.disk.files.path_for(chain[index])
        if damage == "bitflip":
            data = bytearray(path.read_bytes())
            data[-10] ^= 0x40
            path.write_bytes(bytes(data))
        else:
            good = services.disk.files.read(chain[index])
            DiskBlocks(services.settings.resolved_kv_disk_dir, "another-model").write(chain[index], good)
        rejected = services.disk.rejected
        reopened = await services.sessions.open(tenant, state.id)
        done = await run_turn(services, reopened, f"Thanks, question {round_}.")
        usage = done["usage"]
        assert usage["cached_disk_tokens"] == index * bs, usage  # the chain is cut at the bad file
        assert usage["recomputed_tokens"] == usage["prompt_tokens"] - index * bs
        assert services.disk.rejected == rejected + 1
        assert done["finish_reason"] in ("stop", "length") and done["text"]


async def test_a_template_that_is_not_prefix_stable_falls_back_to_the_hash_match(make_services, loaded_fp32) -> None:
    import copy
    import dataclasses

    tokenizer = copy.deepcopy(loaded_fp32.tokenizer)
    # A real template whose header changes with the conversation's length: not prefix-stable.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "<|im_start|>system\nturns so far: {{ messages|length }}<|im_end|>\n"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    services = await make_services(hot_window_s=0)
    loaded = dataclasses.replace(loaded_fp32, tokenizer=tokenizer)
    from chatcore.sessions.template import ChatTemplate

    template = ChatTemplate(loaded.tokenizer, loaded.stop_token_ids)
    assert not template.prefix_stable
    services.sessions.template = template
    state, _ = await services.sessions.create(services.local_tenant_id, system_prompt=LONG_SYSTEM)
    first = await run_turn(services, state, "Hello there.")
    second = await run_turn(services, state, "Tell me about refunds.")
    assert first["finish_reason"] in ("stop", "length") and second["finish_reason"] in ("stop", "length")
    # The re-rendered prompt still starts with the system turn and the first exchange's
    # full blocks, found by their content hashes.
    bs = services.settings.block_size
    assert second["usage"]["cached_tokens"] >= (len(template.render(state.messages[:1], False)) // bs) * bs > 0
