"""One log line per turn, session or stateless: the operator's record of what each request cost."""

from __future__ import annotations

import logging

log = logging.getLogger("chatcore.turns")


def log_turn(*, tenant_id: str, session_id: str | None, request_id: str, prompt_tokens: int, cached_device: int,
             cached_disk: int, ttft_ms: float | None, completion_tokens: int, finish_reason: str) -> None:
    log.info("turn tenant=%s session=%s request=%s prompt=%d cached_device=%d cached_disk=%d recomputed=%d "
             "ttft_ms=%s generated=%d finish=%s", tenant_id, session_id or "-", request_id, prompt_tokens,
             cached_device, cached_disk, prompt_tokens - cached_device - cached_disk,
             "-" if ttft_ms is None else f"{ttft_ms:.0f}", completion_tokens, finish_reason)
