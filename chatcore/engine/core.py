"""The synchronous engine: schedule, run one forward pass, sample, stream, release.

Only the thread that calls `step()` touches the block pool, the tables and the KV tensors.
Every exit path of a request (stop, length, abort, busy, error) goes through `_finish`, which
releases all of its tables through the scheduler; a request may keep its best table for the
session that owns it (`keep_table`).
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
from chatcore.engine.beam import BeamSearch
from chatcore.engine.choices import StepChoices
from chatcore.engine.detok import IncrementalDetokenizer
from chatcore.engine.errors import describe_failure
from chatcore.engine.grammar import CompilePolicy, Grammars
from chatcore.engine.outputs import (
    CompletedSeq,
    RequestOutput,
    SeqDelta,
    Timings,
    TokenLogprob,
    Usage,
)
from chatcore.engine.penalties import Penalties
from chatcore.engine.request import Request, SamplingParams, TokenSequence
from chatcore.engine.runner import ModelRunner
from chatcore.engine.sampler import beam_candidates, make_generator, sample
from chatcore.engine.scheduler import ScheduledSeq, Scheduler, StepPlan
from chatcore.engine.transfers import DownloadPack
from chatcore.kv.sizing import device_pool_bytes
from chatcore.kv.tensors import DTYPES, KVTensors
from chatcore.models.loader import LoadedModel
from chatcore.outcomes import ErrorCode, FinishReason

log = logging.getLogger(__name__)


def kv_storage_dtype(settings: Settings, loaded: LoadedModel) -> torch.dtype:
    return loaded.dtype if settings.kv_dtype == "auto" else DTYPES[settings.kv_dtype]


def pool_size(settings: Settings, loaded: LoadedModel) -> int:
    if settings.num_blocks is not None:
        return settings.num_blocks
    per_block = KVTensors.bytes_per_block(loaded.num_layers, settings.block_size, loaded.num_kv_heads,
                                          loaded.head_dim, kv_storage_dtype(settings, loaded))
    budget = device_pool_bytes(settings.kv_cache_gb, loaded.device, settings.gpu_memory_fraction)
    return max(16, budget // per_block)


def depth_cost(loaded: LoadedModel, block_size: int) -> float:
    """Recompute FLOPs a block of depth adds to a block (attention), relative to a block's linear
    FLOPs (2 x parameters per token): what losing a deep block costs over a shallow one."""
    params = sum(p.numel() for p in loaded.model.parameters())
    attention_per_position = 4 * loaded.num_layers * loaded.num_heads * loaded.head_dim
    return attention_per_position * block_size / (2 * params)


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
        limits = batch_limits(settings, loaded.device)
        self.scheduler = Scheduler(self.pool, max_batch_tokens=limits.max_batch_tokens,
                                   max_num_seqs=limits.max_num_seqs, max_queue_wait_s=settings.max_queue_wait_s,
                                   max_context=min(loaded.max_context, settings.max_context or loaded.max_context),
                                   max_waiting=settings.max_waiting_requests)
        self.runner = ModelRunner(loaded, self.kv)
        if loaded.device.type == "cuda" and settings.cuda_graphs:
            self.runner.enable_decode_graphs(limits.max_num_seqs, self.scheduler.max_context, capture=True)
        self.requests: dict[str, Request] = {}
        self._detok: dict[TokenSequence, IncrementalDetokenizer] = {}
        self._generators: dict[TokenSequence, torch.Generator] = {}
        self._beams: dict[str, BeamSearch] = {}
        self._penalties = Penalties(self.vocab_size, loaded.device)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, loaded.stop_token_ids, CompilePolicy(
            settings.grammar_compile_threads, settings.grammar_compile_timeout_s, settings.grammar_cache_mb << 20))
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
        return int(self.loaded.model.get_output_embeddings().weight.shape[0])

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
                     scope_key: str = "global") -> Request:
        return Request(request_id or uuid.uuid4().hex, list(prompt), params, salt=self.salt(scope_key))

    def add(self, req: Request) -> None:
        """Queue a request; raises `RequestRejected` (and keeps nothing) if it can never fit."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        if not req.salt:
            req.salt = self.salt()
        try:
            self._penalties.admit(req)
            if req.params.response_format is not None:
                self.grammars.admit(req.seqs[0], req.params.response_format)
            self.scheduler.add(req)
        except Exception:
            self._penalties.release(req)
            self.grammars.release(req.seqs[0])
            if req.prefix_table is not None and not req.prefix_table.released:
                req.prefix_table.release()
            raise
        self.requests[req.request_id] = req

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> RequestOutput | None:
        """End a request in any state (waiting, prefilling, decoding, preempted)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.live_seqs:
            seq.finish_reason = reason
        return self._finish(req)

    def discard(self, req: Request) -> None:
        """Release what a request built but never added holds (its prefix table); a request the
        engine knows is left alone (`abort` ends it)."""
        if req.request_id in self.requests:
            return
        if req.prefix_table is not None and not req.prefix_table.released:
            req.prefix_table.release()
        req.prefix_table = None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def awaiting_first_token(self) -> bool:
        """Whether a request (waiting, or prefilling) has yet to produce its first token."""
        return any(req.first_token is None for req in self.requests.values())

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
        plan = self.scheduler.schedule()
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
        except Exception as exc:  # a failed step fails its requests, never the engine
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
        rows, groups = self._sampling_rows(entries)
        self._sample(entries, rows, groups, logits, outputs)
        for hook in self.on_step:
            hook(plan)
        if self.settings.debug_audit:
            audit(self.pool).raise_if_bad()
        return list(outputs.values())

    def _sampling_rows(self, entries: list[ScheduledSeq]) -> tuple[dict[TokenSequence, int],
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
                forks = self._fork(req)
                rows.update({f.seq: rows[req.seqs[0]] for f in forks})
                group += forks
        return rows, list(by_request.values())

    def _sample(self, entries: list[ScheduledSeq], rows: dict[TokenSequence, int],
                groups: list[list[ScheduledSeq]], logits: torch.Tensor, outputs: dict[str, RequestOutput]) -> None:
        """Choose every sampling row's token on the device (`StepChoices`), then bring all choices,
        their log-probs and beam search's candidates to the host in the step's one download."""
        now = time.monotonic()
        plain: list[tuple[Request, TokenSequence, int]] = []
        beams: list[tuple[Request, list[int]]] = []
        for group in groups:
            req = group[0].req
            if req.params.beam_width > 1:
                beams.append((req, [rows[e.seq] for e in group]))
            else:
                plain.extend((req, entry.seq, rows[entry.seq]) for entry in group)
        constrained = [(seq, row) for _, seq, row in plain if self.grammars.constrained(seq)]
        if constrained:  # before anything reads the logits: the grammar's -inf rule them all
            bitmask = self.runner.transfers.upload_bitmask(self.grammars.masks(constrained, logits.shape[0]))
            self.grammars.apply(logits, bitmask, sorted({row for _, row in constrained}))
        argmax = logits.argmax(dim=-1)
        pack = DownloadPack()
        pack.add("argmax", argmax)
        choices = StepChoices(plain, logits, argmax, pack, self._penalties, sample, self._generator)
        candidates = [beam_candidates(torch.stack([logits[r] for r in beam_rows]), self._beam(req).candidates)
                      for req, beam_rows in beams]
        for i, (values, ids) in enumerate(candidates):
            pack.add(f"beam{i}.values", values)
            pack.add(f"beam{i}.ids", ids)
        host = self.runner.transfers.download(pack.packed())
        for i, ((req, _), (values, _)) in enumerate(zip(beams, candidates, strict=True)):
            width = values.shape[1]
            flat_values, flat_ids = pack.segment(host, f"beam{i}.values"), pack.segment(host, f"beam{i}.ids")
            self._beam_step(req, [flat_values[j: j + width] for j in range(0, len(flat_values), width)],
                            [[int(t) for t in flat_ids[j: j + width]] for j in range(0, len(flat_ids), width)],
                            outputs)
        for (req, seq, _), (token, logprob) in zip(plain, choices.read(host), strict=True):
            complete = self.grammars.constrained(seq) and self.grammars.accept(seq, token)
            self._append_token(req, seq, token, now, outputs, logprob, complete)
        for req in dict.fromkeys(e.req for e in entries):
            if not req.finished and not req.live_seqs:
                outputs[req.request_id] = self._merge(outputs.get(req.request_id), self._finish(req))

    def _fork(self, req: Request) -> list[ScheduledSeq]:
        """n > 1: after the prompt's first token is due, the other samples fork its table (the
        prompt's blocks are shared, the last partial one is copied on write), its penalty counts
        and its grammar state. They sample from the first sample's row of logits, each with its
        own generator."""
        req.forked = True
        seq0 = req.seqs[0]
        assert seq0.table is not None
        forks = []
        for child in range(1, req.params.n):
            fork = TokenSequence(child, list(seq0.tokens), seq0.prompt_len,
                            table=seq0.table.fork(owner=f"{req.request_id}/{child}"), num_computed=seq0.num_computed)
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
            if seq.table is not None and not (req.keep_table and seq.index == 0):
                seq.table.release()
                seq.table = None
        out = outputs.setdefault(req.request_id, RequestOutput(req.request_id))
        out.deltas.append(SeqDelta(seq.index, [token], text, [logprob] if logprob is not None else None))

    def _beam(self, req: Request) -> BeamSearch:
        search = self._beams.get(req.request_id)
        if search is None:
            search = self._beams[req.request_id] = BeamSearch(
                req.params.beam_width, req.params.length_penalty, req.params.max_tokens,
                self._stop_ids(req.params))
        return search

    def _beam_step(self, req: Request, values: list[list[float]], ids: list[list[int]],
                   outputs: dict[str, RequestOutput]) -> None:
        search = self._beam(req)
        beams = req.live_seqs
        choices = search.step(values, ids, [s.cum_logprob for s in beams], [s.output_ids for s in beams])
        if req.first_token is None:
            req.first_token = time.monotonic()
        snapshots = [list(s.tokens) for s in beams]
        reused: set[int] = set()
        next_beams: list[TokenSequence] = []
        for i, choice in enumerate(choices):
            parent = beams[choice.parent]
            if choice.parent not in reused:
                reused.add(choice.parent)
                parent.tokens.append(choice.token)
                child = parent
            else:
                assert parent.table is not None
                child = TokenSequence(i, snapshots[choice.parent] + [choice.token], parent.prompt_len,
                                 table=parent.table.fork(owner=f"{req.request_id}/b"),
                                 num_computed=parent.num_computed)
            child.cum_logprob = choice.score
            next_beams.append(child)
        for pos, beam in enumerate(beams):
            if pos not in reused:
                beam.finish_reason = FinishReason.STOP
                if beam.table is not None:
                    beam.table.release()
                    beam.table = None
        for i, beam in enumerate(next_beams):
            beam.index = i
            if beam.table is not None:
                beam.table.owner = f"{req.request_id}/{i}"
        req.seqs = next_beams
        if search.done:
            for beam in next_beams:
                beam.finish_reason = FinishReason.STOP
        outputs.setdefault(req.request_id, RequestOutput(req.request_id))

    # ----- finishing ---------------------------------------------------------------------------
    def _finish(self, req: Request) -> RequestOutput:
        """The one exit path: hand a session its table, release the rest through the scheduler,
        then report."""
        self._hand_back_table(req)
        self.scheduler.remove(req)
        self._penalties.release(req)
        for seq in req.seqs:
            self.grammars.release(seq)
        self.requests.pop(req.request_id, None)
        req.finished_at = time.monotonic()
        out = RequestOutput(req.request_id, finished=True, error=req.error, error_code=req.error_code)
        search = self._beams.pop(req.request_id, None)
        if search is not None and search.results():
            for i, hyp in enumerate(search.results()):
                text = self.tokenizer.decode(hyp.token_ids, skip_special_tokens=True)
                reason = FinishReason.STOP if hyp.token_ids and hyp.token_ids[-1] in search.stop_ids \
                    else FinishReason.LENGTH
                out.outputs.append(CompletedSeq(i, text, hyp.token_ids, reason))
        else:
            for seq in req.seqs:
                detok = self._detok.pop(seq, None)
                self._generators.pop(seq, None)
                text = detok.text if detok is not None else ""
                reason = seq.finish_reason or FinishReason.CANCELLED
                out.outputs.append(CompletedSeq(seq.index, text, seq.output_ids, reason,
                                                list(seq.logprobs) if req.params.logprobs else None))
        for seq in req.seqs:
            self._detok.pop(seq, None)
            self._generators.pop(seq, None)
        completion = sum(len(o.token_ids) for o in out.outputs)
        out.usage = Usage(len(req.prompt), req.cached_tokens, completion, req.cached_disk_tokens)
        start = req.arrival
        gaps = [1000 * (b - a) for a, b in zip(req.token_times, req.token_times[1:])]
        out.timings = Timings(
            queue_ms=1000 * ((req.first_scheduled or req.finished_at) - start),
            ttft_ms=1000 * (req.first_token - start) if req.first_token is not None else None,
            total_ms=1000 * (req.finished_at - start),
            inter_token_ms=gaps,
        )
        return out

    @staticmethod
    def _hand_back_table(req: Request) -> None:
        """A session's request (`keep_table`) keeps its first sample's table, the turn's whole KV,
        for the session to pin; not when it failed (an error), nor when it never ran."""
        if not req.keep_table or req.kept_table is not None:
            return
        for seq in req.seqs:
            if seq.index == 0 and seq.table is not None and seq.finish_reason not in (None, FinishReason.ERROR):
                req.kept_table, seq.table = seq.table, None
                return

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
