"""The operators' view of the pool: the audit, each block's state, and which sessions map it."""

from __future__ import annotations

from typing import Any

from chatcore.cache import BlockPool, PinOwner, PrefetchOwner, PrefixOwner, SequenceOwner, TableOwner, audit


def block_map(pool: BlockPool, session_of_request: dict[str, str]) -> dict[str, Any]:
    """The audit plus which sessions map which blocks: a pin's (or a prefetch's) table names its
    session, a request's table the session `session_of_request` gives its request id."""
    report = audit(pool)
    owners, per_session = _owners(pool, session_of_request)
    blocks = []
    for block in pool.blocks:
        state = "used" if block.ref > 0 else "cached" if pool.is_cached(block.id) else "free"
        if state != "free":
            blocks.append({"id": block.id, "state": state, "ref": block.ref,
                           "sessions": sorted(owners.get(block.id, ()))})
    return {
        "block_size": pool.block_size,
        "audit": {"ok": report.ok, "violations": report.violations, "total": report.total,
                  "free": report.free, "cached": report.cached, "used": report.used,
                  "sum_refs": report.sum_refs, "sum_table_lens": report.sum_table_lens},
        "blocks": blocks,
        "sessions": [{"id": sid, "blocks": list(ids)} for sid, ids in per_session.items()],
    }


def _owners(pool: BlockPool, session_of_request: dict[str, str]) -> tuple[dict[int, set[str]],
                                                                           dict[str, dict[int, None]]]:
    """Each block's sessions, and each session's blocks in table order."""
    owners: dict[int, set[str]] = {}
    per_session: dict[str, dict[int, None]] = {}
    for table in pool.tables:
        session = _session(table.owner, session_of_request)
        if session:
            for block_id in table.block_ids:
                owners.setdefault(block_id, set()).add(session)
            per_session.setdefault(session, {}).update(dict.fromkeys(table.block_ids))
    return owners, per_session


def _session(owner: TableOwner, session_of_request: dict[str, str]) -> str | None:
    """The session a table's owner maps its blocks for, if any."""
    match owner:
        case PinOwner(session_id=session) | PrefetchOwner(session_id=session):
            return session
        case SequenceOwner(request_id=request) | PrefixOwner(request_id=request):
            return session_of_request.get(request)
