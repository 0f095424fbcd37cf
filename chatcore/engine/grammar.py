"""Grammar-constrained decoding for `response_format` (JSON, or JSON that a schema validates), by xgrammar.

Invariants:
- a constrained sequence only ever samples a token its grammar accepts: each step, every row of a
  constrained sequence gets its matcher's allowed-token bitmask, built on the host, uploaded in
  one tensor and applied to the logits on the device before any sampling or penalty;
- after the step's download, each chosen token advances its sequence's matcher; once the matcher
  has accepted a stop token (the JSON is complete), the sequence ends with `stop`;
- a matcher lives exactly as long as its sequence (`admit`/`fork`, `release`).

Compiling needs the tokenizer's vocabulary (built once, lazily: about half a second) and each
schema once (cached); both happen on whichever thread asks first, so the server compiles a
client's schema while validating it, and the engine thread finds it cached.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import torch
import xgrammar

COMPILED_CACHE = 64
# xgrammar's messages start with a time and its C++ source position: "[16:42:47] /project/cpp/x.cc:94: ".
SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """`json_schema`: JSON the schema validates; `tool_call`: one `<tool_call>` block (chatcore/server/tools.py)
    whose JSON the schema validates; `json_object`: any JSON object."""

    kind: Literal["json_object", "json_schema", "tool_call"]
    schema: str | None = None  # the schema as canonical JSON text (sorted keys)


class GrammarError(ValueError):
    """A schema the grammar compiler cannot turn into a grammar."""


class Grammars:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiled: OrderedDict[ResponseFormat, xgrammar.CompiledGrammar] = OrderedDict()
        self._matchers: dict[object, xgrammar.GrammarMatcher] = {}  # by sequence

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                               stop_token_ids=self._stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, fmt: ResponseFormat) -> xgrammar.CompiledGrammar:
        with self._lock:
            compiled = self._compiled.get(fmt)
            if compiled is not None:
                self._compiled.move_to_end(fmt)
                return compiled
        compiler = self._get_compiler()
        try:
            if fmt.kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif fmt.kind == "json_schema":
                assert fmt.schema is not None
                compiled = compiler.compile_json_schema(fmt.schema, any_whitespace=False, strict_mode=True)
            else:
                assert fmt.schema is not None
                compiled = compiler.compile_grammar(xgrammar.Grammar.concat(
                    _literal(TOOL_CALL_OPEN),
                    xgrammar.Grammar.from_json_schema(fmt.schema, any_whitespace=False, strict_mode=True),
                    _literal(TOOL_CALL_CLOSE)))
        except Exception as exc:  # xgrammar raises RuntimeError (and others) for what it cannot compile
            lines = str(exc).strip().splitlines()
            reason = SOURCE_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
            raise GrammarError(f"the JSON schema cannot be used: {reason}") from exc
        with self._lock:
            self._compiled[fmt] = compiled
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return compiled

    # ----- sequences (engine thread) ------------------------------------------------------
    def admit(self, seq: object, fmt: ResponseFormat) -> None:
        self._matchers[seq] = xgrammar.GrammarMatcher(self.compile(fmt))

    def fork(self, parent: object, child: object) -> None:
        matcher = self._matchers.get(parent)
        if matcher is not None:
            self._matchers[child] = matcher.fork()

    def release(self, seq: object) -> None:
        self._matchers.pop(seq, None)

    def constrained(self, seq: object) -> bool:
        return seq in self._matchers

    def masks(self, rows: list[tuple[object, int]], num_rows: int) -> torch.Tensor:
        """The host bitmask [num_rows, vocab / 32] (int32) for the given (sequence, row) pairs;
        other rows allow every token."""
        bitmask = xgrammar.allocate_token_bitmask(num_rows, self._vocab_size)
        for seq, row in rows:
            self._matchers[seq].fill_next_token_bitmask(bitmask, row)
        return bitmask

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


def _literal(text: str) -> xgrammar.Grammar:
    return xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def parse_response_format(raw: Any) -> ResponseFormat | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or {"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}. Raises
    ValueError with a message a client can act on."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ValueError("response_format must be an object with a 'type'")
    kind = raw["type"]
    if kind == "text":
        extra = set(raw) - {"type"}
    elif kind == "json_object":
        extra = set(raw) - {"type"}
    elif kind == "json_schema":
        extra = set(raw) - {"type", "json_schema"}
        spec = raw.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema' object")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ValueError(f"unknown response_format.json_schema fields: {', '.join(sorted(unknown))}")
        if "name" in spec and not isinstance(spec["name"], str):
            raise ValueError("response_format.json_schema.name must be a string")
    else:
        raise ValueError("response_format.type must be 'text', 'json_object' or 'json_schema'")
    if extra:
        raise ValueError(f"unknown response_format fields: {', '.join(sorted(extra))}")
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    return ResponseFormat("json_schema", json.dumps(raw["json_schema"]["schema"], sort_keys=True))
