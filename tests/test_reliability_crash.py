"""Crash safety (issue 9, item 4).

Rounds of traffic, each ended by a SIGKILL at a random (seeded) moment, then a restart on the same data
directory. After every crash the database passes `PRAGMA integrity_check`, and after every restart each
turn a client was acknowledged with `done` is in the history exactly as it was streamed. Between some
rounds, disk-tier block files are truncated or have a bit flipped: the restarted server must refuse them
(`chatcore_disk_blocks_rejected_total`), read back exactly the intact blocks before them, recompute the
rest, and still answer in full.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import websockets

from tests.reliability_helpers import (
    GREEDY,
    QUESTIONS,
    Chat,
    cache,
    history,
    metrics,
    private_system,
    report,
    sizes,
    wait_idle,
)
from tests.server_helpers import start_server

pytestmark = pytest.mark.model
SEED = 4242
BLOCK = 16
HASH_BYTES = 16


@dataclass(frozen=True)
class Crash:
    rounds: int
    clients: int
    corrupt_every: int  # inject disk-tier corruption after every n-th crash
    corrupt_files: int  # files per injection


@dataclass
class Ledger:
    """What clients were told: every `done`, and the sessions each client owns."""
    acked: dict[tuple[str, int], tuple[str, str]] = field(default_factory=dict)
    owned: dict[int, list[tuple[str, str]]] = field(default_factory=dict)
    created: int = 0
    turn_done: asyncio.Event = field(default_factory=asyncio.Event)  # set by every acknowledged turn


@dataclass
class Injection:
    session_id: str
    resume_token: str
    position: int  # the chain's block index whose file was damaged
    path: Path
    kind: str
    damaged: bytes


async def client_loop(server, index: int, rng: random.Random, ledger: Ledger) -> None:
    """Turns on this client's sessions (old ones resumed, new ones created) until the server dies."""
    owned = ledger.owned.setdefault(index, [])
    try:
        while True:
            chat = Chat(server)
            if owned and rng.random() < 0.6:
                chat.session_id, chat.resume_token = rng.choice(owned)
                await chat.hello(resume=True)
            else:
                ledger.created += 1
                await chat.hello(system_prompt=private_system(f"crash-{index}-{ledger.created}"))
                owned.append((chat.session_id, chat.resume_token))
            for _ in range(rng.randint(1, 3)):
                question = rng.choice(QUESTIONS)
                turn = await chat.turn(question, {**GREEDY, "max_tokens": rng.choice([8, 16, 24])}, timeout=300)
                if turn.done is None:
                    break
                ledger.acked[(chat.session_id, turn.done["turn"])] = (turn.text, turn.done["finish_reason"])
                ledger.turn_done.set()
            await chat.close()
    except (websockets.ConnectionClosed, OSError, TimeoutError):
        return  # the server was killed under us


def verify_acked(server, ledger: Ledger) -> int:
    """Every acknowledged turn is in its session's history as streamed; no turn is left open."""
    by_session: dict[str, list[dict]] = {}
    for (session_id, exchange), (text, reason) in ledger.acked.items():
        if session_id not in by_session:
            by_session[session_id] = history(server, session_id)
            assert all(m["finish_reason"] is not None for m in by_session[session_id] if m["role"] == "assistant")
        answer = by_session[session_id][2 * exchange + 1]
        assert answer["role"] == "assistant" and answer["content"] == text, (session_id, exchange, answer, text)
        assert answer["finish_reason"] == reason
    return len(ledger.acked)


def integrity(db_path: Path) -> None:
    with sqlite3.connect(db_path) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []


def inject_corruption(data: Path, ledger: Ledger, rng: random.Random, count: int) -> list[Injection]:
    """Damage one block file in each of `count` sessions whose chain has an intact, indexed run before it."""
    tokens = {sid: token for owned in ledger.owned.values() for sid, token in owned}
    with sqlite3.connect(data / "chatcore.db") as db:
        indexed = {row[0] for row in db.execute("SELECT hash FROM kv_blocks")}
        chains = db.execute("SELECT session_id, block_hashes FROM session_chains").fetchall()
    candidates = []
    for session_id, packed in sorted(chains):
        hashes = [packed[i:i + HASH_BYTES].hex() for i in range(0, len(packed), HASH_BYTES)]
        run = 0
        while run < len(hashes) and hashes[run] in indexed and (data / "kv" / hashes[run][:2] /
                                                                  f"{hashes[run]}.kvb").is_file():
            run += 1
        if run >= 2 and session_id in tokens:
            candidates.append((session_id, hashes, run))
    injections = []
    for session_id, hashes, run in rng.sample(candidates, min(count, len(candidates))):
        position = rng.randint(1, run - 1)  # blocks before it stay intact
        path = data / "kv" / hashes[position][:2] / f"{hashes[position]}.kvb"
        raw = bytearray(path.read_bytes())
        kind = rng.choice(["truncate", "bitflip"])
        if kind == "truncate":
            raw = raw[:rng.randrange(len(raw))]
        else:
            bit = rng.randrange(len(raw) * 8)
            raw[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(bytes(raw))
        injections.append(Injection(session_id, tokens[session_id], position, path, kind, bytes(raw)))
    return injections


async def check_injections(server, injections: list[Injection], ledger: Ledger) -> None:
    """First thing after a restart (the pool is empty): resume each damaged session for one turn."""
    if not injections:
        return
    before = metrics(server).get("chatcore_disk_blocks_rejected_total", 0.0)
    for inj in injections:
        chat = Chat(server)
        chat.session_id, chat.resume_token = inj.session_id, inj.resume_token
        await chat.hello(resume=True)
        turn = await chat.turn("One more thing, please.", {**GREEDY, "max_tokens": 8}, timeout=300)
        await chat.close()
        assert turn.done is not None and turn.done["finish_reason"] in ("stop", "length"), turn.frames
        ledger.acked[(inj.session_id, turn.done["turn"])] = (turn.text, turn.done["finish_reason"])
        usage = turn.done["usage"]
        # Exactly the intact blocks before the damaged one came from disk; the damaged one and the rest
        # were recomputed.
        assert usage["cached_disk_tokens"] == inj.position * BLOCK, (inj.kind, inj.position, usage)
        assert usage["cached_device_tokens"] == 0, usage
        assert not inj.path.is_file() or inj.path.read_bytes() != inj.damaged  # deleted (or rewritten whole)
    rejected = metrics(server).get("chatcore_disk_blocks_rejected_total", 0.0) - before
    assert rejected == len(injections), (rejected, [(i.kind, i.position) for i in injections])


@pytest.mark.parametrize("crash", sizes(Crash(rounds=3, clients=4, corrupt_every=1, corrupt_files=2),
                                        Crash(rounds=20, clients=6, corrupt_every=3, corrupt_files=3)))
async def test_sigkill_rounds(tmp_path, capsys, crash: Crash) -> None:
    data = tmp_path / "data"
    rng = random.Random(SEED)
    ledger = Ledger()
    injections: list[Injection] = []
    figures = {"rounds": crash.rounds, "SIGKILLs": 0, "kill delays s": [], "turns acknowledged": 0,
               "turns interrupted by a kill": 0, "block files truncated": 0, "block files bit-flipped": 0,
               "corrupt files used": 0}
    started = time.monotonic()
    server = None
    try:
        for round_no in range(crash.rounds + 1):
            server = start_server(data, hot_window_s=1, disconnect_grace_s=5,
                                  max_turns_per_tenant=crash.clients + 2, max_queue_wait_s=600)
            await check_injections(server, injections, ledger)
            verify_acked(server, ledger)
            if round_no == crash.rounds:
                break  # the last restart stays up for the final checks
            tasks = [asyncio.create_task(client_loop(server, i, random.Random(rng.random()), ledger))
                     for i in range(crash.clients)]
            # The fault: a SIGKILL at a random moment of the traffic, once this round has finished a
            # turn (a loaded machine may take longer than the delay to finish the first), so that
            # every round leaves history on disk for the corruption to hit.
            ledger.turn_done.clear()
            await asyncio.wait_for(ledger.turn_done.wait(), timeout=300)
            delay = rng.uniform(1.0, 5.0)
            await asyncio.sleep(delay)
            figures["kill delays s"].append(round(delay, 2))
            server.stop(signal.SIGKILL)
            figures["SIGKILLs"] += 1
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
            integrity(data / "chatcore.db")
            injections = []
            if round_no % crash.corrupt_every == 0:
                injections = inject_corruption(data, ledger, rng, crash.corrupt_files)
                for inj in injections:
                    figures["block files truncated" if inj.kind == "truncate" else "block files bit-flipped"] += 1
        # The last restart: no leaked blocks, and the audit holds.
        assert figures["block files truncated"] + figures["block files bit-flipped"] > 0
        idle = await wait_idle(server, deadline_s=120)
        with sqlite3.connect(data / "chatcore.db") as db:
            interrupted = db.execute("SELECT count(*) FROM turns WHERE finish_reason = 'interrupted'").fetchone()[0]
        final = cache(server)["audit"]
        figures.update({
            "turns acknowledged": len(ledger.acked),
            "turns interrupted by a kill": interrupted,
            "sessions": sum(len(v) for v in ledger.owned.values()),
            "integrity_check": "ok after every crash",
            "acknowledged turns lost": 0,
            "wall s": time.monotonic() - started,
            "final audit": f"ok={final['ok']} used={final['used']}",
            "blocks leaked": idle["audit"]["used"],
        })
        figures["kill delays s"] = f"{min(figures['kill delays s'])}..{max(figures['kill delays s'])}"
        report(capsys, f"crash safety [{crash.rounds} SIGKILL rounds]", figures)
    finally:
        if server is not None:
            server.stop(signal.SIGKILL)
