"""Continuous batching under a token budget, shared fairly between tenants, with watermarks and
preemption by recompute.

Each `schedule()` builds one engine step, under the tenants' shares of it (chatcore/engine/fair_share.py:
slots and tokens split evenly between the tenants with work):
1. A waiting request fails with `busy` once it has waited `max_queue_wait_s` for its own tenant's
   work: time in which the engine served another tenant does not count (the clock is paused), so
   nothing is refused for capacity while the engine makes progress for other tenants, and a tenant's
   wait behind its own work stays bounded.
2. When a tenant waits and its next request does not fit the sequence slots, the newest requests of
   the tenant furthest over its slot share are preempted until it fits (recompute), never a tenant's
   only request.
3. Running requests, the tenants interleaved, each tenant within its share of the step's tokens: every
   decoding sequence gets one token (but for rows held while their tenant's grammar masks are past its
   share: chatcore/engine/mask_budget.py; and rows past their tenant's share of the tokens, which wait,
   the rows furthest behind running first so that they take turns; a beam search's rows run all or
   none), then unfinished prefills get chunks: a long prompt is chunked across steps with other
   tenants' chunks and decode rows between. A sequence that needs a block when none is available
   preempts the newest request of the tenant holding the most slots (its blocks are released; hashed
   full blocks stay findable as cached-free, so recompute is mostly prefix hits). If that is itself,
   it is preempted.
4. If nothing was preempted for blocks, waiting requests are admitted, the tenant holding the fewest
   slots first, each tenant's in its own order, while the token budget (and the tenant's share of
   it), the sequence cap and the low watermark allow; a tenant takes more than its slot share only
   while no other tenant waits, or with its first request. When the least served tenant's request
   does not fit the free slots, nobody is admitted before it, so a large request never starves.
   Admission looks up the longest cached prefix, so only uncached tokens are computed. A request
   whose next uncached block is being computed right now by a running prefill (many users opening
   chats on one system prompt at once) waits a step or so for it instead of computing it twice.
A request that could never fit (its prompt and max_tokens over the pool or the context) is
refused in `add`, so a lone running request can always make progress: no deadlock.
"""

from __future__ import annotations

import time
from collections import Counter, deque

from chatcore.engine import fair_share
from chatcore.engine.errors import QueueFull
from chatcore.engine.fits import check_fits
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.request import Request, RequestState, TokenSequence
from chatcore.engine.step_types import ScheduledSeq, StepPlan
from chatcore.outcomes import ErrorCode, FinishReason


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
        self._spent: Counter[str] = Counter()  # tokens each tenant took this step
        self._shares = fair_share.shares((), max_num_seqs, max_batch_tokens)
        self._served: frozenset[str] = frozenset()  # the tenants the last step ran rows of
        self._last_schedule = time.monotonic()

    # ----- admission control -----------------------------------------------------------------
    def check_fits(self, req: Request) -> None:
        check_fits(req, self.max_context, self.kv_cache.limits())

    def add(self, req: Request) -> None:
        self.check_fits(req)
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are already waiting (max_waiting_requests)")
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
        self._expire(plan, time.monotonic())
        self._shares = fair_share.shares([*self.running, *self.waiting], self.max_num_seqs, self.max_batch_tokens)
        self._budget = self.max_batch_tokens
        self._spent = Counter()
        self._make_room(plan)
        self.running = fair_share.interleave(self.running)
        made_room = len(plan.preempted)
        self._schedule_running(plan, decode=True, held=held)
        self._schedule_running(plan, decode=False)
        if len(plan.preempted) == made_room:
            self._admit(plan)
        if plan.empty and held:  # nobody else to run: the held rows wait for nobody
            self._schedule_running(plan, decode=True)
        self._served = frozenset(e.req.tenant for e in (*plan.decode, *plan.prefill))
        return plan

    def _expire(self, plan: StepPlan, now: float) -> None:
        """Fail the requests that waited `max_queue_wait_s` for their own tenant's work. Since the last
        step, a request whose tenant's wait let other tenants be served had its clock paused."""
        elapsed, self._last_schedule = now - self._last_schedule, now
        for req in list(self.waiting):
            if self._served - {req.tenant}:
                req.waiting_since = min(now, req.waiting_since + elapsed)
            elif now - req.waiting_since > self.max_queue_wait_s:
                req.fail(ErrorCode.BUSY, f"no capacity within max_queue_wait_s={self.max_queue_wait_s:g}s",
                         FinishReason.BUSY)
                self.remove(req)
                plan.failed.append(req)

    def _make_room(self, plan: StepPlan) -> None:
        """For each tenant under its slot share whose next request does not fit the slots, preempt the
        newest requests of the tenant furthest over its share until it does."""
        share = self._shares.seqs
        for tenant, head in fair_share.heads(list(self.waiting)).items():
            while self.num_running_seqs + len(head.live_seqs) > self.max_num_seqs:
                if fair_share.held(self.running)[tenant] >= share:
                    break
                victim = fair_share.over_share(self.running, share)
                if victim is None or victim.tenant == tenant:
                    break
                self.preempt(victim)
                plan.preempted.append(victim)

    def _room(self, tenant: str) -> int:
        """Tokens `tenant` may still take this step: its share of the budget while others have work."""
        if not self._shares.contended:
            return self._budget
        return min(self._budget, self._shares.tokens - self._spent[tenant])

    def _spend(self, tenant: str, tokens: int) -> None:
        self._budget -= tokens
        self._spent[tenant] += tokens

    def _schedule_running(self, plan: StepPlan, decode: bool, held: frozenset[TokenSequence] = frozenset()) -> None:
        index = 0
        while index < len(self.running):
            req = self.running[index]
            entries: list[ScheduledSeq] = []
            for seq in self._rows(req, decode, held):
                count = min(seq.to_compute, self._room(req.tenant))
                if count <= 0:
                    continue
                entry = self._reserve(req, seq, count, plan)
                if entry is None:
                    break
                entries.append(entry)
                self._spend(req.tenant, count)
            if req in self.running:
                (plan.decode if decode else plan.prefill).extend(entries)
                index += 1
            else:
                self._spend(req.tenant, -sum(e.num_tokens for e in entries))

    def _rows(self, req: Request, decode: bool, held: frozenset[TokenSequence]) -> list[TokenSequence]:
        """The request's sequences to decode (or to prefill) this step. Decode rows lagging behind go first,
        so that rows past the tenant's share of the step take turns; a beam search's rows go all or none."""
        seqs = [seq for seq in req.live_seqs
                if self.kv_cache.has_table(req, seq) and (seq.to_compute == 1) == decode and seq not in held]
        if not decode:
            return seqs
        if req.params.beam_width > 1 and len(seqs) > self._room(req.tenant):
            return []
        return sorted(seqs, key=lambda seq: seq.num_generated)

    def _reserve(self, req: Request, seq: TokenSequence, count: int, plan: StepPlan) -> ScheduledSeq | None:
        """Slots for the sequence's next `count` tokens. While the pool cannot serve them (the manager's
        `allocate_slots` returns None, the sessions' pins already reclaimed), the newest request of the
        tenant holding the most slots is preempted; None when that was `req` itself."""
        start = seq.num_computed
        while (reserved := self.kv_cache.allocate_slots(req, seq, count)) is None:
            victim = fair_share.heaviest_newest(self.running)
            self._spend(victim.tenant, -plan.drop(victim))
            self.preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return None
        slots, copies = reserved
        return ScheduledSeq(req, seq, start, count, slots, copies, self.kv_cache.block_ids(req, seq))

    def _admit(self, plan: StepPlan) -> None:
        inflight = {h for r in self.running for h in self._inflight(r)}
        deferred: list[Request] = []
        blocked: set[str] = set()  # tenants whose next request waits for a later step
        while self._budget > 0 and (req := self._next_admission(blocked)) is not None:
            seqs = req.live_seqs
            if self.num_running_seqs + len(seqs) > self.max_num_seqs and not blocked:
                break  # the least served tenant's request waits for slots: the others wait behind it
            if not self._may_admit(req):
                blocked.add(req.tenant)
                continue
            cached_blocks = self.kv_cache.get_computed_blocks(req, seqs)
            if self._next_block_inflight(req, cached_blocks, inflight):
                self.kv_cache.unwind(req)
                self.waiting.remove(req)
                deferred.append(req)
                continue
            if not self._reclaim_room(req):
                self.kv_cache.unwind(req)
                break
            self.waiting.remove(req)
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

    def _reclaim_room(self, req: Request) -> bool:
        """Whether the pool takes the looked-up request (`can_admit`, a question); if not, the sessions'
        pins are reclaimed for it (`reclaim_pins_for`, an action) and the question asked again, this
        time keeping the low watermark free even when nothing runs: room made by reclaiming pins is
        taken only above the watermark (the request waits a step otherwise)."""
        if self.kv_cache.can_admit(req, alone=not self.running):
            return True
        self.kv_cache.reclaim_pins_for(req)
        return self.kv_cache.can_admit(req, alone=False)

    def _next_admission(self, blocked: set[str]) -> Request | None:
        """The next request to try: the head of the tenant holding the fewest slots (ties: queue order)."""
        counts = fair_share.held(self.running)
        candidates = [(counts[t], i, req) for i, (t, req) in enumerate(fair_share.heads(self.waiting).items())
                      if t not in blocked]
        return min(candidates, key=lambda c: (c[0], c[1]))[2] if candidates else None

    def _may_admit(self, req: Request) -> bool:
        """Whether `req` fits the sequence cap and its tenant's room this step; beyond its tenant's slot
        share only while no other tenant waits, or as the tenant's only request."""
        if self.num_running_seqs + len(req.live_seqs) > self.max_num_seqs or self._room(req.tenant) <= 0:
            return False
        holds = fair_share.held(self.running)[req.tenant]
        within = holds == 0 or holds + fair_share.seats(req) <= self._shares.seqs
        return within or all(r.tenant == req.tenant for r in self.waiting)

    def _reserve_prefill(self, req: Request, seqs: list[TokenSequence], plan: StepPlan) -> bool:
        """An admitted request's first chunks; False if the pool could not serve them after all (the
        request went back to waiting: `_reserve`), which `can_admit` rules out."""
        for seq in seqs:
            count = min(seq.to_compute, self._room(req.tenant))
            if count <= 0:
                continue
            entry = self._reserve(req, seq, count, plan)
            if entry is None:
                return False
            plan.prefill.append(entry)
            self._spend(req.tenant, count)
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
