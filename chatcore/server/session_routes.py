"""Session REST routes. Every route sees only the caller's own tenant."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, delete, get, patch, post
from sqlalchemy import func, select

from chatcore.outcomes import ErrorCode
from chatcore.server.auth import Principal
from chatcore.server.bodies import Branch, NewSession, Rename
from chatcore.server.errors import ApiError
from chatcore.server.services import Services
from chatcore.sessions.branch import BadBranch, branch
from chatcore.store.models import Turn


@get("/v1/limits")
async def limits(services: Services) -> dict[str, int]:
    """The server's limits (also in the WebSocket `session` frame), for a client with no chat open yet."""
    return services.limits()


@get("/v1/sessions")
async def list_sessions(services: Services, principal: Principal) -> list[dict[str, Any]]:
    sessions = await services.sessions.list(principal.tenant_id)
    # "turns" (completed or running exchanges: one per user message) is part of the protocol.
    async with services.sessionmaker() as db:
        counts = dict((await db.execute(
            select(Turn.session_id, func.count()).where(Turn.session_id.in_([s["id"] for s in sessions]),
                                                        Turn.role == "user").group_by(Turn.session_id))).tuples().all())
    for item in sessions:
        item.setdefault("turns", counts.get(item["id"], 0))
    return sessions


@post("/v1/sessions", status_code=201)
async def create_session(request: Request[Any, Any, Any], services: Services, principal: Principal,
                         data: NewSession | None = None) -> dict[str, Any]:
    data = data or NewSession()
    state, token = await services.sessions.create(
        principal.tenant_id, system_prompt=data.system_prompt, title=data.title or "",
        id_hint=request.headers.get("x-chatcore-new-session"))
    return {"id": state.id, "resume_token": token, "title": state.title, "system_prompt": state.system_prompt}


@get("/v1/sessions/{session_id:str}")
async def get_session(session_id: str, services: Services, principal: Principal) -> dict[str, Any]:
    return await services.sessions.detail(principal.tenant_id, session_id)


@post("/v1/sessions/{session_id:str}/branch", status_code=201)
async def branch_session(session_id: str, data: Branch, services: Services, principal: Principal) -> dict[str, Any]:
    """A new session with the first `turns` complete exchanges of this one (regenerate, edit and resend)."""
    try:
        state, token = await branch(services.sessions, principal.tenant_id, session_id, data.turns)
    except BadBranch as exc:
        raise ApiError(ErrorCode.BAD_REQUEST, str(exc)) from exc
    return {"id": state.id, "resume_token": token, "title": state.title, "system_prompt": state.system_prompt,
            "turns": data.turns, "history_tokens": len(state.tokens)}


@patch("/v1/sessions/{session_id:str}")
async def rename_session(session_id: str, data: Rename, services: Services, principal: Principal) -> dict[str, Any]:
    await services.sessions.rename(principal.tenant_id, session_id, data.title)
    return {"id": session_id, "title": data.title}


@post("/v1/sessions/{session_id:str}/token", status_code=200)
async def rotate_token(session_id: str, services: Services, principal: Principal) -> dict[str, Any]:
    token = await services.sessions.rotate_resume_token(principal.tenant_id, session_id)
    return {"id": session_id, "resume_token": token}


@delete("/v1/sessions/{session_id:str}", status_code=204)
async def delete_session(session_id: str, services: Services, principal: Principal) -> Response[None]:
    await services.sessions.delete(principal.tenant_id, session_id)
    return Response(None, status_code=204)
