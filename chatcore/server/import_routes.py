"""`POST /v1/sessions/import`: a new session holding a conversation exported before (the web UI's
JSON export, or any list of complete exchanges).

The exchanges are stored as turns (finish reason `stop`, no statistics: nothing was generated
here) and the session's canonical tokens are the chat template's rendering of the history, so the
next turn extends it as it extends any other history (prefix-stable templates), and the context
policy windows it like any long chat. No KV exists for it yet: the first turn computes the whole
prompt once. The chain is saved with the turns, so a restart before the session goes cold still
finds the history."""

from __future__ import annotations

from typing import Any

from litestar import post

from chatcore.outcomes import FinishReason
from chatcore.server.auth import Principal
from chatcore.server.bodies import ImportedMessage, ImportSession
from chatcore.server.errors import ApiError
from chatcore.server.services import Services
from chatcore.sessions.state import SessionState
from chatcore.store.repos import Repos

MAX_TOTAL_CHARS = 2_000_000
# The body is read whole, so the character limit answers (413 too_large) rather than the server's
# smaller default body limit, which refuses before reading and breaks the client's upload.
MAX_BODY_BYTES = 4 * MAX_TOTAL_CHARS


def _messages(raw: list[ImportedMessage]) -> list[dict[str, str]]:
    """Complete exchanges only: user, assistant, user, assistant…"""
    if len(raw) % 2:
        raise ApiError("bad_request", "messages must be whole exchanges (a user message, then its answer)")
    for i, m in enumerate(raw):
        expected = "user" if i % 2 == 0 else "assistant"
        if m.role != expected:
            raise ApiError("bad_request", f"messages[{i}] must be {{\"role\": \"{expected}\", \"content\": string}}")
    total = sum(len(m.content) for m in raw)
    if total > MAX_TOTAL_CHARS:
        raise ApiError("too_large", f"the messages hold {total} characters; the limit is {MAX_TOTAL_CHARS}")
    return [{"role": m.role, "content": m.content} for m in raw]


@post("/v1/sessions/import", status_code=201, request_max_body_size=MAX_BODY_BYTES)
async def import_session(data: ImportSession, services: Services, principal: Principal) -> dict[str, Any]:
    title = data.title or "Imported chat"
    system_prompt = data.system_prompt or None
    messages = _messages(data.messages)
    manager = services.sessions
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
    async with state.lock:
        history = [*state.messages, *messages]
        tokens = await manager.tokenize(lambda: manager.template.render(history, generation_prompt=False))
        async with services.sessionmaker() as db, db.begin():
            repos = Repos(db)
            for m in messages:
                await repos.turns.add_turn(state.id, m["role"], m["content"], [],
                                           finish_reason=FinishReason.STOP if m["role"] == "assistant" else None)
            await manager.save_chain(repos, state, tokens, num_computed=0)
        state.messages = history
        state.tokens = list(tokens)
        state.turn_count = len(messages)
