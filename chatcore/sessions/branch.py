"""Branching a session: a new session that starts with the first exchanges of another.

Regenerating an answer, or editing a message and resending it, branches the conversation: the
original stays as it was, and a new session holds its first `k` complete exchanges, ready for the
new turn. The branch's canonical tokens are the original's own up to the end of exchange `k`
(each exchange's stored user tokens, its generated ids and the template's end-of-turn tokens), so
the branch's next turn finds the original's KV blocks by hash (same tenant scope) and computes
only the new message. Where the stored tokens cannot rebuild that prefix exactly (the original's
view was truncated, its template re-renders, another model wrote it), the branch re-renders its
messages instead, and its first turn computes them once.

A branch copies stored text, so it counts against the tenant's store quota
(chatcore/sessions/quota.py): one that would pass it is refused before anything is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from chatcore.sessions.state import HISTORY_REASONS, SessionState
from chatcore.sessions.template import ChatTemplate
from chatcore.sessions.window import exchanges
from chatcore.store.models import Turn
from chatcore.store.packing import unpack_ids
from chatcore.store.repos import Repos

if TYPE_CHECKING:
    from chatcore.sessions.manager import SessionManager

MAX_TITLE = 200


class BadBranch(ValueError):
    """A branch point outside the session's complete exchanges."""


def _exchange_rows(turns: list[Turn]) -> list[tuple[Turn, Turn]]:
    """The (user, assistant) rows of the complete exchanges, in order (as `SessionManager._read` keeps them)."""
    pairs, user = [], None
    for turn in turns:
        if turn.role == "user":
            user = turn
        elif turn.role == "assistant" and user is not None:
            if turn.finish_reason in HISTORY_REASONS:
                pairs.append((user, turn))
            user = None
    return pairs


def _stored_prefix(template: ChatTemplate, pairs: list[tuple[Turn, Turn]], tokens: list[int]) -> list[int] | None:
    """The original's tokens through these exchanges, rebuilt from their rows; None unless they are
    exactly the start of `tokens` (the original's model view)."""
    prefix: list[int] = []
    for user, assistant in pairs:
        generated = unpack_ids(assistant.token_ids)
        prefix += unpack_ids(user.token_ids) + generated + template.close_answer(generated)
    return prefix if tokens[: len(prefix)] == prefix else None


async def branch(manager: SessionManager, tenant_id: str, session_id: str, keep: int) -> tuple[SessionState, str]:
    """A new session of the tenant holding the first `keep` complete exchanges of `session_id`;
    returns it and its resume token. `BadBranch` when `keep` is out of range."""
    source = await manager.open(tenant_id, session_id)
    async with source.lock:
        total = exchanges(source.messages)
        if not 0 <= keep <= total:
            raise BadBranch(f"turns must be between 0 and {total}, the session's complete exchanges")
        messages = source.messages[: len(source.messages) - 2 * (total - keep)]  # the system prompt stays
        async with manager.sessionmaker() as db:
            pairs = _exchange_rows(await Repos(db).turns.list_turns(session_id))[:keep]
        tokens = (_stored_prefix(manager.template, pairs, source.tokens)
                  if source.window_start == 0 and keep else None)
        system_prompt, title = source.system_prompt, f"{source.title} (branch)"[:MAX_TITLE] if source.title else ""
    if tokens is None and keep:
        tokens = await manager.tokenize(tenant_id, lambda: manager.template.render(messages, generation_prompt=False))
    copied = sum(len(user.content) + len(assistant.content) for user, assistant in pairs)
    async with manager.quota.hold(tenant_id, copied, "the branch"):  # the system prompt: `create`'s
        state, token = await manager.create(tenant_id, system_prompt=system_prompt, title=title)
        try:
            async with state.lock:
                await _fill(manager, state, pairs, tokens or [])
                state.messages = list(messages)
        except BaseException:
            await manager.delete(tenant_id, state.id)  # no half-made branch stays
            raise
    return state, token


async def _fill(manager: SessionManager, state: SessionState, pairs: list[tuple[Turn, Turn]],
                tokens: list[int]) -> None:
    """The branch's rows (copies of the kept exchanges, without statistics: nothing ran here) and chain."""
    async with manager.sessionmaker() as db, db.begin():
        repos = Repos(db)
        for user, assistant in pairs:
            await repos.turns.add_turn(state.id, "user", user.content, unpack_ids(user.token_ids))
            await repos.turns.add_turn(state.id, "assistant", assistant.content, unpack_ids(assistant.token_ids),
                                       finish_reason=assistant.finish_reason)
        if tokens:
            await manager.save_chain(repos, state, tokens)
    state.tokens = list(tokens)
    state.turn_count = 2 * len(pairs)
