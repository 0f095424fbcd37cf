"""A 300-turn conversation in the browser UI keeps answering (the context policy truncates the model's view)."""

from __future__ import annotations

import pytest

from tests.test_web_ui import GEN_TIMEOUT_MS, browser, expect, open_app  # noqa: F401 (browser: a fixture)

pytestmark = [pytest.mark.browser, pytest.mark.model]
TURNS = 300
CHAT_LOOP = """async ({turns, stallMs}) => {
  const composer = document.querySelector('[data-testid="composer"]');
  const done = () => document.querySelectorAll('[data-testid="message-assistant"][data-finish]').length;
  for (let i = 0; i < turns; i++) {
    composer.value = `Turn ${i}: hi`;
    composer.dispatchEvent(new Event("input", { bubbles: true }));
    composer.dispatchEvent(new KeyboardEvent("keydown", { key: "Enter", bubbles: true, cancelable: true }));
    const since = performance.now();
    await new Promise((resolve, reject) => {
      const check = () => {
        if (done() > i) resolve();
        else if (performance.now() - since > stallMs) reject(new Error(`turn ${i} did not finish`));
        else requestAnimationFrame(check);
      };
      check();
    });
  }
  return done();
}"""


@pytest.fixture
def tiny_window_server(tmp_path):
    from tests.server_helpers import start_server

    server = start_server(tmp_path / "long-chat", max_context="128", hot_window_s="600")
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
        # the next is sent once the answer's bubble is finished, checked every animation frame.
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
    finally:
        await ctx.close()
