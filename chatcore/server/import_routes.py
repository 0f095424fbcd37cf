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

from litestar import Request, post

from chatcore.outcomes import FinishReason
from chatcore.server.errors import ApiError
from chatcore.server.services import Services
from chatcore.server.session_routes import MAX_SYSTEM_PROMPT, MAX_TITLE, _optional_text
from chatcore.sessions.state import SessionState
from chatcore.store.repos import Repos

MAX_MESSAGES = 2000
MAX_TOTAL_CHARS = 2_000_000


def _messages(data: dict[str, Any]) -> list[dict[str, str]]:
    """Complete exchanges only: user, assistant, user, assistant… each `{"role", "content"}`."""
    raw = data.get("messages")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_MESSAGES or len(raw) % 2:
        raise ApiError("bad_request", f"messages must be a list of 2 to {MAX_MESSAGES} messages, "
                                      "whole exchanges (a user message, then its answer)")
    out: list[dict[str, str]] = []
    total = 0
    for i, m in enumerate(raw):
        expected = "user" if i % 2 == 0 else "assistant"
        if not isinstance(m, dict) or set(m) - {"role", "content"} or m.get("role") != expected:
            raise ApiError("bad_request", f"messages[{i}] must be {{\"role\": \"{expected}\", \"content\": string}}")
        content = m.get("content")
        if not isinstance(content, str):
            raise ApiError("bad_request", f"messages[{i}].content must be a string")
        total += len(content)
        out.append({"role": expected, "content": content})
    if total > MAX_TOTAL_CHARS:
        raise ApiError("too_large", f"the messages hold {total} characters; the limit is {MAX_TOTAL_CHARS}")
    return out


@post("/v1/sessions/import", status_code=201)
async def import_session(request: Request[Any, Any, Any], data: dict[str, Any]) -> dict[str, Any]:
    principal = await request.app.state.auth.principal(request)
    if not isinstance(data, dict):
        raise ApiError("bad_request", "the body must be a JSON object")
    unknown = sorted(set(data) - {"title", "system_prompt", "messages"})
    if unknown:
        raise ApiError("bad_request", f"unknown fields: {', '.join(unknown)}")
    title = _optional_text(data, "title", MAX_TITLE) or "Imported chat"
    system_prompt = _optional_text(data, "system_prompt", MAX_SYSTEM_PROMPT) or None
    messages = _messages(data)
    services: Services = request.app.state.services
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
