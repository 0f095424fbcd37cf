"""Grammar mask time, accounted per tenant, so that one tenant's costly grammars slow only that tenant.

Filling a constrained row's allowed-token bitmask runs on the host, inside the step that every
running request waits for. Most schemas cost 0.03-0.07 ms a row; a pattern such as `.{1,500}`
costs 13-35 ms. Without a bound, a tenant holding many such rows slowed every other chat's step.

Invariants:
- every step's masks are filled in one batch call per tenant, timed, and the time is charged to
  that tenant (`charge`); a tenant's cost of a row is the mean of its recent batches;
- each step, a tenant with constrained rows earns `share` ms of credit: `fraction` times the
  recent mean time of a decode step (the step other chats' inter-token latency is made of; until
  one is measured, of any step), less its masks, split evenly among the tenants with requests in
  the engine.
  Credit is capped at `BURST_STEPS` shares (or one row's cost, when that is more, so that any row
  can eventually be masked);
- a tenant's constrained decode rows are held out of the step (`hold`: they wait, nothing is lost)
  beyond what its credit pays for, least recently masked first, so none of them starves;
- rows are held only while another tenant's request, or a request without a grammar, is in the
  engine: with nobody else to wait, masks cost nobody (and the scheduler never idles on a hold), so
  they are not charged either: a tenant alone runs up no debt that a later arrival would make it pay.
A prompt's first mask is never held; it is charged all the same, so a tenant's debt is paid back
before its rows run again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from chatcore.engine.request import Request, RequestState, TokenSequence

BURST_STEPS = 4  # how many steps' shares a tenant may save up
SMOOTHING = 0.2  # the weight of the newest measurement in a running mean


class MaskBudget:
    def __init__(self, fraction: float) -> None:
        """`fraction`: the part of a step's forward time all tenants' masks may add to it."""
        self.fraction = fraction
        self._forward_ms = {True: 0.0, False: 0.0}  # by whether the step was all decode
        self._credit: dict[str, float] = {}
        self._row_ms: dict[str, float] = {}
        self._masked_at: dict[TokenSequence, int] = {}  # the step that last masked a held-able row
        self._step = 0
        self._contended: set[str] = set()  # the tenants whose masks others wait for, this step
        self.held_rows = 0  # rows held out of steps so far (a counter, for metrics)

    def forward_took(self, ms: float, decode: bool) -> None:
        """A step took `ms` besides its masks (`decode`: it computed no prompt): the scale of every share."""
        known = self._forward_ms[decode]
        self._forward_ms[decode] = ms if known == 0 else known + SMOOTHING * (ms - known)

    def hold(self, requests: Iterable[Request], constrained: Callable[[TokenSequence], bool]) -> frozenset[TokenSequence]:
        """The constrained decode rows to leave out of the next step; each tenant with rows earns its share."""
        self._step += 1
        requests = list(requests)
        tenants = {req.tenant for req in requests}
        share = self.fraction * (self._forward_ms[True] or self._forward_ms[False]) / max(1, len(tenants))
        rows: dict[str, list[TokenSequence]] = {}
        for req in requests:
            running = req.state is RequestState.RUNNING  # a waiting request's sequences decode nothing yet
            rows.setdefault(req.tenant, []).extend(
                seq for seq in req.live_seqs if running and seq.to_compute == 1 and constrained(seq))
        held: list[TokenSequence] = []
        self._contended = set()
        for tenant, seqs in rows.items():
            if not seqs:
                continue
            row_ms = self._row_ms.get(tenant, 0.0)
            credit = min(self._credit.get(tenant, 0.0) + share, max(BURST_STEPS * share, row_ms))
            self._credit[tenant] = credit
            if not any(req.tenant != tenant or req.params.response_format is None for req in requests):
                continue
            self._contended.add(tenant)
            seqs.sort(key=lambda seq: self._masked_at.get(seq, 0))
            affordable = len(seqs) if row_ms == 0 else max(0, int(credit // row_ms))
            held.extend(seqs[affordable:])
        self.held_rows += len(held)
        return frozenset(held)

    def charge(self, tenant: str, ms: float, seqs: list[TokenSequence]) -> None:
        """The tenant's masks for `seqs` took `ms` (one batch call): charged while others wait for them."""
        if tenant in self._contended:
            self._credit[tenant] = self._credit.get(tenant, 0.0) - ms
        per_row = ms / len(seqs)
        known = self._row_ms.get(tenant)
        self._row_ms[tenant] = per_row if known is None else known + SMOOTHING * (per_row - known)
        for seq in seqs:
            self._masked_at[seq] = self._step

    def release(self, seq: TokenSequence) -> None:
        """A sequence ended: forget when it was masked. A tenant's credit (or debt) stays."""
        self._masked_at.pop(seq, None)
