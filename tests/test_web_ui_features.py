"""The browser UI's answer rendering and everyday tools, in Debian's headless Chromium against the
real server and model (issue 16 item 4, issue 18 item 5): JSON answers, tool-call cards, highlighted
code, export and import, the theme, the settings (system prompt, top-p, temperature, JSON mode, max
tokens bounded by the server's limit) and the keyboard shortcuts. Nothing sleeps."""
# ruff: noqa: F811  (the browser fixtures are imported from test_web_ui and requested by name)

from __future__ import annotations

import json
import re

import pytest

from tests.test_web_ui import (  # noqa: F401  (fixtures)
    LONG_PROMPT,
    assistant,
    browser,
    context,
    current_session_id,
    expect,
    open_app,
    page,
    send,
    server_history,
    shot,
    wait_finished,
    wait_text,
)

pytestmark = [pytest.mark.browser, pytest.mark.model]

# Records every frame the page sends on its WebSocket, and every CSP violation.
RECORDER = """() => {
  window.__sent = [];
  window.__csp = [];
  document.addEventListener('securitypolicyviolation', (e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));
  const send = WebSocket.prototype.send;
  WebSocket.prototype.send = function (data) { window.__sent.push(JSON.parse(data)); return send.call(this, data); };
}"""


async def sent(page, kind: str) -> list[dict]:
    return await page.evaluate("(kind) => window.__sent.filter((f) => f.type === kind)", kind)


async def import_chat(page, messages: list[dict], title: str, system_prompt: str | None = None) -> str:
    """A session holding `messages`, through the server's import route; returns its id."""
    body = {"title": title, "messages": messages}
    if system_prompt:
        body["system_prompt"] = system_prompt
    res = await page.request.post("/v1/sessions/import", data=body)
    assert res.status == 201, await res.text()
    return (await res.json())["id"]


async def open_in_sidebar(page, sid: str) -> None:
    await page.reload()
    row = page.locator(f'[data-testid="session-item"][data-session-id="{sid}"] .session-open')
    await row.click()
    await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open")


async def delete_session(page, sid: str) -> None:
    res = await page.request.delete(f"/v1/sessions/{sid}")
    assert res.status in (204, 404)


# ---- issue 16, item 4 --------------------------------------------------------------------


async def test_json_mode_answer_is_formatted_and_equals_the_stored_answer(page, context):
    await context.grant_permissions(["clipboard-read", "clipboard-write"])
    await page.add_init_script(f"({RECORDER})()")
    await open_app(page, max_tokens=120)
    await page.locator("#open-settings").click()
    dialog = page.get_by_role("dialog", name="Settings")
    switch = dialog.get_by_role("switch", name="JSON mode")
    await switch.check()
    await dialog.get_by_role("button", name="Done").click()
    await expect(page.locator("#sampling-summary")).to_contain_text("JSON")
    # every state the answer's JSON block passes through, as the page renders it
    await page.evaluate("""() => {
      window.__jsonStates = [];
      new MutationObserver(() => {
        const b = document.querySelector('[data-testid="message-assistant"]:last-of-type [data-testid="json-answer"]');
        const s = b && b.dataset.state;
        if (s && window.__jsonStates[window.__jsonStates.length - 1] !== s) window.__jsonStates.push(s);
      }).observe(document.getElementById('messages'), {subtree: true, childList: true, attributes: true});
    }""")

    await send(page, "Give me a JSON object with a key 'ok' set to true.")
    assert await wait_finished(page) == "stop"
    users = await sent(page, "user")
    assert users[-1]["params"]["response_format"] == {"type": "json_object"}

    sid = await current_session_id(page)
    stored = [m for m in await server_history(page, sid) if m["role"] == "assistant"][-1]["content"]
    block = assistant(page).get_by_test_id("json-answer")
    await expect(block).to_have_attribute("data-state", "formatted")
    shown = await block.locator("pre code").text_content()
    assert json.loads(shown) == json.loads(stored)
    assert shown == json.dumps(json.loads(stored), indent=2, ensure_ascii=False)  # pretty-printed
    assert "\n" in shown or len(json.loads(stored)) == 0
    assert await block.locator("pre code .hl-attr").count() >= 1  # highlighted keys
    font = await block.locator("pre code").evaluate("(e) => getComputedStyle(e).fontFamily")
    assert "mono" in font.lower()
    states = await page.evaluate("() => window.__jsonStates")
    assert states[-1] == "formatted" and "streaming" in states, states  # shown as it came, then formatted

    await block.get_by_role("button", name="Copy the answer as the model wrote it").click()
    await expect(block.get_by_role("button", name="Copy the answer as the model wrote it")).to_have_text("Copied")
    assert await page.evaluate("() => navigator.clipboard.readText()") == stored
    await shot(page, "ui-1440-json-answer.png")
    assert await page.evaluate("() => window.__csp") == []
    await delete_session(page, sid)


TOOL_ANSWER = (
    "I'll check the weather first.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "broken", "arguments": {"city": \n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"**not bold**\\", \\"k\\": 3}"}\n</tool_call>\n'
    "Then I'll answer **in bold**."
)


async def test_tool_calls_render_as_cards(page):
    await page.goto("/")
    # through the page's own renderer module
    result = await page.evaluate(
        """async (src) => {
            const m = await import('/static/js/answer.js');
            const box = document.createElement('div');
            box.appendChild(m.renderAnswer(src));
            const cards = [...box.querySelectorAll('[data-testid="tool-call"]')];
            return {
              cards: cards.map((c) => ({name: c.dataset.name, label: c.getAttribute('aria-label'),
                                        args: c.querySelector('[data-testid="tool-call-arguments"]').textContent})),
              text: box.textContent,
              bold: [...box.querySelectorAll('strong')].map((e) => e.textContent),
              plain: m.renderAnswer('<tool_call>{"arguments": {}}</tool_call>').textContent,
              unclosed: m.renderAnswer('<tool_call>\\n{"name": "x"', {streaming: true}).textContent,
            };
        }""",
        TOOL_ANSWER,
    )
    cards = result["cards"]
    assert [c["name"] for c in cards] == ["get_weather", "search"]
    assert cards[0]["label"] == "Tool call: get_weather"
    assert json.loads(cards[0]["args"]) == {"city": "Paris", "unit": "celsius"}
    assert cards[0]["args"] == json.dumps({"city": "Paris", "unit": "celsius"}, indent=2)  # pretty-printed
    assert json.loads(cards[1]["args"]) == {"query": "**not bold**", "k": 3}  # arguments given as a JSON string
    assert '"name": "broken"' in result["text"]  # the malformed block stays as text
    assert "I'll check the weather first." in result["text"]
    assert result["bold"] == ["in bold"]  # the text around the cards is Markdown
    assert result["plain"] == '<tool_call>{"arguments": {}}</tool_call>'  # no name: plain text
    assert result["unclosed"] == '<tool_call>{"name": "x"'  # still streaming: text (the newline is a <br>)

    # through the transcript: a session whose stored answer holds the blocks
    sid = await import_chat(page, [{"role": "user", "content": "Weather in Paris?"},
                                   {"role": "assistant", "content": TOOL_ANSWER}], "Tool calls")
    await open_in_sidebar(page, sid)
    bubble = assistant(page)
    shown = bubble.get_by_test_id("tool-call")
    await expect(shown).to_have_count(2)
    await expect(bubble.get_by_role("group", name="Tool call: get_weather")).to_be_visible()
    await expect(shown.first.locator(".hl-attr").first).to_have_text('"city"')
    await expect(bubble.locator(".md")).to_contain_text('"name": "broken"')
    await shot(page, "ui-1440-tool-calls.png")
    await delete_session(page, sid)


# ---- issue 18, item 5 --------------------------------------------------------------------

CODE_ANSWER = (
    "Here you go:\n\n```python\ndef greet(name):\n    # say hello\n    return f\"Hello, {name}!\" * 2\n```\n\n"
    "and the shell:\n\n```bash\necho \"$HOME\" | wc -c\n```\n\n```unknownlang\n<b>kept as text</b>\n```\n"
)


async def test_code_blocks_are_highlighted_by_the_vendored_library_under_the_csp(page):
    await page.add_init_script(f"({RECORDER})()")
    await page.goto("/")
    vendored = await page.request.get("/static/vendor/highlight/core.min.js")
    assert vendored.ok and "Highlight.js" in (await vendored.text())[:200]
    assert (await page.request.get("/static/vendor/highlight/LICENSE")).ok
    sid = await import_chat(page, [{"role": "user", "content": "Code please"},
                                   {"role": "assistant", "content": CODE_ANSWER}], "Code")
    await open_in_sidebar(page, sid)
    bubble = assistant(page)
    py = bubble.locator("code.language-python")
    await expect(py).to_have_attribute("data-highlighted", "python")
    await expect(py.locator(".hl-keyword").first).to_have_text("def")
    await expect(py.locator(".hl-comment")).to_have_text("# say hello")
    await expect(py.locator(".hl-string").first).to_contain_text("Hello, ")
    assert await py.text_content() == 'def greet(name):\n    # say hello\n    return f"Hello, {name}!" * 2'
    sh = bubble.locator("code.language-bash")
    await expect(sh).to_have_attribute("data-highlighted", "bash")
    assert await sh.locator("span").count() >= 1
    other = bubble.locator("code.language-unknownlang")
    await expect(other).to_have_text("<b>kept as text</b>")
    assert await other.locator("*").count() == 0 and await bubble.locator(".md b").count() == 0
    # the colours differ from plain text: the highlighter's CSS applies
    colours = await py.evaluate("""(c) => [getComputedStyle(c).color,
                                          getComputedStyle(c.querySelector('.hl-keyword')).color]""")
    assert colours[0] != colours[1]
    assert await page.evaluate("() => window.__csp") == []
    await delete_session(page, sid)


async def test_export_markdown_and_json_then_import_the_json_as_a_new_session(page, tmp_path):
    await open_app(page, max_tokens=8)
    await send(page, "Say hello.")
    await wait_finished(page)
    sid = await current_session_id(page)
    history = await server_history(page, sid)
    answer = history[-1]["content"]

    await page.get_by_test_id("open-transfer").click()
    dialog = page.get_by_role("dialog", name="Export or import")
    await expect(dialog).to_be_visible()
    async with page.expect_download() as info:
        await dialog.get_by_role("button", name="Markdown (.md)").click()
    md_download = await info.value
    assert md_download.suggested_filename.endswith(".md")
    md = (tmp_path / "chat.md")
    await md_download.save_as(md)
    text = md.read_text()
    assert text.startswith("# Say hello.") and "## You\n\nSay hello.\n" in text and f"## Assistant\n\n{answer}" in text

    async with page.expect_download() as info:
        await dialog.get_by_role("button", name="JSON (.json)").click()
    json_download = await info.value
    exported_path = tmp_path / "chat.json"
    await json_download.save_as(exported_path)
    exported = json.loads(exported_path.read_text())
    assert exported["format"] == "chatcore.chat" and exported["id"] == sid
    assert [(m["role"], m["content"]) for m in exported["messages"]] == [(m["role"], m["content"]) for m in history]
    assert exported["messages"][1]["usage"]["completion_tokens"] >= 1
    assert exported["system_prompt"] == (await (await page.request.get(f"/v1/sessions/{sid}")).json())["system_prompt"]

    # a file that is not an export says so and creates nothing
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    await dialog.get_by_label("A JSON export, as a new chat").set_input_files(str(bad))
    await expect(dialog.get_by_test_id("import-alert")).to_contain_text("not a chat export")

    await dialog.get_by_label("A JSON export, as a new chat").set_input_files(str(exported_path))
    await expect(dialog).to_be_hidden()
    await page.wait_for_function("(sid) => { const c = JSON.parse(localStorage.getItem('chatcore.current'));"
                                 " return c && c !== sid; }", arg=sid)
    new_sid = await current_session_id(page)
    await expect(page.get_by_test_id("connection")).to_have_attribute("data-state", "open")
    await expect(page.get_by_test_id("message-user")).to_have_text(["Say hello."])
    await expect(page.get_by_test_id("message-assistant")).to_have_count(1)
    await expect(page.locator("#system-card")).to_be_attached()
    imported = await server_history(page, new_sid)
    assert [(m["role"], m["content"]) for m in imported] == [(m["role"], m["content"]) for m in history]
    await expect(page.locator(f'[data-testid="session-item"][data-session-id="{new_sid}"]')).to_be_visible()
    # the imported chat goes on: the next answer reads the imported history
    await send(page, "Thanks!")
    await wait_finished(page)
    later = await server_history(page, new_sid)
    assert len(later) == 4 and later[-1]["usage"]["prompt_tokens"] > history[-1]["usage"]["prompt_tokens"]
    for s in (sid, new_sid):
        await delete_session(page, s)


async def background(page) -> str:
    return await page.evaluate("() => getComputedStyle(document.body).backgroundColor")


async def test_theme_toggle_persists_and_system_is_followed(page):
    await page.emulate_media(color_scheme="light")
    await page.goto("/")
    toggle = page.get_by_test_id("theme-toggle")
    await expect(toggle).to_have_attribute("aria-pressed", "false")
    light = await background(page)
    assert await page.evaluate("() => document.documentElement.dataset.theme") is None

    await toggle.click()  # dark, although the system is light
    await expect(toggle).to_have_attribute("aria-pressed", "true")
    await expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    dark = await background(page)
    assert dark != light
    await shot(page, "ui-1440-forced-dark.png")
    await page.reload()  # persists (applied before the first paint by theme-boot.js)
    await expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    assert await background(page) == dark
    await expect(page.get_by_test_id("theme-toggle")).to_have_attribute("aria-pressed", "true")

    # back to following the system, from the settings
    await page.locator("#open-settings").click()
    dialog = page.get_by_role("dialog", name="Settings")
    await expect(dialog.get_by_role("radio", name="Dark")).to_be_checked()
    await dialog.get_by_role("radio", name="System").check()
    await dialog.get_by_role("button", name="Done").click()
    await expect(page.locator("html")).not_to_have_attribute("data-theme", re.compile(".*"))
    assert await background(page) == light
    await page.emulate_media(color_scheme="dark")
    await page.wait_for_function("(bg) => getComputedStyle(document.body).backgroundColor === bg", arg=dark)
    await expect(page.get_by_test_id("theme-toggle")).to_have_attribute("aria-pressed", "true")
    await page.reload()
    assert await page.evaluate("() => document.documentElement.dataset.theme") is None
    assert await background(page) == dark


async def test_settings_system_prompt_top_p_temperature_and_the_servers_max_tokens(page):
    await page.add_init_script(f"({RECORDER})()")
    await page.goto("/")
    await page.locator("#open-settings").click()
    dialog = page.get_by_role("dialog", name="Settings")
    await dialog.get_by_label("System prompt for new chats").fill("You are a pirate. Answer briefly.")
    await dialog.get_by_label("Temperature").fill("0.3")
    await dialog.get_by_label("Top-p").fill("0.5")
    max_tokens = dialog.get_by_label("Max tokens")
    await max_tokens.fill("6")
    assert await dialog.get_by_role("switch", name="JSON mode").is_checked() is False
    await dialog.get_by_role("button", name="Done").click()
    await expect(page.locator("#sampling-summary")).to_have_text("temperature 0.3 · top-p 0.5 · max 6 tokens")
    await expect(page.get_by_label("System prompt", exact=True)).to_have_value("You are a pirate. Answer briefly.")

    await send(page, "Who are you?")
    await wait_finished(page)
    hello = (await sent(page, "hello"))[-1]
    assert hello["system_prompt"] == "You are a pirate. Answer briefly."
    params = (await sent(page, "user"))[-1]["params"]
    assert params["temperature"] == 0.3 and params["top_p"] == 0.5 and params["max_tokens"] == 6
    assert "response_format" not in params
    sid = await current_session_id(page)
    detail = await (await page.request.get(f"/v1/sessions/{sid}")).json()
    assert detail["system_prompt"] == "You are a pirate. Answer briefly."
    assert detail["history"][-1]["usage"]["completion_tokens"] <= 6

    # the session frame told the page the server's limit; the control is bounded by it
    limit = await page.evaluate("() => JSON.parse(localStorage.getItem('chatcore.settings')).serverMaxTokens")
    assert isinstance(limit, int) and limit > 6
    await page.locator("#open-settings").click()
    await expect(max_tokens).to_have_attribute("max", str(limit))
    await expect(dialog.locator("#max-tokens-help")).to_contain_text(f"{limit:,}")
    await max_tokens.fill("32768")
    await max_tokens.press("Tab")  # change: the field shows the value kept
    await expect(max_tokens).to_have_value(str(limit))
    await dialog.get_by_role("button", name="Done").click()
    await expect(page.locator("#sampling-summary")).to_contain_text(f"max {limit} tokens")
    await page.reload()  # the limit and the settings persist
    await page.locator("#open-settings").click()
    await expect(max_tokens).to_have_attribute("max", str(limit))
    await expect(dialog.get_by_label("Top-p")).to_have_value("0.5")
    await expect(dialog.get_by_label("System prompt for new chats")).to_have_value("You are a pirate. Answer briefly.")
    await shot(page, "ui-1440-settings.png")
    await delete_session(page, sid)


async def test_keyboard_shortcuts_are_listed_and_work(page):
    await open_app(page, max_tokens=256)
    body = page.locator("body")
    await page.locator("#chat-title").click()  # focus out of the composer
    await page.keyboard.press("?")
    help_dialog = page.get_by_role("dialog", name="Keyboard shortcuts")
    await expect(help_dialog).to_be_visible()
    rows = help_dialog.get_by_test_id("shortcut")
    await expect(rows).to_have_count(5)
    await expect(rows.locator("dd")).to_have_text(
        ["New chat", "Regenerate the last answer", "Focus the message box", "Stop the answer", "Show these shortcuts"])
    await shot(page, "ui-1440-shortcuts.png")
    await page.keyboard.press("Escape")
    await expect(help_dialog).to_be_hidden()
    await page.get_by_test_id("open-help").click()
    await expect(help_dialog).to_be_visible()
    await help_dialog.get_by_role("button", name="Close").click()

    await page.locator("#chat-title").click()
    await page.keyboard.press("/")
    await expect(page.get_by_test_id("composer")).to_be_focused()
    await expect(page.get_by_test_id("composer")).to_have_value("")  # the key did not type

    await send(page, LONG_PROMPT)
    await wait_text(page)
    await page.locator("#chat-title").click()  # stop works from anywhere on the page
    await expect(page.get_by_test_id("composer")).not_to_be_focused()
    await body.press("Escape")
    assert await wait_finished(page) == "cancelled"
    sid = await current_session_id(page)

    await page.keyboard.press("Shift+Escape")
    await expect(page.get_by_test_id("composer")).to_be_focused()
    await page.keyboard.press("Control+Shift+O")
    await expect(page.locator("#chat-title")).to_have_text("New chat")
    await expect(page.get_by_test_id("message-assistant")).to_have_count(0)
    await expect(page.get_by_test_id("composer")).to_be_focused()
    await delete_session(page, sid)


async def test_a_fresh_page_knows_the_server_s_max_tokens_before_any_chat(page, live_server):
    status, limits = live_server.get("/v1/limits")
    assert status == 200 and limits["max_tokens"] == 2048 and limits["context"] > limits["max_tokens"]
    await page.goto("/")  # a new browser profile: nothing stored, no chat opened
    await page.locator("#open-settings").click()
    dialog = page.get_by_role("dialog", name="Settings")
    max_tokens = dialog.get_by_label("Max tokens")
    await expect(max_tokens).to_have_attribute("max", str(limits["max_tokens"]))
    await max_tokens.fill("32768")
    await max_tokens.press("Tab")
    await expect(max_tokens).to_have_value(str(limits["max_tokens"]))
