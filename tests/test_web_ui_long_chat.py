"""A 300-turn conversation in the browser UI, over the WebSocket, keeps answering: the context policy
truncates the model's view, never the conversation."""

from __future__ import annotations

import re

import pytest

from tests.test_web_ui import GEN_TIMEOUT_MS, browser, expect, open_app  # noqa: F401 (browser: a fixture)

pytestmark = [pytest.mark.browser, pytest.mark.model]
TURNS = 300
CONTEXT = 128
CHAT_LOOP = """async ({turns, stallMs}) => {
  const composer = document.querySelector('[data-testid="composer"]');
  const done = () => document.querySelectorAll('[data-testid="message-assistant"][data-finish]').length;
  for (let i = 0; i < turns; i++) {
    composer.value = `Turn ${i}: hi`;
    composer.dispatchEvent(new Event("input", { bubbles: true }));
    composer.dispatchEvent(new KeyboardEvent("keydown", { key: "Enter", bubbles: true, cancelable: true }));
    await new Promise((resolve, reject) => {  // woken by the page's own changes, not by polling
      const timer = setTimeout(() => { observer.disconnect(); reject(new Error(`turn ${i} did not finish`)); }, stallMs);
      const observer = new MutationObserver(() => {
        if (done() > i) { observer.disconnect(); clearTimeout(timer); resolve(); }
      });
      observer.observe(document.body, { subtree: true, childList: true, attributes: true,
                                        attributeFilter: ["data-finish"] });
      if (done() > i) { observer.disconnect(); clearTimeout(timer); resolve(); }
    });
  }
  return done();
}"""


@pytest.fixture
def tiny_window_server(tmp_path):
    from tests.server_helpers import start_server

    # One torch thread: the browser needs the other core, and two threads sharing one core stall each other.
    server = start_server(tmp_path / "long-chat", max_context=str(CONTEXT), hot_window_s="600", kv_disk_gb="0",
                          threads="1")
    try:
        yield server
    finally:
        server.stop()


async def test_a_300_turn_conversation_keeps_answering_in_the_ui(browser, tiny_window_server):  # noqa: F811
    ctx = await browser.new_context(viewport={"width": 1280, "height": 800}, base_url=tiny_window_server.base_url)
    try:
        page = await ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        await open_app(page, max_tokens=1)
        # The turns run inside the page: its own composer takes each message (input, then Enter) and
        # the next is sent once the answer's bubble is finished (a MutationObserver sees it).
        # Playwright round trips per turn would cost more than the turns themselves.
        finished = await page.evaluate(CHAT_LOOP, {"turns": TURNS, "stallMs": GEN_TIMEOUT_MS})
        assert finished == TURNS
        answers = page.get_by_test_id("message-assistant")
        await expect(answers).to_have_count(TURNS)
        assert set(await answers.evaluate_all("(els) => els.map((e) => e.dataset.finish)")) == {"length"}
        marker = page.get_by_test_id("truncation-marker")
        await expect(marker).to_have_count(1)
        dropped = int(await marker.get_attribute("data-truncated"))
        assert dropped > TURNS - 20  # the model sees only the last few exchanges, the page shows all
        await expect(page.get_by_test_id("message-user")).to_have_count(TURNS)
        assert not errors, errors
        # What the server did each turn: no prompt overflowed, the window moved rarely (most turns
        # extended the cached history), and the session keeps all 300 exchanges.
        sid = await page.evaluate("() => JSON.parse(localStorage.getItem('chatcore.current'))")
        detail = await (await page.request.get(f"/v1/sessions/{sid}")).json()
        assert len(detail["history"]) == 2 * TURNS and detail["truncated_turns"] == dropped
        usages = [m["usage"] for m in detail["history"] if m["role"] == "assistant"]
        assert all(u["prompt_tokens"] + u["completion_tokens"] <= CONTEXT for u in usages)
        cached = [u["cached_tokens"] >= u["prompt_tokens"] // 2 for u in usages[1:]]
        assert sum(cached) > 0.75 * len(cached), sum(cached)
    finally:
        await ctx.close()


PAGE = 4  # messages a session frame carries: two exchanges
QUESTIONS = [f"Question {i}: which colour is the sea at dawn?" for i in range(5)]


@pytest.fixture
def paged_server(tmp_path):
    from tests.server_helpers import start_server

    server = start_server(tmp_path / "paged", history_page_messages=str(PAGE), kv_disk_gb="0", threads="1")
    try:
        yield server
    finally:
        server.stop()


async def test_a_long_history_loads_page_by_page_and_branches_at_the_right_exchange(
        browser, paged_server):  # noqa: F811
    ctx = await browser.new_context(viewport={"width": 1280, "height": 800}, base_url=paged_server.base_url)
    try:
        page = await ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        messages = [m for i, q in enumerate(QUESTIONS)
                    for m in ({"role": "user", "content": q}, {"role": "assistant", "content": f"Answer {i}."})]
        res = await page.request.post("/v1/sessions/import", data={"title": "Paged", "messages": messages})
        assert res.status == 201, await res.text()
        original = (await res.json())["id"]
        await open_app(page, max_tokens=2)
        await page.locator(f'[data-testid="session-item"][data-session-id="{original}"]').click()

        # The hello brings the last page; earlier ones come on request, in order, until none is left.
        # The button is pressed where it stands: a click would first scroll it into view, and reaching
        # the top of the transcript loads the page by itself, racing the click (which then finds the
        # button replaced, or gone).
        users = page.get_by_test_id("message-user")
        earlier = page.get_by_test_id("load-earlier")
        await expect(users).to_have_text(QUESTIONS[3:])
        for shown in (QUESTIONS[1:], QUESTIONS):
            await expect(earlier).to_be_enabled()
            await earlier.dispatch_event("click")
            await expect(users).to_have_text(shown)
        await expect(earlier).to_have_count(0)

        # After a reload only the last page is loaded: regenerating its last answer still branches
        # after the four exchanges before it, those not loaded included.
        await page.reload()
        await expect(users).to_have_text(QUESTIONS[3:])
        await expect(earlier).to_have_count(1)
        last_answer = page.get_by_test_id("message-assistant").last
        await last_answer.get_by_role("button", name="Regenerate this answer").click()
        await page.wait_for_function(
            "(o) => { const c = JSON.parse(localStorage.getItem('chatcore.current')); return c && c !== o; }",
            arg=original)
        branch = await page.evaluate("() => JSON.parse(localStorage.getItem('chatcore.current'))")
        await expect(last_answer).to_have_attribute("data-finish", re.compile(r".+"), timeout=GEN_TIMEOUT_MS)
        detail = await (await page.request.get(f"/v1/sessions/{branch}")).json()
        assert [m["content"] for m in detail["history"] if m["role"] == "user"] == QUESTIONS
        assert [m["content"] for m in detail["history"][:8]] == [m["content"] for m in messages[:8]]
        assert not errors, errors
    finally:
        await ctx.close()
