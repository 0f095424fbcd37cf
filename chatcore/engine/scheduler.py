"""Continuous batching under a token budget, with watermarks and preemption by recompute.

Each `schedule()` builds one engine step:
1. Waiting requests older than `max_queue_wait_s` fail with `busy`: no wait is unbounded.
2. Running requests, oldest first: every decoding sequence gets one token (but for rows held
   while their tenant's grammar masks are past its share: chatcore/engine/mask_budget.py), then
   unfinished prefills get chunks from what is left of the token budget. A sequence that needs a block
   when none is available preempts the youngest running request (its blocks are released;
   hashed full blocks stay findable as cached-free, so recompute is mostly prefix hits). If
   it is itself the youngest, it is preempted.
3. If nothing was preempted, waiting requests are admitted in arrival order while the token
   budget, the sequence cap and the low watermark allow. Admission looks up the longest
   cached prefix, so only uncached tokens are computed. A request whose next uncached block
   is being computed right now by a running prefill (many users opening chats on one system
   prompt at once) waits a step or so for it instead of computing it a second time.
A request that could never fit (its prompt and max_tokens over the pool or the context) is
refused in `add`, so a lone running request can always make progress: no deadlock.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from chatcore.engine.errors import QueueFull, RequestRejected
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.request import Request, RequestState, TokenSequence
from chatcore.outcomes import ErrorCode, FinishReason


@dataclass(slots=True)
class ScheduledSeq:
    req: Request
    seq: TokenSequence
    start: int
    num_tokens: int
    slots: list[int]
    copies: list[tuple[int, int]]
    # The sequence's physical blocks, in logical order (`KVCacheManager.block_ids`): the step's block table row.
    block_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """After this chunk the sequence's KV covers all its tokens: its logits are needed."""
        return self.start + self.num_tokens == len(self.seq.tokens)


@dataclass(slots=True)
class StepPlan:
    decode: list[ScheduledSeq] = field(default_factory=list)
    prefill: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(s.num_tokens for s in self.prefill)

    @property
    def copies(self) -> list[tuple[int, int]]:
        return [c for entry in (*self.decode, *self.prefill) for c in entry.copies]

    def drop(self, req: Request) -> int:
        """Remove a preempted request's entries; returns the tokens they had taken."""
        dropped = [e for e in (*self.decode, *self.prefill) if e.req is req]
        self.decode = [e for e in self.decode if e.req is not req]
        self.prefill = [e for e in self.prefill if e.req is not req]
        return sum(e.num_tokens for e in dropped)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, *, max_batch_tokens: int, max_num_seqs: int,
                 max_queue_wait_s: float, max_context: int, max_waiting: int = 1024) -> None:
        """`kv_cache`: the owner of every table the scheduler gives a sequence or takes back."""
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_queue_wait_s = max_queue_wait_s
        self.max_context = max_context
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self._budget = 0

    # ----- admission control -----------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        total = len(req.prompt) + req.params.max_tokens
        if not req.prompt:
            raise RequestRejected("the prompt is empty")
        if total > self.max_context:
            raise RequestRejected(f"prompt ({len(req.prompt)} tokens) + max_tokens ({req.params.max_tokens}) "
                                  f"exceeds the model's context of {self.max_context} tokens")
        self.kv_cache.check_fits(req)

    def add(self, req: Request) -> None:
        self.check_fits(req)
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting")
        req.state = RequestState.WAITING
        req.waiting_since = time.monotonic()
        self.waiting.append(req)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(r.live_seqs) for r in self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- leaving the queues ------------------------------------------------------------------
    def remove(self, req: Request) -> None:
        """Take a request out of the queues (any state); `KVCacheManager.free` releases its tables."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        req.state = RequestState.FINISHED

    def preempt(self, req: Request) -> None:
        """Release a running request's blocks; it waits at the front and recomputes."""
        self.running.remove(req)
        for seq in req.seqs:
            self.kv_cache.free_seq(req, seq)
        if req.params.beam_width > 1:
            # Beams stream nothing until the end: restart the search from the prompt.
            req.seqs = [TokenSequence(0, list(req.prompt), len(req.prompt))]
            req.forked = False
        req.state = RequestState.WAITING
        req.preemptions += 1
        req.waiting_since = time.monotonic()
        self.preemptions += 1
        self.waiting.appendleft(req)

    # ----- one step ----------------------------------------------------------------------------
    def schedule(self, held: frozenset[TokenSequence] = frozenset()) -> StepPlan:
        """The next step. `held`: decode rows to leave out of it (their tenant's grammar masks are over
        its share: chatcore/engine/mask_budget.py), unless nothing else would run."""
        plan = StepPlan()
        now = time.monotonic()
        for req in [r for r in self.waiting if now - r.waiting_since > self.max_queue_wait_s]:
            req.fail(ErrorCode.BUSY, f"no capacity within max_queue_wait_s={self.max_queue_wait_s:g}s",
                     FinishReason.BUSY)
            self.remove(req)
            plan.failed.append(req)

        self._budget = self.max_batch_tokens
        self.running.sort(key=lambda r: r.arrival)
        self._schedule_running(plan, decode=True, held=held)
        self._schedule_running(plan, decode=False)
        if not plan.preempted:
            self._admit(plan)
        if plan.empty and held:  # nobody else to run: the held rows wait for nobody
            self._schedule_running(plan, decode=True)
        return plan

    def _schedule_running(self, plan: StepPlan, decode: bool, held: frozenset[TokenSequence] = frozenset()) -> None:
        index = 0
        while index < len(self.running):
            req = self.running[index]
            entries: list[ScheduledSeq] = []
            for seq in req.live_seqs:
                if not self.kv_cache.has_table(req, seq) or (seq.to_compute == 1) != decode or seq in held:
                    continue
                count = min(seq.to_compute, self._budget)
                if count <= 0:
                    continue
                entry = self._reserve(req, seq, count, plan)
                if entry is None:
                    break
                entries.append(entry)
                self._budget -= count
            if req in self.running:
                (plan.decode if decode else plan.prefill).extend(entries)
                index += 1
            else:
                self._budget += sum(e.num_tokens for e in entries)

    def _reserve(self, req: Request, seq: TokenSequence, count: int, plan: StepPlan) -> ScheduledSeq | None:
        """Slots for the sequence's next `count` tokens. While the pool cannot serve them (the manager's
        `allocate_slots` returns None, the sessions' pins already reclaimed), the youngest running request
        is preempted; None when that was `req` itself."""
        start = seq.num_computed
        while (reserved := self.kv_cache.allocate_slots(req, seq, count)) is None:
            victim = self.running[-1]
            self._budget += plan.drop(victim)
            self.preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return None
        slots, copies = reserved
        return ScheduledSeq(req, seq, start, count, slots, copies, self.kv_cache.block_ids(req, seq))

    def _admit(self, plan: StepPlan) -> None:
        inflight = {h for r in self.running for h in self._inflight(r)}
        deferred: list[Request] = []
        while self.waiting and self._budget > 0:
            req = self.waiting[0]
            seqs = req.live_seqs
            if self.num_running_seqs + len(seqs) > self.max_num_seqs:
                break
            cached_blocks = self.kv_cache.get_computed_blocks(req, seqs)
            if self._next_block_inflight(req, cached_blocks, inflight):
                self.kv_cache.unwind(req)
                deferred.append(self.waiting.popleft())
                continue
            if not self.kv_cache.can_admit(req, alone=not self.running):
                self.kv_cache.unwind(req)
                break
            self.waiting.popleft()
            self.kv_cache.admit(req)
            if req.first_scheduled is None:
                req.first_scheduled = time.monotonic()
                req.cached_tokens = seqs[0].num_computed
            req.state = RequestState.RUNNING
            self.running.append(req)
            if not self._reserve_prefill(req, seqs, plan):
                break
            inflight.update(self._inflight(req))
        self.waiting.extendleft(reversed(deferred))

    def _reserve_prefill(self, req: Request, seqs: list[TokenSequence], plan: StepPlan) -> bool:
        """An admitted request's first chunks; False if the pool could not serve them after all (the
        request went back to waiting: `_reserve`), which `can_admit` rules out."""
        for seq in seqs:
            count = min(seq.to_compute, self._budget)
            if count <= 0:
                continue
            entry = self._reserve(req, seq, count, plan)
            if entry is None:
                return False
            plan.prefill.append(entry)
            self._budget -= count
        return True

    def _inflight(self, req: Request) -> list[bytes]:
        """Hashes of the prompt blocks a running request is computing and has not committed yet."""
        seq = req.seqs[0]
        if seq.finished or not self.kv_cache.has_table(req, seq):
            return []
        return req.prompt_hashes(self.block_size)[seq.num_computed // self.block_size:]

    def _next_block_inflight(self, req: Request, cached_blocks: int, inflight: set[bytes]) -> bool:
        """True if the first block `req` would compute is being computed by a running request.

        Such a request waits: the block is committed at the end of the step that computes it,
        and a later step finds it in the prefix cache, so concurrent first turns on one system
        prompt compute it once. The wait is bounded, since running prefills always progress.
        """
        if not inflight:
            return False
        hashes = req.prompt_hashes(self.block_size)
        reusable = min(len(hashes), (len(req.prompt) - 1) // self.block_size)  # as in `get_computed_blocks`
        return cached_blocks < reusable and hashes[cached_blocks] in inflight
