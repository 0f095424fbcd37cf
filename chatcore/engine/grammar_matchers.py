"""The engine's half of grammar-constrained decoding: each constrained sequence's xgrammar matcher, its
masks and its accepted tokens. Only the engine holds it (`EngineCore.grammars`), and only the engine
thread touches it; callers compile through the other half (`GrammarCompiler`, chatcore/engine/grammar.py)
and the request carries the compiled grammar here.

Invariants:
- a constrained sequence only ever samples a token its grammar accepts: each step, every row of a
  constrained sequence gets its matcher's allowed-token bitmask, built on the host, uploaded in
  one tensor and applied to the logits on the device before any sampling or penalty;
- after the step's download, each chosen token advances its sequence's matcher; once the matcher
  has accepted a stop token (the JSON is complete), the sequence ends with `stop`;
- a step's masks are filled by one batch call per tenant (xgrammar fills them in C++, on the
  engine's threads), timed for the tenant's account (chatcore/engine/mask_budget.py). A row whose
  matcher raises, or whose mask allows no token at all, is reported (`MaskFill.failed`) for its
  request to fail alone; the other rows are masked as usual. A mask that allows no token is the
  client's schema at a dead end (a grammar that allowed a first token was compiled, but no output
  completes it): `bad_request`; a matcher that raises is `internal`;
- a matcher lives exactly as long as its sequence (`admit`/`fork`, `release`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xgrammar

from chatcore.engine.errors import describe_failure
from chatcore.engine.grammar import ResponseFormat
from chatcore.outcomes import ErrorCode

DEAD_END = ("the response_format schema allows no output to be completed: after the tokens generated so far "
            "its grammar allows no next token (a schema that refers only to itself, or whose constraints "
            "contradict, does this)")


@dataclass(slots=True)
class MaskFill:
    """A step's masks: the host bitmask [rows, vocab / 32] (rows not filled allow every token), each
    owner's fill time in ms, and why each failed sequence has no mask (its error code and message)."""

    bitmask: torch.Tensor
    took_ms: dict[str, float]
    failed: dict[object, tuple[ErrorCode, str]]


class GrammarMatchers:
    def __init__(self, vocab_size: int, compile_now: Callable[[ResponseFormat], xgrammar.CompiledGrammar]) -> None:
        """`compile_now`: compiles a format that arrives uncompiled, which only a caller of the engine alone
        sends (the server compiles every client's on its compile pool): `GrammarCompiler.compile`."""
        self._vocab_size = vocab_size
        self._compile_now = compile_now
        self._matchers: dict[object, xgrammar.GrammarMatcher] = {}  # by sequence
        self._batchers: dict[int, xgrammar.BatchGrammarMatcher] = {}  # by thread count

    def admit(self, seq: object, fmt: ResponseFormat) -> None:
        compiled = fmt.compiled if fmt.compiled is not None else self._compile_now(fmt)
        self._matchers[seq] = xgrammar.GrammarMatcher(compiled)

    def fork(self, parent: object, child: object) -> None:
        matcher = self._matchers.get(parent)
        if matcher is not None:
            self._matchers[child] = matcher.fork()

    def release(self, seq: object) -> None:
        self._matchers.pop(seq, None)

    def constrained(self, seq: object) -> bool:
        return seq in self._matchers

    @property
    def active(self) -> bool:
        """Whether any sequence is constrained now."""
        return bool(self._matchers)

    def masks(self, groups: dict[str, list[tuple[object, int]]], num_rows: int, threads: int) -> MaskFill:
        """The masks of a step's (sequence, row of logits) pairs, grouped by owner: one batch call an owner,
        on up to `threads` threads. Where a batch call raises, its rows are filled one by one, so that
        only the failing ones fail."""
        bitmask = xgrammar.allocate_token_bitmask(num_rows, self._vocab_size)
        fill = MaskFill(bitmask, {}, {})
        for owner, rows in groups.items():
            start = time.perf_counter()
            try:
                self._batcher(min(threads, len(rows))).batch_fill_next_token_bitmask(
                    [self._matchers[seq] for seq, _ in rows], bitmask, [row for _, row in rows])
            except Exception:  # find the rows that fail; the others are filled
                for seq, row in rows:
                    try:
                        self._matchers[seq].fill_next_token_bitmask(bitmask, row)
                    except Exception as exc:
                        fill.failed[seq] = (ErrorCode.INTERNAL,
                                            f"the response_format grammar failed: {describe_failure(exc)}")
            fill.took_ms[owner] = 1000 * (time.perf_counter() - start)
        pairs = [pair for rows in groups.values() for pair in rows]
        allows = bitmask[[row for _, row in pairs]].any(dim=1).tolist()  # one host op for every row
        for (seq, _), allowed in zip(pairs, allows, strict=True):
            if seq not in fill.failed and not allowed:
                fill.failed[seq] = (ErrorCode.BAD_REQUEST, DEAD_END)
        return fill

    def _batcher(self, threads: int) -> xgrammar.BatchGrammarMatcher:
        batcher = self._batchers.get(threads)
        if batcher is None:
            batcher = self._batchers[threads] = xgrammar.BatchGrammarMatcher(max_threads=threads)
        return batcher

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Disallowed tokens of `rows` get -inf, in place (bitmask already on the logits' device)."""
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)

    def accept(self, seq: object, token: int) -> bool:
        """Advance the sequence's matcher; True once its output is complete (a stop token accepted)."""
        matcher = self._matchers[seq]
        if not matcher.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")
        return matcher.is_terminated()
