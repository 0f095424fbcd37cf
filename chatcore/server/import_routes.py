"""`POST /v1/sessions/import`: a new session holding a conversation exported before (the web UI's
JSON export, or any list of complete exchanges).

The exchanges are stored as turns (finish reason `stop`, no statistics: nothing was generated
here) and the session's canonical tokens are the chat template's rendering of the history, so the
next turn extends it as it extends any other history (prefix-stable templates), and the context
policy windows it like any long chat. No KV exists for it yet: the first turn computes the whole
prompt once. The chain is saved with the turns, so a restart before the session goes cold still
finds the history.

What an import may cost is bounded, as a turn's is: its history at most `import_context_multiple`
contexts in tokens (8 characters a token checked before tokenizing, so an oversized body never
reaches the tokenizer), the tenant's stored characters at most `max_stored_chars_per_tenant` (the
store quota every write passes, chatcore/sessions/quota.py), and
each import takes a slot of its tenant's `max_turns_per_tenant` and one of the server's
`max_concurrent_imports` before it awaits the tokenizer thread, which every turn shares."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from litestar import post

from chatcore.outcomes import ErrorCode, FinishReason
from chatcore.server.auth import Principal
from chatcore.server.bodies import ImportedMessage, ImportSession
from chatcore.server.errors import ApiError
from chatcore.server.services import Services
from chatcore.sessions.state import SessionState
from chatcore.store.repos import Repos

MAX_TOTAL_CHARS = 2_000_000  # whatever the context: the body limit below is fixed when the route is built
CHARS_PER_TOKEN = 8  # the character bound checked before tokenizing (English averages about 4 a token)
# The body is read whole, so the character limit answers (413 too_large) rather than the server's
# smaller default body limit, which refuses before reading and breaks the client's upload.
MAX_BODY_BYTES = 4 * MAX_TOTAL_CHARS


def _messages(raw: list[ImportedMessage]) -> list[dict[str, str]]:
    """Complete exchanges only: user, assistant, user, assistant…"""
    if len(raw) % 2:
        raise ApiError(ErrorCode.BAD_REQUEST, "messages must be whole exchanges (a user message, then its answer)")
    for i, m in enumerate(raw):
        expected = "user" if i % 2 == 0 else "assistant"
        if m.role != expected:
            raise ApiError(ErrorCode.BAD_REQUEST,
                           f"messages[{i}] must be {{\"role\": \"{expected}\", \"content\": string}}")
    return [{"role": m.role, "content": m.content} for m in raw]


def import_limits(services: Services) -> tuple[int, int]:
    """The largest import, in tokens and in characters (`import_context_multiple` contexts)."""
    tokens = int(services.settings.import_context_multiple * services.engine.info.max_context)
    return tokens, min(MAX_TOTAL_CHARS, tokens * CHARS_PER_TOKEN)


def _check_size(services: Services, data: ImportSession) -> None:
    """Characters, before anything is tokenized or stored."""
    _, max_chars = import_limits(services)
    total = len(data.system_prompt or "") + sum(len(m.content) for m in data.messages)
    if total > max_chars:
        raise ApiError(ErrorCode.TOO_LARGE,
                       f"the import holds {total} characters; the limit is {max_chars} "
                       f"({services.settings.import_context_multiple:g} contexts)")


@contextmanager
def _slots(services: Services, tenant_id: str) -> Iterator[None]:
    """One of the tenant's turn slots and one of the server's import slots, or `busy`. Taken before the
    first await: an import waits for the tokenizer thread that every turn shares, so neither a tenant
    nor the server may queue many of them there."""
    imports_limit = services.settings.max_concurrent_imports
    if services.imports_running >= imports_limit:
        raise ApiError(ErrorCode.BUSY, f"{imports_limit} imports are running (max_concurrent_imports); retry later")
    with services.sessions.slots.hold(tenant_id, 1):
        services.imports_running += 1
        try:
            yield
        finally:
            services.imports_running -= 1


@post("/v1/sessions/import", status_code=201, request_max_body_size=MAX_BODY_BYTES)
async def import_session(data: ImportSession, services: Services, principal: Principal) -> dict[str, Any]:
    title = data.title or "Imported chat"
    system_prompt = data.system_prompt or None
    messages = _messages(data.messages)
    _check_size(services, data)
    manager = services.sessions
    adding = sum(len(m["content"]) for m in messages)  # the store quota; the system prompt is `create`'s
    with _slots(services, principal.tenant_id):
        async with manager.quota.hold(principal.tenant_id, adding, "the import"):
            state, token = await manager.create(principal.tenant_id, system_prompt=system_prompt, title=title)
            try:
                await _fill(services, state, messages)
            except BaseException:
                await manager.delete(principal.tenant_id, state.id)  # no half-imported session stays
                raise
    return {"id": state.id, "resume_token": token, "title": state.title, "system_prompt": state.system_prompt,
            "turns": len(messages) // 2, "history_tokens": len(state.tokens)}


async def _fill(services: Services, state: SessionState, messages: list[dict[str, str]]) -> None:
    """The turns, the chain and the in-memory history of a session just created (nothing runs in it yet)."""
    manager = services.sessions
    max_tokens, _ = import_limits(services)
    async with state.lock:
        history = [*state.messages, *messages]
        tokens = await manager.tokenize(state.tenant_id,
                                        lambda: manager.template.render(history, generation_prompt=False))
        if len(tokens) > max_tokens:
            raise ApiError(ErrorCode.TOO_LARGE,
                           f"the import is {len(tokens)} tokens; the limit is {max_tokens} "
                           f"({services.settings.import_context_multiple:g} contexts of "
                           f"{services.engine.info.max_context})")
        async with services.sessionmaker() as db, db.begin():
            repos = Repos(db)
            for m in messages:
                await repos.turns.add_turn(state.id, m["role"], m["content"], [],
                                           finish_reason=FinishReason.STOP if m["role"] == "assistant" else None)
            await manager.save_chain(repos, state, tokens, num_computed=0)
        state.messages = history
        state.tokens = list(tokens)
        state.turn_count = len(messages)
