"""Regenerate and edit-and-resend in the browser UI (issue 18, item 5), in Debian's headless Chromium
against the real server and model: both branch the conversation through
`POST /v1/sessions/{id}/branch`, open the branch as a new chat, and send there; the branch's turn
reuses the original's KV blocks, so its statistics show cached tokens. Nothing sleeps."""
# ruff: noqa: F811  (the browser fixtures are imported from test_web_ui and requested by name)

from __future__ import annotations

import re

import pytest

from tests.test_web_ui import (  # noqa: F401  (fixtures)
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
)

pytestmark = [pytest.mark.browser, pytest.mark.model]

FIRST, SECOND = "What is the capital of France?", "And of Italy?"

# While a turn runs (the Stop button is enabled), no edit or regenerate button may be enabled;
# recorded on every change of the transcript or the composer, so a short turn cannot slip by.
GUARD = """() => {
  window.__ran = false;
  window.__violations = [];
  new MutationObserver(() => {
    const stop = document.getElementById('stop');
    if (!stop || stop.disabled) return;
    window.__ran = true;
    const on = [...document.querySelectorAll('[data-action="edit"], [data-action="regenerate"]')].filter((b) => !b.disabled);
    if (on.length) window.__violations.push(on.map((b) => b.dataset.action).join(','));
  }).observe(document, {subtree: true, attributes: true, childList: true});
}"""


async def chat(page, *messages: str) -> str:
    """A new chat holding `messages`, each answered; returns its id."""
    for i, text in enumerate(messages):
        await send(page, text)
        await wait_finished(page, i)
    return await current_session_id(page)


async def switched_from(page, original: str) -> str:
    """The id of the chat the page switched to (a branch of `original`)."""
    await page.wait_for_function(
        "(o) => { const c = JSON.parse(localStorage.getItem('chatcore.current')); return c && c !== o; }", arg=original)
    return await current_session_id(page)


async def cached_tokens(page) -> int:
    usage = assistant(page).get_by_test_id("usage")
    await expect(usage).to_have_attribute("data-cached-tokens", re.compile(r"^\d+$"))  # the branch's answer is done
    return int(await usage.get_attribute("data-cached-tokens"))


async def assert_branch(page, original: str, branch: str, before: list[dict], expected_users: list[str]) -> dict:
    """The branch is a stored chat of its own, listed beside the original; the original is unchanged."""
    assert branch != original
    stored = await page.evaluate("(id) => JSON.parse(localStorage.getItem('chatcore.session.' + id))", branch)
    assert stored and stored["token"], stored  # resumable like any chat the page made
    for sid in (original, branch):
        await expect(page.locator(f'[data-testid="session-item"][data-session-id="{sid}"]')).to_have_count(1)
    detail = await (await page.request.get(f"/v1/sessions/{branch}")).json()
    assert [m["content"] for m in detail["history"] if m["role"] == "user"] == expected_users
    assert detail["history"][-1]["role"] == "assistant" and detail["history"][-1]["usage"]["cached_tokens"] > 0
    after = await server_history(page, original)
    assert [(m["role"], m["content"]) for m in after] == [(m["role"], m["content"]) for m in before]
    return detail


async def delete_sessions(page, *ids: str) -> None:
    for sid in ids:
        res = await page.request.delete(f"/v1/sessions/{sid}")
        assert res.status in (204, 404)


async def test_regenerate_the_last_answer_in_a_branch_that_reuses_the_cache(page):
    await page.add_init_script(f"({GUARD})()")
    await open_app(page, max_tokens=8)
    original = await chat(page, FIRST, SECOND)
    before = await server_history(page, original)
    title = (await (await page.request.get(f"/v1/sessions/{original}")).json())["title"]
    # only the last answer offers it
    await expect(page.get_by_test_id("regenerate")).to_have_count(2)
    await expect(assistant(page, 0).get_by_test_id("regenerate")).to_be_hidden()
    button = assistant(page).get_by_role("button", name="Regenerate this answer")
    await expect(button).to_be_enabled()

    await button.click()
    branch = await switched_from(page, original)
    await expect(page.get_by_test_id("message-user")).to_have_text([FIRST, SECOND])
    await expect(page.get_by_test_id("message-assistant")).to_have_count(2)
    await wait_finished(page, 1)
    assert await cached_tokens(page) > 0
    assert await page.evaluate("() => window.__ran") and await page.evaluate("() => window.__violations") == []
    await expect(page.locator("#chat-title")).to_have_text(f"{title} (branch)")

    detail = await assert_branch(page, original, branch, before, [FIRST, SECOND])
    assert detail["history"][:2] and [m["content"] for m in detail["history"][:2]] == [m["content"] for m in before[:2]]
    await expect(assistant(page).get_by_test_id("regenerate")).to_be_enabled()  # offered again, on the new answer
    await shot(page, "ui-1440-regenerated.png")
    await delete_sessions(page, original, branch)


async def test_edit_the_first_message_and_resend_it_in_a_branch(page):
    await page.add_init_script(f"({GUARD})()")
    await open_app(page, max_tokens=8)
    original = await chat(page, FIRST, SECOND)
    before = await server_history(page, original)
    first = page.get_by_test_id("message-user").first
    await expect(page.get_by_test_id("edit-message")).to_have_count(2)

    # Cancel leaves everything as it was
    await first.hover()
    await first.get_by_role("button", name="Edit and resend this message").click()
    editor = first.get_by_test_id("edit-input")
    await expect(editor).to_be_focused()
    await expect(editor).to_have_value(FIRST)
    await first.get_by_role("button", name="Cancel").click()
    await expect(editor).to_have_count(0)
    await expect(first).to_have_text(FIRST)
    await expect(first.get_by_test_id("edit-message")).to_be_focused()

    await first.get_by_test_id("edit-message").click()
    await editor.fill("")
    await expect(first.get_by_test_id("edit-send")).to_be_disabled()  # nothing to send
    edited = "What is the capital of Spain?"
    await first.get_by_label("Edited message").fill(edited)
    await shot(page, "ui-1440-edit-message.png")
    await first.get_by_test_id("edit-send").click()

    branch = await switched_from(page, original)
    await expect(page.get_by_test_id("message-user")).to_have_text([edited])
    await wait_finished(page, 0)
    assert await cached_tokens(page) > 0  # the system prompt's blocks, at least
    assert await page.evaluate("() => window.__ran") and await page.evaluate("() => window.__violations") == []
    detail = await assert_branch(page, original, branch, before, [edited])
    assert len(detail["history"]) == 2
    await delete_sessions(page, original, branch)


async def test_the_shortcut_regenerates_and_the_help_dialog_lists_it(page):
    await open_app(page, max_tokens=8)
    await page.locator("#chat-title").click()
    await page.keyboard.press("?")
    help_dialog = page.get_by_role("dialog", name="Keyboard shortcuts")
    row = help_dialog.locator('[data-testid="shortcut"][data-shortcut="regenerate"]')
    await expect(row.locator("dd")).to_have_text("Regenerate the last answer")
    await expect(row.locator("kbd")).to_have_text(["Ctrl", "Shift", "Enter"])
    await page.keyboard.press("Escape")
    await expect(help_dialog).to_be_hidden()

    original = await chat(page, FIRST)
    before = await server_history(page, original)
    await expect(page.get_by_test_id("composer")).to_be_focused()
    await page.keyboard.press("Control+Shift+Enter")
    branch = await switched_from(page, original)
    await expect(page.get_by_test_id("message-user")).to_have_text([FIRST])
    await wait_finished(page, 0)
    assert await cached_tokens(page) > 0
    await expect(page.get_by_test_id("composer")).to_have_value("")  # the keys typed nothing
    await assert_branch(page, original, branch, before, [FIRST])
    await delete_sessions(page, original, branch)
