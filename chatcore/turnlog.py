"""One log line per turn, session or stateless: the operator's record of what each request cost.

The same fields travel as the record's `extra`, so JSON logs (`chatcore.logs`) carry them as keys."""

from __future__ import annotations

import logging

log = logging.getLogger("chatcore.turns")


def log_turn(*, tenant_id: str, session_id: str | None, request_id: str, prompt_tokens: int, cached_device: int,
             cached_disk: int, ttft_ms: float | None, completion_tokens: int, finish_reason: str) -> None:
    recomputed = prompt_tokens - cached_device - cached_disk
    ttft = None if ttft_ms is None else round(ttft_ms)
    fields = {"tenant": tenant_id, "session": session_id, "request_id": request_id, "prompt_tokens": prompt_tokens,
              "cached_device": cached_device, "cached_disk": cached_disk, "recomputed": recomputed, "ttft_ms": ttft,
              "generated": completion_tokens, "finish_reason": finish_reason}
    log.info("turn tenant=%s session=%s request=%s prompt=%d cached_device=%d cached_disk=%d recomputed=%d "
             "ttft_ms=%s generated=%d finish=%s", tenant_id, session_id or "-", request_id, prompt_tokens,
             cached_device, cached_disk, recomputed, "-" if ttft is None else ttft, completion_tokens, finish_reason,
             extra=fields)
