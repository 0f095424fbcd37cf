"""No tenant can take the whole engine (issue 53): a real server in keyed mode, tenants alpha and beta.

Beside each of alpha's three hogs, beta's short streamed chats get no 429, and their TTFT p50 stays within
beta's idle TTFT p50 (measured by the same test just before, on the same server) plus three of the steps
beta's tokens come in beside the hog (its ITL p50 there): the step in flight when beta's request arrives,
the step that computes its prompt, and one of slack. The issue's bound, 2x the idle TTFT, is what
`chatcore bench --suite fairness` judges; on this shared 2-core machine it is not a stable test: in three
runs of this module beta's idle TTFT p50 moved between 60 and 480 ms, and its step (ITL p50) between
24 and 190 ms, with the other engineers' load. Beta's own step time measures that load at the
moment, so the bound above holds under it, and still fails wherever beta waits for alpha's work rather
than for a step (before the share: for all of alpha's prompt, or for its slots). The hogs keep the issue's
shapes, scaled to a loaded 2-core machine (`chatcore bench --suite fairness` runs the issue's sizes):
- slots: 2 concurrent chats of n=4 (96 tokens, ignore_eos) hold all 8 of the server's sequence slots
  (the issue's 8 x n=8 x 800 hold the CPU default's 64). While beta has work alpha's share is 4 slots:
  its newer request is preempted (recomputed once beta's is done) and its older one runs 4 rows a step;
- prompt: one /v1/completions of 2,000 token ids (the issue's 8,000): over a hundred steps of prefill;
- bodies: 16 concurrent chats of 1 MB messages, as in the issue.
The server's step budget is 16 tokens (`max_batch_tokens`, 512 by default on the CPU): on two cores a
step's time grows with its tokens and rows (about 4 ms a decode row here, on a 25-30 ms step), and beta's
first token always waits for the step in flight when it arrives, so at the default budget the ratio
measures the size of a CPU step rather than the share. What the share bounds is the same at any budget:
alpha's part of each step is half of it while beta has work, and beta's request is admitted at once.
Before the share, beta waited for alpha's whole prompt or for its slots (the issue's review: 0.06 s to
13.5 s beside a 4,000-token message, and a 429 after 30 s beside the slots). Each hog must still be
running when beta's probes end (or, for the bodies, be refused), so the probes ran beside it.
"""

from __future__ import annotations

import asyncio
import os
import types

import httpx
import pytest

from chatcore.bench.common import median
from chatcore.bench.fairness import Probes, beside, bodies_hog, probe, prompt_hog, slots_hog
from tests.reliability_helpers import log_problems, report, wait_idle
from tests.server_helpers import create_key, start_server

pytestmark = pytest.mark.model
PROBES = 7
PROBE_TOKENS = 4
HOGS = {"slots": slots_hog(2, 4, 96), "prompt": prompt_hog(2000), "bodies": bodies_hog(16, 1_000_000)}


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("fairness")
    cli = types.SimpleNamespace(env={**os.environ, "CHATCORE_DATA_DIR": str(data_dir)})
    keys = {name: create_key(cli, name, admin=name == "ops") for name in ("ops", "alpha", "beta")}
    server = start_server(data_dir, max_num_seqs=8, max_batch_tokens=16)
    server.keys = keys
    yield server
    server.stop()


async def idle(tenants) -> Probes:
    """Beta's figures with nothing else running, after one untimed chat (its system prompt cached)."""
    async with httpx.AsyncClient(base_url=tenants.base_url, timeout=600) as http:
        await probe(http, tenants.keys["beta"], 1, PROBE_TOKENS)
        probes = await probe(http, tenants.keys["beta"], PROBES, PROBE_TOKENS)
    assert probes.statuses == [200] * PROBES and len(probes.ttft_s) == PROBES, probes
    return probes


@pytest.mark.parametrize("name", list(HOGS))
async def test_beta_is_served_beside_alphas_hog(tenants, name: str, capsys) -> None:
    idle_probes = await idle(tenants)  # just before the hog: the machine's load drifts between tests
    got = await beside(tenants.base_url, tenants.keys, HOGS[name], PROBES, PROBE_TOKENS)
    assert got.probes.statuses == [200] * PROBES, got.probes.statuses  # no 429, nothing else
    if name == "bodies":
        assert got.hog_statuses is None or set(got.hog_statuses) == {413}, got.hog_statuses
    else:
        assert got.hog_statuses is None, f"alpha's hog ended before beta's probes: {got.hog_statuses}"
    ttft, idle_ttft, step = median(got.probes.ttft_s), median(idle_probes.ttft_s), median(got.probes.itl_s)
    ratio = ttft / idle_ttft
    report(capsys, f"fairness: beta beside alpha's {name} hog", {
        "beta TTFT idle (ms)": [round(1e3 * t) for t in idle_probes.ttft_s],
        "beta TTFT beside (ms)": [round(1e3 * t) for t in got.probes.ttft_s], "TTFT p50 ratio": ratio,
        "beta ITL p50 idle (ms)": 1e3 * median(idle_probes.itl_s),
        "beta ITL p50 beside (ms)": 1e3 * median(got.probes.itl_s)})
    assert ttft <= idle_ttft + 3 * step, (ttft, idle_ttft, step)
    await wait_idle(tenants, deadline_s=300, key=tenants.keys["ops"])
    assert not log_problems(tenants)


async def test_sixty_four_chats_in_open_mode_all_complete(tmp_path) -> None:
    """Open mode on defaults: every client is one tenant, and 64 concurrent chats all complete (the
    17th was refused before: max_turns_per_tenant counted them as one tenant's)."""
    server = start_server(tmp_path / "open")
    try:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600,
                                     limits=httpx.Limits(max_connections=None)) as http:
            async def chat(i: int) -> httpx.Response:
                return await http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": f"Say a number ({i})."}], "max_tokens": 4,
                    "temperature": 0})
            responses = await asyncio.gather(*(chat(i) for i in range(64)))
        assert [r.status_code for r in responses] == [200] * 64, [r.text for r in responses if r.status_code != 200]
        assert all(r.json()["choices"][0]["finish_reason"] in ("stop", "length") for r in responses)
        await wait_idle(server, deadline_s=120)
        assert not log_problems(server)
    finally:
        server.stop()
