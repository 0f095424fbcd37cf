"""The synchronous engine: schedule, run one forward pass, sample, stream, release.

Only the thread that calls `step()` touches the block pool, the tables and the KV tensors.
Every exit path of a request (stop, length, abort, busy, error) goes through `_finish`, which
gives all of its tables back to the KV cache manager (`KVCacheManager.free`); a session's turn
keeps its first sample's table there as the session's pin.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import torch

from chatcore.cache import BlockPool, CacheError, audit, cache_salt
from chatcore.config import Settings
from chatcore.engine.batch_limits import batch_limits
from chatcore.engine.beams import Beams
from chatcore.engine.choices import StepChoices
from chatcore.engine.commands import SessionPrefix
from chatcore.engine.detok import IncrementalDetokenizer
from chatcore.engine.errors import describe_failure
from chatcore.engine.grammar import CompilePolicy, Grammars
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.mask_budget import MaskBudget
from chatcore.engine.outputs import CompletedSeq, RequestOutput, SeqDelta, Timings, TokenLogprob, Usage
from chatcore.engine.penalties import Penalties
from chatcore.engine.pool_sizing import depth_cost, kv_storage_dtype, pool_size
from chatcore.engine.request import Request, SamplingParams, TokenSequence
from chatcore.engine.row_faults import RowFaults
from chatcore.engine.runner import ModelRunner
from chatcore.engine.sampler import NO_TOKEN, beam_candidates, greedy, make_generator, sample
from chatcore.engine.scheduler import ScheduledSeq, Scheduler, StepPlan
from chatcore.engine.transfers import DownloadPack
from chatcore.kv.tensors import KVTensors
from chatcore.models.loader import LoadedModel
from chatcore.outcomes import ErrorCode, FinishReason

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, loaded: LoadedModel, settings: Settings) -> None:
        self.loaded = loaded
        self.settings = settings
        self.tokenizer = loaded.tokenizer
        num_blocks = pool_size(settings, loaded)
        self.pool = BlockPool(num_blocks, settings.block_size, low_watermark=settings.low_watermark,
                              high_watermark=settings.high_watermark, debug=settings.debug_audit,
                              eviction=settings.eviction_policy,
                              depth_cost=depth_cost(loaded, settings.block_size))
        self.kv = KVTensors(loaded.num_layers, num_blocks, settings.block_size, loaded.num_kv_heads,
                            loaded.head_dim, kv_storage_dtype(settings, loaded), loaded.device)
        self.kv_cache = KVCacheManager(self.pool, self.kv, settings.hot_window_s)
        limits = batch_limits(settings, loaded.device)
        self.scheduler = Scheduler(self.kv_cache, max_batch_tokens=limits.max_batch_tokens,
                                   max_num_seqs=limits.max_num_seqs, max_queue_wait_s=settings.max_queue_wait_s,
                                   max_context=min(loaded.max_context, settings.max_context or loaded.max_context),
                                   max_waiting=settings.max_waiting_requests)
        self.runner = ModelRunner(loaded, self.kv)
        if loaded.device.type == "cuda" and settings.cuda_graphs:
            self.runner.enable_decode_graphs(limits.max_num_seqs, self.scheduler.max_context, capture=True)
        self.requests: dict[str, Request] = {}
        self._detok: dict[TokenSequence, IncrementalDetokenizer] = {}
        self._generators: dict[TokenSequence, torch.Generator] = {}
        self._beams = Beams(self.kv_cache, lambda req: self._stop_ids(req.params))
        self._penalties = Penalties(self.vocab_size, loaded.device)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, loaded.stop_token_ids, CompilePolicy(
            settings.grammar_compile_threads, settings.grammar_compile_timeout_s, settings.grammar_cache_mb << 20))
        self.mask_budget = MaskBudget(settings.grammar_mask_share)
        self.on_step: list[Callable[[StepPlan], None]] = []
        self.steps = 0
        # Why the last step that ran the model failed; None once one succeeds (readiness reads it).
        self.step_failure: str | None = None
        # Set when the device itself failed (`torch.AcceleratorError`: an illegal memory access, a
        # launch failure): its state is lost for good, and no later step may run.
        self.device_lost: str | None = None

    @property
    def vocab_size(self) -> int:
        """The width of a row of logits: valid token ids are 0..vocab_size - 1."""
        return int(self.loaded.model.get_output_embeddings().out_features)

    # ----- salts and requests ----------------------------------------------------------------
    def salt(self, scope_key: str = "global") -> bytes:
        """The hash extra keys. KV stored in another dtype than the model's is other KV: its dtype joins
        the model's, so its blocks (in the pool and on disk) never mix with the model dtype's, whose
        salt stays what it was before `kv_dtype` existed."""
        dtype = self.loaded.dtype_name
        if self.kv.dtype != self.loaded.dtype:
            dtype += "/kv=" + str(self.kv.dtype).removeprefix("torch.")
        return cache_salt(self.loaded.fingerprint, self.settings.block_size, dtype, scope_key)

    def make_request(self, prompt: list[int], params: SamplingParams, *, request_id: str | None = None,
                     scope_key: str = "global", tenant: str = "local") -> Request:
        return Request(request_id or uuid.uuid4().hex, list(prompt), params, salt=self.salt(scope_key), tenant=tenant)

    def add(self, req: Request, prefix: SessionPrefix | None = None) -> int | None:
        """Queue a request, its session prefix prepared first (`KVCacheManager.prepare`). Returns None
        once it is queued, or, when it declines for blocks the disk tier may hold, how many full
        prompt blocks the pool holds (nothing is kept). Raises `RequestRejected` (and keeps nothing)
        if it can never fit."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        if not req.salt:
            req.salt = self.salt()
        try:
            if prefix is not None and (declined := self.kv_cache.prepare(req, prefix)) is not None:
                return declined
            self._penalties.admit(req)
            if req.params.response_format is not None:
                self.grammars.admit(req.seqs[0], req.params.response_format)
            self.scheduler.add(req)
        except Exception:
            self._penalties.release(req)
            self.grammars.release(req.seqs[0])
            self.kv_cache.free(req)
            raise
        self.requests[req.request_id] = req
        return None

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> RequestOutput | None:
        """End a request in any state (waiting, prefilling, decoding, preempted)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.live_seqs:
            seq.finish_reason = reason
        return self._finish(req)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def awaiting_first_token(self) -> bool:
        """Whether a request (waiting, or prefilling) has yet to produce its first token."""
        return any(req.first_token is None for req in self.requests.values())

    def tend_pins(self) -> None:
        """Expire and trim the sessions' pins (`KVCacheManager.tend_pins`), between two steps."""
        self.kv_cache.tend_pins(self.settings.max_hot_sessions, self.settings.pinned_kv_fraction)

    def resize(self, num_blocks: int) -> int:
        """Grow or shrink the pool and its tensors together; block ids never change.

        Shrinking removes only free or cached-free blocks from the top of the id space, and
        never below the high watermark of available blocks. Returns the new size.
        """
        current = self.pool.num_blocks
        if num_blocks > current:
            self.kv.resize(num_blocks)
            self.pool.grow(num_blocks - current)
        elif num_blocks < current:
            self.pool.shrink(current - num_blocks)
            self.kv.resize(self.pool.num_blocks)
        return self.pool.num_blocks

    # ----- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        held = self.mask_budget.hold([*self.scheduler.running, *self.scheduler.waiting], self.grammars.constrained) \
            if self.grammars.active else frozenset()
        plan = self.scheduler.schedule(held)
        outputs: dict[str, RequestOutput] = {}
        for req in plan.failed:
            outputs[req.request_id] = self._finish(req)
        for req in plan.preempted:
            outputs.setdefault(req.request_id, RequestOutput(req.request_id)).preempted = True
        if plan.empty:
            return list(outputs.values())
        entries = plan.decode + plan.prefill
        try:
            logits = self.runner.execute(plan)
        except Exception as exc:  # a failed forward fails its requests, never the engine
            log.exception("engine step failed")
            self.step_failure = describe_failure(exc)
            if isinstance(exc, torch.AcceleratorError):
                self.device_lost = self.step_failure
            for req in dict.fromkeys(e.req for e in entries):
                req.fail(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", FinishReason.ERROR)
                outputs[req.request_id] = self._finish(req)
            return list(outputs.values())
        self.steps += 1
        self.step_failure = None
        for entry in entries:
            seq = entry.seq
            seq.num_computed = entry.start + entry.num_tokens
            assert seq.table is not None
            seq.table.commit(seq.tokens, seq.num_computed, entry.req.salt)
        faults = RowFaults()
        rows, groups = self._sampling_rows(entries, faults)
        mask_ms = self._sample(rows, groups, logits, outputs, faults)
        self.mask_budget.forward_took(1000 * (time.perf_counter() - started) - mask_ms, decode=not plan.prefill)
        for req in dict.fromkeys(e.req for e in entries):
            if not req.finished and not req.live_seqs:
                outputs[req.request_id] = self._merge(outputs.get(req.request_id), self._finish(req))
        for hook in self.on_step:
            hook(plan)
        if self.settings.debug_audit:
            audit(self.pool).raise_if_bad()
        return list(outputs.values())

    def _sampling_rows(self, entries: list[ScheduledSeq], faults: RowFaults) -> tuple[dict[TokenSequence, int],
                                                                                     list[list[ScheduledSeq]]]:
        """The row of the step's logits each sampling sequence reads, and the sampling entries by
        request. A request with n > 1 whose prompt was just computed forks here (`_fork`): its
        other samples join its group and read the first sample's row."""
        rows: dict[TokenSequence, int] = {}
        by_request: dict[str, list[ScheduledSeq]] = {}
        for entry in entries:
            if entry.samples:
                rows[entry.seq] = len(rows)
                by_request.setdefault(entry.req.request_id, []).append(entry)
        for group in by_request.values():
            req = group[0].req
            if req.params.beam_width == 1 and not req.forked:
                forks = faults.run(req, "forking its samples", lambda: self._fork(req)) or []
                rows.update({f.seq: rows[req.seqs[0]] for f in forks})
                group += forks
        return rows, [group for group in by_request.values() if group[0].req.error is None]

    def _sample(self, rows: dict[TokenSequence, int], groups: list[list[ScheduledSeq]], logits: torch.Tensor,
                outputs: dict[str, RequestOutput], faults: RowFaults) -> float:
        """Choose every sampling row's token on the device (`StepChoices`), then bring all choices,
        their log-probs and beam search's candidates to the host in the step's one download. A fault
        of one request's rows fails that request alone (`RowFaults`). Returns the masks' time in ms."""
        now = time.monotonic()
        plain = [(e.req, e.seq, rows[e.seq]) for group in groups if group[0].req.params.beam_width == 1
                 for e in group]
        beams = [(group[0].req, [rows[e.seq] for e in group]) for group in groups
                 if group[0].req.params.beam_width > 1]
        mask_ms = self._mask(plain, logits, faults)
        plain = [item for item in plain if item[0].error is None]
        argmax = greedy(logits)
        pack = DownloadPack()
        pack.add("argmax", argmax)
        choices = self._choices(plain, logits, argmax, pack, faults)
        candidates = {req: faults.run(req, "beam search", lambda req=req, beam_rows=beam_rows: beam_candidates(
            torch.stack([logits[r] for r in beam_rows]), self._beams.search(req).candidates))
            for req, beam_rows in beams}
        for i, found in enumerate(candidates.values()):
            if found is not None:
                pack.add(f"beam{i}.values", found[0])
                pack.add(f"beam{i}.ids", found[1])
        host = self.runner.transfers.download(pack.packed())
        for i, (req, found) in enumerate(candidates.items()):
            if found is not None:
                faults.run(req, "beam search", lambda req=req, i=i, width=found[0].shape[1]: self._step_beams(
                    req, pack.segment(host, f"beam{i}.values"), pack.segment(host, f"beam{i}.ids"), width))
                outputs.setdefault(req.request_id, RequestOutput(req.request_id))
        for choice in choices:
            for (req, seq, _), (token, logprob) in zip(choice.items, choice.read(host), strict=True):
                if token == NO_TOKEN:
                    faults.fail(req, "sampling failed: the row's probabilities are not a distribution (a NaN or an "
                                     "infinity after penalties, logit_bias and temperature)")
                faults.run(req, "choosing its token", lambda req=req, seq=seq, token=token, logprob=logprob:
                           self._take(req, seq, token, now, outputs, logprob))
        return mask_ms

    def _mask(self, plain: list[tuple[Request, TokenSequence, int]], logits: torch.Tensor, faults: RowFaults) -> float:
        """Fill and apply the grammar masks of the step's constrained rows, before anything reads the logits
        (the grammar's -inf rule them all), each tenant's fill charged to it; a row without a mask fails its
        request. Returns the fill's time in ms."""
        groups: dict[str, list[tuple[object, int]]] = {}
        for req, seq, row in plain:
            if self.grammars.constrained(seq):
                groups.setdefault(req.tenant, []).append((seq, row))
        if not groups:
            return 0.0
        fill = self.grammars.masks(groups, logits.shape[0], torch.get_num_threads())
        for tenant, pairs in groups.items():
            self.mask_budget.charge(tenant, fill.took_ms[tenant], [seq for seq, _ in pairs])
        for req, seq, _ in plain:
            if seq in fill.failed:
                faults.fail(req, fill.failed[seq])
        masked = sorted({row for pairs in groups.values() for seq, row in pairs if seq not in fill.failed})
        if masked:
            self.grammars.apply(logits, self.runner.transfers.upload_bitmask(fill.bitmask), masked)
        return sum(fill.took_ms.values())

    def _choices(self, plain: list[tuple[Request, TokenSequence, int]], logits: torch.Tensor, argmax: torch.Tensor,
                 pack: DownloadPack, faults: RowFaults) -> list[StepChoices]:
        """The step's choices in one batch; when building them raises, again for each request alone, so
        that only the request that raises fails."""
        try:
            return [StepChoices(plain, logits, argmax, pack, self._penalties, sample, self._generator)]
        except Exception:
            log.warning("the step's choices failed as one batch; making them request by request")
        by_request: dict[Request, list[tuple[Request, TokenSequence, int]]] = {}
        for item in plain:
            by_request.setdefault(item[0], []).append(item)
        made = [faults.run(req, "sampling", lambda i=i, items=items: StepChoices(
            items, logits, argmax, pack, self._penalties, sample, self._generator, key=f"r{i}."))
            for i, (req, items) in enumerate(by_request.items())]
        return [choice for choice in made if choice is not None]

    def _step_beams(self, req: Request, flat_values: list[float], flat_ids: list[float], width: int) -> None:
        self._beams.step(req, [flat_values[j: j + width] for j in range(0, len(flat_values), width)],
                         [[int(t) for t in flat_ids[j: j + width]] for j in range(0, len(flat_ids), width)])

    def _take(self, req: Request, seq: TokenSequence, token: int, now: float, outputs: dict[str, RequestOutput],
              logprob: TokenLogprob | None) -> None:
        """A plain sample's chosen token: its grammar advances, then it joins the sequence."""
        complete = self.grammars.constrained(seq) and self.grammars.accept(seq, token)
        self._append_token(req, seq, token, now, outputs, logprob, complete)

    def _fork(self, req: Request) -> list[ScheduledSeq]:
        """n > 1: after the prompt's first token is due, the other samples fork its table (the
        prompt's blocks are shared, the last partial one is copied on write), its penalty counts
        and its grammar state. They sample from the first sample's row of logits, each with its
        own generator."""
        req.forked = True
        seq0 = req.seqs[0]
        forks = []
        for child in range(1, req.params.n):
            fork = TokenSequence(child, list(seq0.tokens), seq0.prompt_len,
                                 table=self.kv_cache.fork(seq0, f"{req.request_id}/{child}"),
                                 num_computed=seq0.num_computed)
            req.seqs.append(fork)
            self._penalties.fork(seq0, fork)
            self.grammars.fork(seq0, fork)
            forks.append(ScheduledSeq(req, fork, 0, 0, [], []))
        return forks

    def _generator(self, req: Request, seq: TokenSequence) -> torch.Generator | None:
        if req.params.greedy:
            return None
        key = seq
        if key not in self._generators:
            self._generators[key] = make_generator(req.params.seed, seq.index, self.loaded.device)
        return self._generators[key]

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        if params.ignore_eos:
            return frozenset(params.stop_token_ids)
        return self.loaded.stop_token_ids | frozenset(params.stop_token_ids)

    def _append_token(self, req: Request, seq: TokenSequence, token: int, now: float,
                      outputs: dict[str, RequestOutput], logprob: TokenLogprob | None = None,
                      complete: bool = False) -> None:
        """`complete`: the sequence's grammar has accepted its whole output (it stops, EOS ignored or not)."""
        seq.tokens.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        if req.first_token is None:
            req.first_token = now
        if seq.index == 0:
            req.token_times.append(now)
        detok = self._detok.get(seq)
        if detok is None:
            detok = self._detok[seq] = IncrementalDetokenizer(self.tokenizer, req.params.stop)
        text = detok.push(token)
        if token in self._stop_ids(req.params) or detok.stopped or complete:
            seq.finish_reason = FinishReason.STOP
        elif seq.num_generated >= req.params.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        if seq.finished:
            text += detok.flush()
            if not (req.session_id is not None and seq.index == 0):  # a session's turn keeps it to the end
                self.kv_cache.free_seq(seq)
        out = outputs.setdefault(req.request_id, RequestOutput(req.request_id))
        out.deltas.append(SeqDelta(seq.index, [token], text, [logprob] if logprob is not None else None))

    # ----- finishing ---------------------------------------------------------------------------
    def _finish(self, req: Request) -> RequestOutput:
        """The one exit path: give every table back to the KV cache manager (a session's turn keeps
        its pin there), take the request out of the queues, then report."""
        pinned = self.kv_cache.free(req)
        self.scheduler.remove(req)
        self._penalties.release(req)
        for seq in req.seqs:
            self.grammars.release(seq)
            self.mask_budget.release(seq)
        self.requests.pop(req.request_id, None)
        req.finished_at = time.monotonic()
        out = RequestOutput(req.request_id, finished=True, error=req.error, error_code=req.error_code,
                            pinned_hashes=pinned)
        out.outputs = self._beams.finish(req, self._decode) or [self._completed(req, seq) for seq in req.seqs]
        for seq in req.seqs:
            self._detok.pop(seq, None)
            self._generators.pop(seq, None)
        completion = sum(len(o.token_ids) for o in out.outputs)
        out.usage = Usage(len(req.prompt), req.cached_tokens, completion, req.cached_disk_tokens)
        out.timings = self._timings(req)
        return out

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _completed(self, req: Request, seq: TokenSequence) -> CompletedSeq:
        return CompletedSeq(seq.index, self._text(req, seq), seq.output_ids, seq.finish_reason or FinishReason.CANCELLED,
                            list(seq.logprobs) if req.params.logprobs else None)

    def _text(self, req: Request, seq: TokenSequence) -> str:
        """The sequence's text so far. A failed request's detokenizer may be the part that failed: its text
        is then empty (the deltas already streamed stand), so that its exit path still completes."""
        detok = self._detok.get(seq)
        try:
            return detok.text if detok is not None else ""
        except Exception:
            if req.error is None:
                raise
            return ""

    @staticmethod
    def _timings(req: Request) -> Timings:
        start, end = req.arrival, req.finished_at or time.monotonic()
        return Timings(
            queue_ms=1000 * ((req.first_scheduled or end) - start),
            ttft_ms=1000 * (req.first_token - start) if req.first_token is not None else None,
            total_ms=1000 * (end - start),
            inter_token_ms=[1000 * (b - a) for a, b in zip(req.token_times, req.token_times[1:])],
        )

    @staticmethod
    def _merge(first: RequestOutput | None, final: RequestOutput) -> RequestOutput:
        if first is not None:
            final.deltas = first.deltas + final.deltas
            final.preempted = first.preempted
        return final

    def audit(self) -> None:
        report = audit(self.pool)
        if not report.ok:
            raise CacheError(report.format())
