"""The browser UI (web/), driven by Playwright in Debian's headless Chromium against a real server.

Every test talks to the `live_server` fixture (a real `chatcore serve` with the default model,
open mode). Nothing sleeps: tests wait for selectors, attributes and page conditions. The
screenshots go to artifacts/ (git-ignored); docs/ui.md says which ones were looked at.
"""

from __future__ import annotations

import os
import re
import types
from pathlib import Path

import pytest

playwright_api = pytest.importorskip("playwright.async_api")
async_playwright = playwright_api.async_playwright
expect = playwright_api.expect

pytestmark = [pytest.mark.browser, pytest.mark.model]
expect.set_options(timeout=15_000)  # UI steps; generation waits use GEN_TIMEOUT_MS

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
GEN_TIMEOUT_MS = 90_000  # one short answer on a busy 2-core CPU
LONG_PROMPT = "Write a long story about a brave dragon who learns to fly."

# In-page sampler: the assistant bubble's text length, once per animation frame.
SAMPLER = """() => {
  window.__lengths = [];
  const tick = () => {
    const md = document.querySelector('[data-testid="message-assistant"]:last-of-type .md');
    const n = md ? md.textContent.length : 0;
    if (n > 0 && window.__lengths[window.__lengths.length - 1] !== n) window.__lengths.push(n);
    if (!window.__samplerStop) requestAnimationFrame(tick);
  };
  requestAnimationFrame(tick);
}"""


@pytest.fixture(scope="session")
async def browser():
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (make chromium)")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield b
        await b.close()


@pytest.fixture
async def context(browser, live_server):
    ctx = await browser.new_context(viewport={"width": 1440, "height": 900}, base_url=live_server.base_url)
    yield ctx
    await ctx.close()


@pytest.fixture
async def page(context):
    p = await context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda err: errors.append(str(err)))
    yield p
    assert not errors, f"uncaught errors in the page: {errors}"


# ---- helpers ----------------------------------------------------------------------------


async def open_app(page, *, max_tokens: int, temperature: float = 0.0) -> None:
    """Load the UI and set the sampling settings through the settings dialog."""
    await page.goto("/")
    await page.locator("#open-settings").click()
    dialog = page.get_by_role("dialog", name="Settings")
    await expect(dialog).to_be_visible()
    await dialog.get_by_label("Max tokens").fill(str(max_tokens))
    await dialog.get_by_label("Temperature").fill(str(temperature))
    await dialog.get_by_role("button", name="Done").click()
    await expect(dialog).to_be_hidden()
    await expect(page.locator("#sampling-summary")).to_contain_text(f"max {max_tokens} tokens")


async def send(page, text: str) -> None:
    composer = page.get_by_test_id("composer")
    await composer.fill(text)
    await composer.press("Enter")


def assistant(page, n: int = -1):
    bubbles = page.get_by_test_id("message-assistant")
    return bubbles.last if n == -1 else bubbles.nth(n)


async def wait_finished(page, n: int = -1) -> str:
    bubble = assistant(page, n)
    await expect(bubble).to_have_attribute("data-finish", re.compile(r".+"), timeout=GEN_TIMEOUT_MS)
    return await bubble.get_attribute("data-finish")


async def wait_text(page, n: int = -1) -> None:
    """Until the answer shows some text and has not finished yet."""
    await expect(assistant(page, n).locator(".md")).not_to_be_empty(timeout=GEN_TIMEOUT_MS)


async def current_session_id(page) -> str:
    sid = await page.evaluate("() => JSON.parse(localStorage.getItem('chatcore.current'))")
    assert sid, "the UI did not store the current session id"
    return sid


async def server_history(page, sid: str) -> list[dict]:
    res = await page.request.get(f"/v1/sessions/{sid}")
    assert res.ok, await res.text()
    return (await res.json())["history"]


async def rendered_text(page, markdown: str) -> str:
    """The text the UI's Markdown renderer makes of `markdown` (to compare with a bubble)."""
    return await page.evaluate(
        """async (src) => {
            const m = await import('/static/js/markdown.js');
            const box = document.createElement('div');
            box.appendChild(m.renderMarkdown(src));
            return box.textContent;
        }""",
        markdown,
    )


async def assert_matches_server(page, sid: str) -> None:
    """The last answer on screen is the server's stored answer: nothing duplicated or missing."""
    history = await server_history(page, sid)
    answers = [m for m in history if m["role"] == "assistant"]
    assert answers, history
    stored = answers[-1]["content"]
    assert stored.strip(), "the stored answer is empty"
    shown = await assistant(page).locator(".md").text_content()
    assert shown == await rendered_text(page, stored)


async def assert_controls_named(page) -> None:
    """Every visible control has an accessible name (aria-label, a <label>, or its text)."""
    unnamed = await page.evaluate(
        """() => [...document.querySelectorAll('button, textarea, input, select')]
            .filter((e) => e.getClientRects().length > 0)
            .filter((e) => !(e.getAttribute('aria-label') || e.labels?.length || e.textContent.trim()))
            .map((e) => e.outerHTML.slice(0, 80))"""
    )
    assert unnamed == [], unnamed


async def shot(page, name: str) -> None:
    """A screenshot under artifacts/, with transitions and animations finished first."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / name), animations="disabled")


# ---- tests ------------------------------------------------------------------------------


async def test_answer_streams_token_by_token(page):
    await open_app(page, max_tokens=32)
    await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "closed")
    await expect(page.get_by_test_id("stop")).to_be_disabled()
    await page.evaluate(SAMPLER)

    composer = page.get_by_test_id("composer")
    await composer.fill("Tell me about the moon")
    await composer.press("Shift+Enter")  # a new line, not a send
    await composer.press_sequentially("in two sentences.")
    await expect(page.get_by_test_id("message-user")).to_have_count(0)
    await composer.press("Enter")

    await expect(page.get_by_test_id("message-user")).to_have_text("Tell me about the moon\nin two sentences.")
    await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open", timeout=GEN_TIMEOUT_MS)
    await expect(page.get_by_test_id("stop")).to_be_enabled()
    finish = await wait_finished(page)
    assert finish in ("stop", "length")
    await page.evaluate("() => { window.__samplerStop = true; }")

    lengths = await page.evaluate("() => window.__lengths")
    assert len(lengths) >= 2, f"the answer appeared in one piece: {lengths}"
    assert lengths == sorted(lengths), f"the answer shrank while streaming: {lengths}"

    usage = assistant(page).get_by_test_id("usage")
    await expect(usage).to_be_visible()
    assert int(await usage.get_attribute("data-prompt-tokens")) > 0
    assert int(await usage.get_attribute("data-completion-tokens")) > 0
    assert float(await usage.get_attribute("data-ttft-ms")) > 0
    await expect(usage).to_contain_text("tok/s")
    await expect(page.get_by_test_id("stop")).to_be_disabled()
    await expect(composer).to_be_focused()

    sid = await current_session_id(page)
    await assert_matches_server(page, sid)
    await expect(page.locator(f'[data-testid="session-item"][data-session-id="{sid}"]')).to_be_visible()


async def test_stop_cancels_mid_answer(page):
    await open_app(page, max_tokens=256)
    await send(page, LONG_PROMPT)
    await wait_text(page)
    await expect(assistant(page).locator(".caret")).to_have_count(1)  # the streaming caret
    await shot(page, "ui-1440-streaming.png")
    stop = page.get_by_test_id("stop")
    await expect(stop).to_be_enabled()
    await stop.click()
    assert await wait_finished(page) == "cancelled"
    await expect(stop).to_be_disabled()
    await expect(assistant(page)).to_contain_text("Stopped")
    usage = assistant(page).get_by_test_id("usage")
    assert int(await usage.get_attribute("data-completion-tokens")) < 256

    # the session takes a new message right away
    await page.get_by_test_id("composer").fill("Thanks")
    await expect(page.get_by_test_id("send")).to_be_enabled()

    history = await server_history(page, await current_session_id(page))
    assert history[-1]["role"] == "assistant" and history[-1]["finish_reason"] == "cancelled"


async def test_reload_mid_answer_resumes_without_duplicates(page):
    await open_app(page, max_tokens=64)
    await send(page, LONG_PROMPT)
    await wait_text(page)
    bubble = assistant(page)
    assert await bubble.get_attribute("data-finish") is None, "the answer finished before the reload"
    sid = await current_session_id(page)

    await page.reload()
    await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open", timeout=GEN_TIMEOUT_MS)
    finish = await wait_finished(page)
    assert finish in ("stop", "length")
    await expect(page.get_by_test_id("message-user")).to_have_count(1)
    await expect(page.get_by_test_id("message-assistant")).to_have_count(1)
    await expect(page.get_by_test_id("message-user")).to_have_text(LONG_PROMPT)
    assert await current_session_id(page) == sid
    await assert_matches_server(page, sid)

    # a page that died just before `done` comes back to a turn the history already holds:
    # the replayed frames must not add a second copy
    await page.evaluate(
        """([sid, user]) => {
            const key = 'chatcore.session.' + sid;
            const saved = JSON.parse(localStorage.getItem(key));
            saved.pending = {clientId: 'gone-page', user, params: {}, base: 0, startSeq: saved.lastSeq - 1, turn: null};
            localStorage.setItem(key, JSON.stringify(saved));
        }""",
        [sid, LONG_PROMPT],
    )
    await page.reload()
    await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open", timeout=GEN_TIMEOUT_MS)
    await expect(assistant(page).get_by_test_id("usage")).to_be_visible()
    await expect(page.get_by_test_id("message-user")).to_have_count(1)
    await expect(page.get_by_test_id("message-assistant")).to_have_count(1)
    await expect(page.get_by_test_id("stop")).to_be_disabled()
    await assert_matches_server(page, sid)
    pending = await page.evaluate("(sid) => JSON.parse(localStorage.getItem('chatcore.session.' + sid)).pending", sid)
    assert pending is None


async def test_network_drop_mid_answer_reconnects_and_continues(page):
    sockets = []

    def route(ws):
        server = ws.connect_to_server()
        sockets.append((ws, server))

    await page.route_web_socket(re.compile(r".*/v1/ws.*"), route)
    await open_app(page, max_tokens=64)
    await send(page, LONG_PROMPT)
    await wait_text(page)
    assert await assistant(page).get_attribute("data-finish") is None, "the answer finished before the drop"
    assert len(sockets) == 1

    # record every state the indicator takes from now on (a reconnect can be quicker than a poll)
    await page.evaluate(
        """() => {
            const el = document.querySelector('[data-testid="connection"]');
            window.__states = [];
            new MutationObserver(() => window.__states.push(el.dataset.state))
                .observe(el, {attributes: true, attributeFilter: ['data-state']});
        }"""
    )
    # cut the connection under the page, as a network loss would
    ws, server = sockets[0]
    await server.close()
    await ws.close(code=1001, reason="network lost")
    await page.wait_for_function("() => window.__states.includes('connecting')")
    await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open", timeout=GEN_TIMEOUT_MS)
    states = await page.evaluate("() => window.__states")
    assert states.index("connecting") < len(states) - 1 and states[-1] == "open", states
    assert len(sockets) >= 2, "the UI did not reconnect"

    assert await wait_finished(page) in ("stop", "length")
    await expect(page.get_by_test_id("message-assistant")).to_have_count(1)
    await assert_matches_server(page, await current_session_id(page))


async def test_sessions_sharing_a_system_prompt_hit_the_cache(page):
    await open_app(page, max_tokens=8)
    system = page.get_by_label("System prompt", exact=True)
    await page.get_by_role("button", name="Coder").click()
    preset = await system.input_value()
    assert len(preset) > 100

    await send(page, "Say hello.")
    await wait_finished(page)
    first = await current_session_id(page)

    await page.get_by_test_id("new-session").click()
    await expect(page.get_by_test_id("message-assistant")).to_have_count(0)
    await page.get_by_role("button", name="Coder").click()
    assert await system.input_value() == preset
    await send(page, "Say goodbye.")
    await wait_finished(page)
    second = await current_session_id(page)
    assert second != first

    usage = assistant(page).get_by_test_id("usage")
    cached = int(await usage.get_attribute("data-cached-tokens"))
    prompt = int(await usage.get_attribute("data-prompt-tokens"))
    assert 0 < cached < prompt
    await expect(usage).to_contain_text("cached")

    # the cache panel shows the shared blocks: ref > 1, held by both sessions
    await page.get_by_role("button", name="Cache", exact=True).click()
    panel = page.locator("#cache-panel")
    await expect(panel).to_be_visible()
    both = panel.locator(f'.block-grid .cell.shared[data-sessions~="{first}"][data-sessions~="{second}"]')
    await expect(both.first).to_be_visible(timeout=10_000)
    block_size = (await (await page.request.get("/v1/admin/cache")).json())["block_size"]
    assert await both.count() * block_size >= cached  # the cached prefix is held by both sessions
    # hovering the first session's chain highlights its blocks, the shared ones included
    await panel.locator(f'.chain-row[data-session="{first}"] .chain-name').hover()
    await expect(both.first).to_have_class(re.compile(r"\bhl\b"))
    await shot(page, "ui-1440-cache-panel.png")


async def test_html_in_messages_is_never_executed(page):
    await open_app(page, max_tokens=4)
    payload = '<script>window.__pwned=1</script> <img src=x onerror="window.__pwned=1"> **bold?**'
    await send(page, payload)
    await wait_finished(page)
    user = page.get_by_test_id("message-user").last
    await expect(user).to_have_text(payload)  # shown literally, Markdown included
    assert await page.locator("#messages img, #messages script").count() == 0
    assert await page.evaluate("() => window.__pwned") is None

    # model text goes through the Markdown renderer: feed it what a hostile answer could hold
    hostile = (
        "# Title <img src=x onerror=\"window.__pwned=2\">\n\n"
        "<script>window.__pwned=3</script>\n\n"
        "[click](javascript:window.__pwned=4) [ok](https://example.com/a?b=1) "
        "[data](data:text/html,<script>window.__pwned=5</script>)\n\n"
        "```html\n</code></pre><script>window.__pwned=6</script>\n```\n\n"
        "- item <b onmouseover=\"window.__pwned=7\">x</b>\n"
        "- `<svg onload=window.__pwned=8>`\n"
    )
    result = await page.evaluate(
        """async (src) => {
            const m = await import('/static/js/markdown.js');
            const box = document.createElement('div');
            box.id = 'md-probe';
            box.appendChild(m.renderMarkdown(src));
            document.body.appendChild(box);
            return {
                tags: [...box.querySelectorAll('*')].map((e) => e.tagName.toLowerCase()),
                hrefs: [...box.querySelectorAll('a')].map((a) => a.getAttribute('href')),
                attrs: [...box.querySelectorAll('*')].flatMap((e) => [...e.attributes].map((a) => a.name)),
                text: box.textContent,
                lang: box.querySelector('pre code').className,
            };
        }""",
        hostile,
    )
    assert not {"script", "img", "svg", "b", "iframe"} & set(result["tags"]), result["tags"]
    assert result["hrefs"] == ["https://example.com/a?b=1"]
    assert not [a for a in result["attrs"] if a.startswith("on")]
    assert '<img src=x onerror="window.__pwned=2">' in result["text"]
    assert "<script>window.__pwned=3</script>" in result["text"]
    assert "</code></pre><script>window.__pwned=6</script>" in result["text"]
    assert result["lang"] == "language-html"
    assert {"h1", "ul", "li", "pre", "code", "a"} <= set(result["tags"])
    await page.locator("#md-probe").hover()
    assert await page.evaluate("() => window.__pwned") is None


async def test_rename_and_delete_a_session(page, live_server):
    status, created = live_server.request("POST", "/v1/sessions", {"title": "to rename"})
    assert status == 201, created
    sid = created["id"]
    await page.goto("/")
    item = page.locator(f'[data-testid="session-item"][data-session-id="{sid}"]')
    await expect(item).to_be_visible()

    rename = item.get_by_role("button", name="Rename “to rename”")
    await rename.click()
    title = item.get_by_role("textbox", name="Chat title")
    await expect(title).to_be_focused()
    await title.fill("not this")
    await title.press("Escape")  # cancels, focus back on the row
    await expect(item.locator(".session-title")).to_have_text("to rename")
    await expect(item.locator(".session-open")).to_be_focused()

    await rename.click()
    await expect(title).to_be_focused()
    await title.fill("renamed by the browser")
    await title.press("Enter")
    await expect(item.locator(".session-title")).to_have_text("renamed by the browser")
    status, detail = live_server.get(f"/v1/sessions/{sid}")
    assert status == 200 and detail["title"] == "renamed by the browser"

    await item.locator(".session-open").click()
    await expect(page.locator("#chat-title")).to_have_text("renamed by the browser")
    await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open", timeout=GEN_TIMEOUT_MS)

    await item.get_by_role("button", name="Delete “renamed by the browser”").click()
    await item.get_by_role("button", name="Delete", exact=True).click()
    await expect(item).to_have_count(0)
    await expect(page.locator("#chat-title")).to_have_text("New chat")
    status, _ = live_server.get(f"/v1/sessions/{sid}")
    assert status == 404


async def test_layout_at_phone_and_desktop_widths(page):
    await page.set_viewport_size({"width": 375, "height": 812})
    await open_app(page, max_tokens=40)
    new_session = page.get_by_test_id("new-session")
    menu = page.get_by_role("button", name="Show the chat list")
    await expect(new_session).to_be_hidden()  # the sidebar is collapsed behind the menu button
    await expect(menu).to_be_visible()
    await shot(page, "ui-375-new-chat.png")

    await send(page, "Show a tiny Python function that adds two numbers, in a code block.")
    await wait_finished(page)
    overflow = await page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px at 375px"
    for testid in ("composer", "send", "connection"):
        box = await page.get_by_test_id(testid).bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= 375, (testid, box)
    await shot(page, "ui-375-chat.png")
    await assert_controls_named(page)

    await menu.click()
    await expect(new_session).to_be_visible()
    await expect(menu).to_have_attribute("aria-expanded", "true")
    await expect(new_session).to_be_focused()
    await shot(page, "ui-375-sidebar.png")
    await page.keyboard.press("Escape")
    await expect(new_session).to_be_hidden()
    await expect(menu).to_be_focused()

    cache = page.get_by_role("button", name="Cache", exact=True)
    await cache.click()
    await expect(cache).to_have_attribute("aria-pressed", "true")
    await expect(page.locator("#cache-panel .chain-row").first).to_be_visible(timeout=10_000)
    await shot(page, "ui-375-cache-panel.png")
    await page.keyboard.press("Escape")
    await expect(page.locator("#cache-panel")).to_be_hidden()

    await page.locator("#open-settings").click()
    await expect(page.get_by_role("dialog", name="Settings")).to_be_visible()
    await shot(page, "ui-375-settings.png")
    await page.keyboard.press("Escape")
    await expect(page.get_by_role("dialog", name="Settings")).to_be_hidden()

    await page.set_viewport_size({"width": 1440, "height": 900})
    await expect(new_session).to_be_visible()
    await expect(menu).to_be_hidden()
    await shot(page, "ui-1440-chat.png")
    await page.emulate_media(color_scheme="dark")
    await shot(page, "ui-1440-chat-dark.png")
    await page.set_viewport_size({"width": 375, "height": 812})
    await shot(page, "ui-375-chat-dark.png")
    await page.set_viewport_size({"width": 1440, "height": 900})
    await page.emulate_media(color_scheme="light")

    await assert_controls_named(page)
    await new_session.click()
    await expect(page.get_by_test_id("composer")).to_be_focused()
    await expect(page.get_by_label("System prompt", exact=True)).to_be_visible()
    await shot(page, "ui-1440-new-chat.png")


async def test_stale_resume_token_is_renewed(page, live_server):
    status, created = live_server.request("POST", "/v1/sessions", {"title": "stale token"})
    assert status == 201, created
    sid = created["id"]
    await page.goto("/")
    await page.evaluate(
        """(sid) => {
            localStorage.setItem('chatcore.current', JSON.stringify(sid));
            localStorage.setItem('chatcore.session.' + sid, JSON.stringify({token: 'not-the-token', lastSeq: null}));
        }""",
        sid,
    )
    await page.reload()
    # hello fails with `unauthorized`; the page asks POST /v1/sessions/{id}/token and retries
    await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open", timeout=GEN_TIMEOUT_MS)
    await expect(page.locator("#chat-title")).to_have_text("stale token")
    token = await page.evaluate("(sid) => JSON.parse(localStorage.getItem('chatcore.session.' + sid)).token", sid)
    assert token and token != "not-the-token"


async def test_a_second_tab_takes_the_session_and_the_first_can_take_it_back(context, live_server):
    status, created = live_server.request("POST", "/v1/sessions", {"title": "two tabs"})
    assert status == 201, created
    sid = created["id"]
    first = await context.new_page()
    await first.goto("/")
    await first.locator(f'[data-testid="session-item"][data-session-id="{sid}"] .session-open').click()
    await expect(first.get_by_test_id("connection")).to_have_attribute("data-state", "open", timeout=GEN_TIMEOUT_MS)

    second = await context.new_page()  # same localStorage: it opens the same chat
    await second.goto("/")
    await expect(second.get_by_test_id("connection")).to_have_attribute("data-state", "open", timeout=GEN_TIMEOUT_MS)
    await expect(first.get_by_test_id("connection")).to_have_attribute("data-state", "closed")
    banner = first.get_by_role("alert")
    await expect(banner).to_contain_text("another tab")

    await banner.get_by_role("button", name="Use it here").click()
    await expect(first.get_by_test_id("connection")).to_have_attribute("data-state", "open")
    await expect(second.get_by_test_id("connection")).to_have_attribute("data-state", "closed")
    await expect(second.get_by_role("alert")).to_contain_text("another tab")


@pytest.fixture
def keyed_server(tmp_path):
    """A second server in keyed mode: an admin key for tenant acme, a plain key for tenant bob."""
    from tests.server_helpers import create_key, start_server

    data_dir = tmp_path / "keyed"
    data_dir.mkdir(parents=True)
    cli = types.SimpleNamespace(env={**os.environ, "CHATCORE_DATA_DIR": str(data_dir)})
    keys = {"admin": create_key(cli, "acme", admin=True), "bob": create_key(cli, "bob")}
    server = start_server(data_dir)  # keys first: keyed from its first request
    server.keys.update(keys)
    try:
        yield server
    finally:
        server.stop()


async def test_keyed_mode_asks_for_a_key_and_uses_it(browser, keyed_server):
    ctx = await browser.new_context(viewport={"width": 1440, "height": 900}, base_url=keyed_server.base_url)
    try:
        page = await ctx.new_page()
        sockets: list[str] = []
        page.on("websocket", lambda ws: sockets.append(ws.url))
        bob = keyed_server.keys["bob"]
        status, created = keyed_server.request("POST", "/v1/sessions", {"title": "bob's chat"}, key=bob)
        assert status == 201, created

        await page.goto("/")
        dialog = page.get_by_role("dialog", name="Settings")
        await expect(dialog).to_be_visible()  # GET /v1/sessions answered 401
        await expect(dialog.get_by_role("alert")).to_contain_text("API key")
        await dialog.get_by_label("API key").fill(bob)
        await dialog.get_by_role("button", name="Done").click()

        item = page.locator(f'[data-testid="session-item"][data-session-id="{created["id"]}"]')
        await item.locator(".session-open").click()  # no resume token here: POST .../token, then the socket
        await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open", timeout=GEN_TIMEOUT_MS)
        assert sockets and not [url for url in sockets if "api_key" in url]  # the key went in a first frame
        assert await page.evaluate("() => JSON.parse(localStorage.getItem('chatcore.settings')).apiKey") == bob

        await page.get_by_role("button", name="Cache", exact=True).click()
        await expect(page.locator("#cache-panel .cache-status")).to_contain_text("admin API key")

        await page.locator("#open-settings").click()
        await dialog.get_by_label("API key").fill(keyed_server.keys["admin"])
        await dialog.get_by_role("button", name="Done").click()
        await expect(page.locator("#cache-panel .audit")).to_contain_text("Audit OK")
        await expect(page.locator("#cache-panel .cache-status")).to_be_hidden()
        await expect(item).to_have_count(0)  # bob's chat is not acme's
    finally:
        await ctx.close()


@pytest.fixture
def small_window_server(tmp_path):
    from tests.server_helpers import start_server

    server = start_server(tmp_path / "window", max_context="192")
    try:
        yield server
    finally:
        server.stop()


async def test_the_model_s_view_is_marked_when_a_long_chat_is_truncated(browser, small_window_server):
    ctx = await browser.new_context(viewport={"width": 1440, "height": 900}, base_url=small_window_server.base_url)
    try:
        page = await ctx.new_page()
        await open_app(page, max_tokens=4)
        messages = [f"Message {i}: which {word} do you like best, and why would a traveller pick it?"
                    for i, word in enumerate(["river", "city", "bread", "song", "coast", "tree", "train", "lake"])]
        marker = page.get_by_test_id("truncation-marker")
        for i, text in enumerate(messages):
            await send(page, text)
            await expect(page.get_by_test_id("message-assistant")).to_have_count(i + 1)
            await wait_finished(page)
        await expect(marker).to_have_count(1)
        sid = await current_session_id(page)
        res = await page.request.get(f"/v1/sessions/{sid}")
        dropped = (await res.json())["truncated_turns"]
        assert dropped > 0
        await expect(marker).to_have_attribute("data-truncated", str(dropped))
        await expect(page.get_by_test_id("message-user")).to_have_count(len(messages))  # nothing hidden

        async def first_in_view() -> str:
            return await marker.evaluate("(m) => m.nextElementSibling.textContent")

        assert messages[dropped] in await first_in_view()
        assert await marker.evaluate("(m) => m.nextElementSibling.dataset.testid") == "message-user"
        await marker.scroll_into_view_if_needed()
        await page.screenshot(path=str(ARTIFACTS / "ui-truncation-marker.png"))
        await page.reload()  # the session frame brings the window back
        await expect(marker).to_have_count(1)
        assert messages[dropped] in await first_in_view()
    finally:
        await ctx.close()
