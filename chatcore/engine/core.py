"""The synchronous engine: its loop, `add`, `abort` and the audit.

A step walks down and back once, each stage handing the next a record of engine/step_types.py:
schedule (`Scheduler.schedule` → `StepPlan`; it asks the KV cache manager for slots), run the model
(`ModelRunner.execute` → logits), sample (`StepSampler.sample` → `Sampled`: tokens, forks and beam
candidates as data; it changes no request), update (`StepUpdate.update_from_output` → `Updated`: the
one place a step's outcome changes state: computed tokens, hashed blocks, forks, beams, appended
tokens, stops, freed samples, failed rows), report (`OutputProcessor.process`: the deltas), then
finish the requests the update left with no live sequence. Around it: the grammar masks' hold before
scheduling, the hooks and the debug audit after.
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
from chatcore.engine.commands import SessionPrefix
from chatcore.engine.detok import Detokenizers
from chatcore.engine.errors import describe_failure
from chatcore.engine.grammar import CompilePolicy, GrammarCompiler
from chatcore.engine.grammar_matchers import GrammarMatchers
from chatcore.engine.kv_manager import KVCacheManager
from chatcore.engine.mask_budget import MaskBudget
from chatcore.engine.output_processor import OutputProcessor
from chatcore.engine.outputs import RequestOutput
from chatcore.engine.penalties import Penalties
from chatcore.engine.pool_sizing import depth_cost, kv_storage_dtype, pool_size
from chatcore.engine.request import Request, SamplingParams, TokenSequence
from chatcore.engine.runner import ModelRunner
from chatcore.engine.scheduler import Scheduler
from chatcore.engine.step_sampler import StepSampler
from chatcore.engine.step_types import StepPlan
from chatcore.engine.step_update import StepUpdate
from chatcore.kv.tensors import KVTensors
from chatcore.models.loader import LoadedModel
from chatcore.models.paged_attention import check_route
from chatcore.outcomes import ErrorCode, FinishReason

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, loaded: LoadedModel, settings: Settings) -> None:
        self.loaded = loaded
        self.settings = settings
        self.tokenizer = loaded.tokenizer
        check_route(loaded.device, loaded.head_dim, settings.block_size, loaded.model.dtype,
                    kv_storage_dtype(settings, loaded))
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
        self._penalties = Penalties(self.vocab_size, loaded.device)
        # Grammars: the callers' compile half (thread-safe; the door hands it out), and the matchers,
        # which only this core holds and only the engine thread touches.
        self.grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, loaded.stop_token_ids, CompilePolicy(
            settings.grammar_compile_threads, settings.grammar_compile_timeout_s, settings.grammar_cache_mb << 20))
        self.grammars = GrammarMatchers(self.vocab_size, self.grammar_compiler.compile)
        self.mask_budget = MaskBudget(settings.grammar_mask_share)
        self.detokenizers = Detokenizers(self.tokenizer)
        self.update = StepUpdate(self.kv_cache, self.grammars, self.detokenizers, loaded.stop_token_ids)
        self.step_sampler = StepSampler(self.update.beams, self._penalties, self.grammars, self.mask_budget,
                                        self.runner.transfers, loaded.device)
        self.output_processor = OutputProcessor(self.tokenizer, self.detokenizers, self.update.beams)
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
        """Expire and trim the sessions' pins (`SessionPins.tend`), between two steps."""
        self.kv_cache.pins.tend(self.settings.max_hot_sessions, self.settings.pinned_kv_fraction)

    # ----- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        plan = self.scheduler.schedule(self._held())
        outputs = self._unscheduled(plan)
        if plan.empty:
            return list(outputs.values())
        try:
            logits = self.runner.execute(plan)
        except Exception as exc:  # a failed forward fails its requests, never the engine
            return self._forward_failed(plan, exc, outputs)
        self.steps += 1
        self.step_failure = None
        sampled = self.step_sampler.sample(plan.entries, logits)
        updated = self.update.update_from_output(plan, sampled)
        self.output_processor.process(updated, outputs)
        self.mask_budget.forward_took(1000 * (time.perf_counter() - started) - sampled.mask_ms,
                                      decode=not plan.prefill)
        for req in updated.ended:
            outputs[req.request_id] = self.output_processor.merge(outputs.get(req.request_id), self._finish(req))
        for hook in self.on_step:
            hook(plan)
        if self.settings.debug_audit:
            audit(self.pool).raise_if_bad()
        return list(outputs.values())

    def _held(self) -> frozenset[TokenSequence]:
        """The constrained decode rows whose tenant's grammar masks are past its share (`MaskBudget.hold`)."""
        if not self.grammars.active:
            return frozenset()
        return self.mask_budget.hold([*self.scheduler.running, *self.scheduler.waiting], self.grammars.constrained)

    def _unscheduled(self, plan: StepPlan) -> dict[str, RequestOutput]:
        """The outputs of the requests scheduling failed (ended now) and preempted."""
        outputs = {req.request_id: self._finish(req) for req in plan.failed}
        for req in plan.preempted:
            outputs.setdefault(req.request_id, RequestOutput(req.request_id)).preempted = True
        return outputs

    def _forward_failed(self, plan: StepPlan, exc: Exception, outputs: dict[str, RequestOutput]) -> list[RequestOutput]:
        """A failed forward pass fails the step's requests (the device's loss stops every later step)."""
        log.exception("engine step failed", exc_info=exc)
        self.step_failure = describe_failure(exc)
        if isinstance(exc, torch.AcceleratorError):
            self.device_lost = self.step_failure
        for req in dict.fromkeys(e.req for e in plan.entries):
            req.fail(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", FinishReason.ERROR)
            outputs[req.request_id] = self._finish(req)
        return list(outputs.values())

    # ----- finishing ---------------------------------------------------------------------------
    def _finish(self, req: Request) -> RequestOutput:
        """The one exit path: give every table back to the KV cache manager (a session's turn keeps
        its pin there), take the request out of the queues, then report (`OutputProcessor.finish`)."""
        pinned = self.kv_cache.free(req)
        self.scheduler.remove(req)
        self._penalties.release(req)
        for seq in req.seqs:
            self.grammars.release(seq)
            self.mask_budget.release(seq)
        self.requests.pop(req.request_id, None)
        req.finished_at = time.monotonic()
        out = self.output_processor.finish(req, pinned)
        self.step_sampler.release(req)
        return out

    def audit(self) -> None:
        report = audit(self.pool)
        if not report.ok:
            raise CacheError(report.format())
