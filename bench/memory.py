"""Suite 4, memory: KV waste and how many sessions a fixed KV budget holds, from the trace.

Three schemes, all with the real bookkeeping (`BlockPool`, tables through the KV cache manager:
`bench/bookkeeping.py`) where they page:
* chatcore: paged and shared. A session's first turn looks up its system prompt's blocks
  (shared with every session that uses the same prompt); later turns extend the session's
  own table (as a hot session's pinned chain does).
* paged, no sharing: the same, but every session has its own cache salt, so nothing is shared.
* static: contiguous preallocation at the maximum length, one region per session. The maximum
  is the longest conversation in the trace (the most favourable choice for this baseline; the
  model's 8,192-token context would be worse, and is reported too).

Waste = reserved slots not holding a token / reserved slots. It is averaged over every turn
event of the trace replayed in time order, with every session holding its history from its
first turn until its last answer ends (the live set of a server that keeps active sessions'
KV), and also taken at the peak of the live set.

Sessions held: sessions, each at its final (longest) history, are admitted in trace order into
a fixed budget of token slots until the next one does not fit.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch

from chatcore.bench.common import Context, reported, target
from chatcore.bench.workload import Trace, TraceConfig, generate
from chatcore.bench.bookkeeping import Bookkeeping
from chatcore.cache import BlockPool, cache_salt
from chatcore.cache.errors import NoFreeBlocks
from chatcore.engine.request import Request
from chatcore.kv.tensors import KVTensors

MODEL_CONTEXT = 8192


class PagedScheme:
    """Sessions' tables in one pool; `shared` decides whether system prompts are found and shared."""

    def __init__(self, num_blocks: int, block_size: int, shared: bool) -> None:
        self.pool = BlockPool(num_blocks, block_size, low_watermark=0.0, high_watermark=0.0)
        self.books = Bookkeeping(self.pool)
        self.bs = block_size
        self.shared = shared
        self.requests: dict[int, Request] = {}  # each session's table, held as one request's
        self.lengths: dict[int, int] = {}

    def salt(self, session: int) -> bytes:
        return cache_salt("bench-trace", self.bs, "bfloat16", "global" if self.shared else f"session-{session}")

    def extend(self, session: int, tokens: list[int]) -> None:
        """The session's history becomes `tokens` (it only ever grows)."""
        req = self.requests.get(session)
        if req is None:
            req, _ = self.books.open(f"session-{session}", tokens, self.salt(session))
        try:
            self.books.extend(req, tokens, len(tokens))
        except NoFreeBlocks:
            if session not in self.requests:
                self.books.close(req)
            raise
        self.requests[session] = req
        self.lengths[session] = len(tokens)

    def drop(self, session: int) -> None:
        self.books.close(self.requests.pop(session))
        self.lengths.pop(session)

    def usage(self) -> tuple[int, int]:
        """(reserved slots, slots holding a token): every block in use, counted once."""
        used = self.pool.num_used
        empty = sum((-length) % self.bs for length in self.lengths.values())  # each table holds its history
        return used * self.bs, used * self.bs - empty


def live_waste(trace: Trace, block_size: int, max_len: int) -> dict[str, Any]:
    """Replay the trace with sessions holding their history while active; waste per scheme."""
    cfg = trace.config
    schemes = {"chatcore": PagedScheme(10**5, block_size, True), "paged_no_sharing": PagedScheme(10**5, block_size, False)}
    sums = {name: [0, 0] for name in (*schemes, "static")}
    peak: dict[str, Any] = {"sessions": 0}
    ends: list[tuple[float, int]] = []
    last_turn = {s.index: len(s.turns) - 1 for s in trace.sessions}
    samples = 0
    for event in trace.events():
        while ends and ends[0][0] <= event.at:
            _, session = heapq.heappop(ends)
            for scheme in schemes.values():
                scheme.drop(session)
        history = trace.history(event.session, event.turn + 1)
        for scheme in schemes.values():
            scheme.extend(event.session, history)
        if event.turn == last_turn[event.session]:
            answer = len(trace.sessions[event.session].turns[event.turn].answer)
            heapq.heappush(ends, (event.at + answer / cfg.decode_tok_per_s, event.session))
        samples += 1
        lengths = schemes["chatcore"].lengths
        usage = {name: s.usage() for name, s in schemes.items()}
        usage["static"] = (len(lengths) * max_len, sum(lengths.values()))
        for name, (reserved, filled) in usage.items():
            sums[name][0] += reserved
            sums[name][1] += filled
        if len(lengths) > peak["sessions"]:
            peak = {"sessions": len(lengths), "at_s": event.at,
                    **{name: {"reserved": r, "filled": f, "waste_pct": 100 * (1 - f / r)} for name, (r, f) in usage.items()}}
    out = {name: {"waste_pct": 100 * (1 - filled / reserved)} for name, (reserved, filled) in sums.items()}
    return {"time_averaged": out, "peak": peak, "samples": samples}


def sessions_held(trace: Trace, block_size: int, budget_tokens: int, max_len: int) -> dict[str, int]:
    held: dict[str, int] = {}
    for name, shared in (("chatcore", True), ("paged_no_sharing", False)):
        scheme = PagedScheme(budget_tokens // block_size, block_size, shared)
        count = 0
        for session in trace.sessions:
            try:
                scheme.extend(session.index, trace.history(session.index, len(session.turns)))
            except NoFreeBlocks:
                break
            count += 1
        held[name] = count
    held["static"] = budget_tokens // max_len
    held["static_at_model_context"] = budget_tokens // MODEL_CONTEXT
    return held


def run(ctx: Context) -> dict[str, Any]:
    cfg = TraceConfig(num_sessions=30) if ctx.tiny else TraceConfig(num_sessions=150 if ctx.quick else 200)
    trace = generate(cfg)
    bs = ctx.settings.block_size
    max_len = max(trace.final_length(s.index) for s in trace.sessions)
    # The budget: a 1 GiB KV pool of the loaded model in bf16 (SmolLM2-135M: 23,040 bytes per token).
    loaded = ctx.loaded
    bytes_per_token = KVTensors.bytes_per_block(loaded.num_layers, 1, loaded.num_kv_heads, loaded.head_dim,
                                                torch.bfloat16)
    budget = (1 << 30) // bytes_per_token
    waste = live_waste(trace, bs, max_len)
    held = sessions_held(trace, bs, budget, max_len)
    schemes = {name: {"waste_pct": waste["time_averaged"][name]["waste_pct"],
                      "peak_waste_pct": waste["peak"][name]["waste_pct"], "sessions_held": held[name]}
               for name in ("chatcore", "paged_no_sharing", "static")}
    ours = schemes["chatcore"]
    sweep = []
    for size in (8, 16, 32, 64):
        w = live_waste(trace, size, max_len)["time_averaged"]
        sweep.append({"block_size": size, "chatcore_waste_pct": w["chatcore"]["waste_pct"],
                      "sessions_held": sessions_held(trace, size, budget, max_len)["chatcore"]})
    ctx.log(f"  waste: chatcore {ours['waste_pct']:.2f}%, no sharing {schemes['paged_no_sharing']['waste_pct']:.2f}%, "
            f"static {schemes['static']['waste_pct']:.1f}%; sessions in {budget:,} slots: "
            f"{held['chatcore']} / {held['paged_no_sharing']} / {held['static']}")
    return {
        "trace": trace.summary(), "block_size": bs, "max_len": max_len, "budget_tokens": budget,
        "budget_note": f"1 GiB of bf16 KV for {loaded.path.name} ({loaded.num_layers} layers x 2 x {loaded.num_kv_heads} "
                       f"KV heads x {loaded.head_dim} x 2 bytes = {bytes_per_token:,} B/token)",
        "schemes": schemes, "peak": waste["peak"], "sessions_held": held, "block_size_sweep": sweep,
        "sharing_saving_pct": 100 * (1 - waste["peak"]["chatcore"]["reserved"] / waste["peak"]["paged_no_sharing"]["reserved"]),
        "targets": [
            reported("KV waste, % (chatcore, time-averaged; a sanity check: paging leaves under a block per sequence)",
                     ours["waste_pct"], f"paged no sharing {schemes['paged_no_sharing']['waste_pct']:.2f}%, static {schemes['static']['waste_pct']:.1f}%"),
            target("sessions held >= 3x static preallocation", held["chatcore"] / max(1, held["static"]), ">=", 3.0,
                   f"{held['chatcore']} sessions vs static preallocation at the trace's longest conversation "
                   f"({max_len} tokens): {held['static']}, in {budget:,} token slots; a deterministic replay "
                   "(no repeats: there is no timing to move)"),
        ],
    }
