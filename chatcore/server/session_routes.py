"""Session REST routes. Every route sees only the caller's own tenant."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, delete, get, patch, post
from sqlalchemy import func, select

from chatcore.server.errors import ApiError
from chatcore.server.services import Services
from chatcore.sessions.branch import BadBranch, branch
from chatcore.store.models import Turn

MAX_TITLE = 200
MAX_SYSTEM_PROMPT = 100_000


def _services(request: Request[Any, Any, Any]) -> Services:
    return request.app.state.services


def _optional_text(data: dict[str, Any], name: str, limit: int) -> str | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > limit:
        raise ApiError("bad_request", f"{name} must be a string of at most {limit} characters")
    return value


@get("/v1/limits")
async def limits(request: Request[Any, Any, Any]) -> dict[str, int]:
    """The server's limits (also in the WebSocket `session` frame), for a client with no chat open yet."""
    await request.app.state.auth.principal(request)
    return _services(request).limits()


@get("/v1/sessions")
async def list_sessions(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    principal = await request.app.state.auth.principal(request)
    services = _services(request)
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
async def create_session(request: Request[Any, Any, Any], data: dict[str, Any] | None = None) -> dict[str, Any]:
    principal = await request.app.state.auth.principal(request)
    data = data or {}
    if not isinstance(data, dict):
        raise ApiError("bad_request", "the body must be a JSON object")
    unknown = sorted(set(data) - {"title", "system_prompt"})
    if unknown:
        raise ApiError("bad_request", f"unknown fields: {', '.join(unknown)}")
    title = _optional_text(data, "title", MAX_TITLE) or ""
    system_prompt = _optional_text(data, "system_prompt", MAX_SYSTEM_PROMPT)
    state, token = await _services(request).sessions.create(
        principal.tenant_id, system_prompt=system_prompt, title=title,
        id_hint=request.headers.get("x-chatcore-new-session"))
    return {"id": state.id, "resume_token": token, "title": state.title, "system_prompt": state.system_prompt}


@get("/v1/sessions/{session_id:str}")
async def get_session(request: Request[Any, Any, Any], session_id: str) -> dict[str, Any]:
    principal = await request.app.state.auth.principal(request)
    return await _services(request).sessions.detail(principal.tenant_id, session_id)


@post("/v1/sessions/{session_id:str}/branch", status_code=201)
async def branch_session(request: Request[Any, Any, Any], session_id: str, data: dict[str, Any]) -> dict[str, Any]:
    """A new session with the first `turns` complete exchanges of this one (regenerate, edit and resend)."""
    principal = await request.app.state.auth.principal(request)
    if not isinstance(data, dict) or set(data) != {"turns"} or isinstance(data["turns"], bool) \
            or not isinstance(data["turns"], int):
        raise ApiError("bad_request", "send {\"turns\": the number of complete exchanges the branch keeps}")
    try:
        state, token = await branch(_services(request).sessions, principal.tenant_id, session_id, data["turns"])
    except BadBranch as exc:
        raise ApiError("bad_request", str(exc)) from exc
    return {"id": state.id, "resume_token": token, "title": state.title, "system_prompt": state.system_prompt,
            "turns": data["turns"], "history_tokens": len(state.tokens)}


@patch("/v1/sessions/{session_id:str}")
async def rename_session(request: Request[Any, Any, Any], session_id: str, data: dict[str, Any]) -> dict[str, Any]:
    principal = await request.app.state.auth.principal(request)
    title = _optional_text(data, "title", MAX_TITLE)
    if title is None or set(data) != {"title"}:
        raise ApiError("bad_request", "send {\"title\": string}")
    await _services(request).sessions.rename(principal.tenant_id, session_id, title)
    return {"id": session_id, "title": title}


@post("/v1/sessions/{session_id:str}/token", status_code=200)
async def rotate_token(request: Request[Any, Any, Any], session_id: str) -> dict[str, Any]:
    principal = await request.app.state.auth.principal(request)
    token = await _services(request).sessions.rotate_resume_token(principal.tenant_id, session_id)
    return {"id": session_id, "resume_token": token}


@delete("/v1/sessions/{session_id:str}", status_code=204)
async def delete_session(request: Request[Any, Any, Any], session_id: str) -> Response[None]:
    principal = await request.app.state.auth.principal(request)
    await _services(request).sessions.delete(principal.tenant_id, session_id)
    return Response(None, status_code=204)
