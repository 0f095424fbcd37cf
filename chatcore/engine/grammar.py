"""The callers' half of grammar-constrained decoding for `response_format` (JSON, or JSON that a schema
validates), by xgrammar: parsing a `response_format`, compiling it into a grammar, caching compiled
grammars and refusing what cannot be used. The engine's half, each sequence's matcher and its masks,
is `GrammarMatchers` (chatcore/engine/grammar_matchers.py), which only the engine holds; callers reach
this half through `InferenceEngine.grammar_compiler`.

No grammar that allows no first token is ever compiled for a request (`GrammarError`): such a
schema (say `{"allOf": [{"$ref": "#"}]}`) is refused at once, not after its request is admitted.

Compiling needs the tokenizer's vocabulary (built once, lazily: about half a second) and each
schema once. The server compiles a client's schema with `compile_async`, on the compile pool, and
the request carries the result (`ResponseFormat.compiled`) to the engine thread, which then never
compiles a client's schema itself (`compile` there serves only callers of the engine alone).

The compile pool (invariants):
- a compile runs on its own (daemon) thread at once, or is refused (`GrammarBusy`): at most `threads` run,
  and one owner (a tenant) holds at most half of them (at least one), so one tenant's schemas never
  make another's wait. Nothing queues behind a slow compile;
- its threads run at a lower CPU priority (nice 10 on Linux) than the engine and the event loop;
- the same schema compiling already is awaited, not compiled twice, and takes no second thread;
- a caller waits at most `timeout_s`, then gets `GrammarError`. xgrammar compiles in C++ and
  cannot be interrupted: the compile runs on to its end in the background, and keeps its thread
  (and its owner's share) until then, so the threads bound the compile work in flight, abandoned
  or not. Its result lands in the cache, where a later request for the same schema finds it;
- compiled grammars are kept for reuse by `GrammarCache` (chatcore/engine/grammar_cache.py), keyed by the
  kind and the canonical schema, within `cache_bytes` of the memory they hold as measured (xgrammar's own
  cache, which under-counts it about 50x for large enums, is off), least recently used first out; a grammar
  evicted while a request holds it counts against `cache_bytes` until that request lets it go;
- what is not in that bound, bounded elsewhere: the grammars compiling (at most `threads`, each at most
  the size the schema limits allow: ~10 MB measured at 32 KB), and grammars held by requests beyond
  `cache_bytes` (one per turn: `max_turns_per_tenant` per tenant).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import xgrammar

from chatcore.engine.grammar_cache import GrammarCache
from chatcore.engine.schema_limits import SchemaLimits
from chatcore.outcomes import ErrorCode

COMPILE_NICE = 10  # compile threads' niceness: the engine thread and the event loop come first
# xgrammar's messages start with a time and its C++ source position: "[16:42:47] /project/cpp/x.cc:94: ".
SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """`json_schema`: JSON the schema validates; `tool_call`: one `<tool_call>` block (chatcore/server/tools.py)
    whose JSON the schema validates; `json_object`: any JSON object."""

    kind: Literal["json_object", "json_schema", "tool_call"]
    schema: str | None = None  # the schema as canonical JSON text (sorted keys)
    # The grammar compiled by `GrammarCompiler.compile_async`, carried to the engine thread with the request.
    compiled: xgrammar.CompiledGrammar | None = field(default=None, compare=False, hash=False, repr=False)


class GrammarError(ValueError):
    """A schema the grammar compiler cannot turn into a grammar (or not within the time limit). Its message
    names the field the schema came in, as a client sees it."""

    code = ErrorCode.BAD_REQUEST

    def __init__(self, reason: str) -> None:
        super().__init__(f"response_format: {reason}")


class GrammarBusy(Exception):
    """No compile thread is free for this owner right now: try again in a moment."""

    code = ErrorCode.BUSY


@dataclass(frozen=True, slots=True)
class CompilePolicy:
    threads: int = 1  # compiles running at once at most
    timeout_s: float = 10.0  # how long a caller waits for its compile
    cache_bytes: int = 64 << 20  # memory of compiled grammars kept for reuse, as `GrammarCache` counts it (0: none)


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int],
                 policy: CompilePolicy = CompilePolicy()) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._policy = policy
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._cache = GrammarCache(policy.cache_bytes)
        # Compiles in flight (event loop only), each with its owner; finished ones leave at once.
        self._running: dict[ResponseFormat, tuple[asyncio.Future[xgrammar.CompiledGrammar], str]] = {}

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgrammar.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                               stop_token_ids=self._stop_token_ids)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    async def compile_async(self, fmt: ResponseFormat, owner: str) -> ResponseFormat:
        """`fmt` with its compiled grammar, compiled on the pool (see the module's invariants; call it on
        the event loop). Raises `GrammarBusy` when `owner` may start no compile now, `GrammarError` for
        a schema that cannot be used or did not compile within the time limit."""
        if fmt.compiled is not None:
            return fmt
        running = self._running.get(fmt)
        future = running[0] if running is not None else self._start(fmt, owner)
        try:
            compiled = await asyncio.wait_for(asyncio.shield(future), self._policy.timeout_s)
        except TimeoutError:
            raise GrammarError(f"the JSON schema did not compile within {self._policy.timeout_s:g} s (the limit, "
                               "grammar_compile_timeout_s); simplify it (fewer or simpler patterns, smaller "
                               "enums, less nesting)") from None
        return replace(fmt, compiled=compiled)

    def _start(self, fmt: ResponseFormat, owner: str) -> asyncio.Future[xgrammar.CompiledGrammar]:
        threads = self._policy.threads
        share = max(1, threads // 2)
        if len(self._running) >= threads:
            raise GrammarBusy(f"all {threads} grammar compile threads are busy; retry in a moment")
        if Counter(o for _, o in self._running.values())[owner] >= share:
            raise GrammarBusy(f"the tenant already compiles {share} response_format schemas at once (half the "
                              "grammar_compile_threads); retry when one is done")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[xgrammar.CompiledGrammar] = loop.create_future()
        self._running[fmt] = (future, owner)
        future.add_done_callback(lambda _: self._running.pop(fmt))
        # A daemon thread: a compile left running never holds up the process's exit.
        threading.Thread(target=self._compile_into, args=(fmt, future, loop), name="chatcore-grammar",
                         daemon=True).start()
        return future

    @property
    def compiling(self) -> int:
        """Compiles in flight, abandoned ones included (event loop only)."""
        return len(self._running)

    @property
    def cache_size_bytes(self) -> int:
        """The memory of the compiled grammars alive that the cache counts (kept, or evicted and still held by
        a request): within `cache_bytes` unless requests alone hold more."""
        return self._cache.size_bytes

    def _compile_into(self, fmt: ResponseFormat, future: asyncio.Future[xgrammar.CompiledGrammar],
                      loop: asyncio.AbstractEventLoop) -> None:
        """A compile thread's work: the result (or the error) goes to the event loop's future."""
        _lower_priority()
        try:
            result: xgrammar.CompiledGrammar | Exception = self.compile(fmt)
        except Exception as exc:  # handed to the waiting request, which reports it
            result = exc
        try:
            loop.call_soon_threadsafe(_settle, future, result)
        except RuntimeError:  # the loop is closed (the server stopped): nobody waits for it
            pass

    def compile(self, fmt: ResponseFormat) -> xgrammar.CompiledGrammar:
        """Compile now, on this thread (or find it in the cache)."""
        key = (fmt.kind, fmt.schema)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
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
        if not self._allows_a_first_token(compiled):
            raise GrammarError("the JSON schema cannot be used: no output satisfies it (it allows no first token; "
                               "a schema that refers only to itself, or whose constraints contradict, does this)")
        return self._cache.put(key, compiled)

    def _allows_a_first_token(self, compiled: xgrammar.CompiledGrammar) -> bool:
        bitmask = xgrammar.allocate_token_bitmask(1, self._vocab_size)
        xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any())


def _settle(future: asyncio.Future[xgrammar.CompiledGrammar], result: xgrammar.CompiledGrammar | Exception) -> None:
    """On the event loop. The error of a compile nobody waits for any more is taken here, unlogged."""
    if future.done():  # cancelled as the loop shut down
        return
    if isinstance(result, Exception):
        future.set_exception(result)
        future.exception()
    else:
        future.set_result(result)


def _lower_priority() -> None:
    """Run this thread below the engine's priority. On Linux a thread's native id names that thread alone to
    setpriority (elsewhere it could name another process: leave those alone)."""
    if sys.platform == "linux":
        thread = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread, max(COMPILE_NICE, os.getpriority(os.PRIO_PROCESS, thread)))


def _literal(text: str) -> xgrammar.Grammar:
    return xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def parse_response_format(raw: Any, limits: SchemaLimits | None = None) -> ResponseFormat | None:
    """OpenAI's `response_format`: {"type": "text"} (None), {"type": "json_object"}, or {"type":
    "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}. Raises
    ValueError with a message a client can act on; a client's schema is checked against `limits`
    (None: a trusted caller, the engine alone)."""
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
    schema = raw["json_schema"]["schema"]
    if limits is not None:
        limits.check([("response_format.json_schema.schema", schema)])
    return ResponseFormat("json_schema", json.dumps(schema, sort_keys=True))
