"""The one rule of a session turn's pin: whether its table stays pinned when the turn ends.

A session's turn keeps its first sample's table as the session's pin once it has ended well (stop or
length; not an error, not still running), and for as long as the turn is saved and its session live.
The engine thread knows the sample and how it ended (`KVCacheManager` asks as a sample stops and as
the request ends); the sessions layer knows, later, whether the turn was saved and the session is still
live (`Residency.settle`). Each asks `keeps_pin` with what it knows; a fact not passed is taken as one
that keeps the pin, since the other side has already checked it.
"""

from __future__ import annotations

from chatcore.outcomes import FinishReason


def keeps_pin(session_id: str | None, index: int = 0, finish_reason: FinishReason | None = FinishReason.STOP,
              *, saved: bool = True, session_live: bool = True) -> bool:
    """Whether the table of sample `index` of a turn of `session_id` (None: not a session's), which ended
    with `finish_reason`, stays pinned for the session."""
    return (session_id is not None and index == 0 and finish_reason not in (None, FinishReason.ERROR)
            and saved and session_live)
