// The page: wires the session list, the transcript, the composer, settings and the cache
// panel to ChatSession controllers (session.js). Rendering is batched per animation frame.

import { CachePanel } from "./cache-panel.js";
import { Api, ApiError } from "./protocol.js";
import { ChatSession } from "./session.js";
import { store } from "./store.js";
import { SHORTCUTS, matchShortcut, renderShortcutList } from "./shortcuts.js";
import { renderSessionItem } from "./sidebar.js";
import { applyTheme, effectiveTheme, onSystemThemeChange } from "./theme.js";
import { download, exportJSON, exportMarkdown, fileName, importBody } from "./transfer.js";
import { h, hydrateIcons, icon, renderMessage, renderMessageEditor, updateAssistantMessage } from "./ui.js";

const PRESETS = [
  {
    name: "Assistant",
    text:
      "You are chatcore's assistant: helpful, honest and concise. Answer the user's questions clearly and accurately. " +
      "Use Markdown when it helps: short paragraphs, bullet lists, and fenced code blocks with a language tag for any code.",
  },
  {
    name: "Coder",
    text:
      "You are a senior software engineer. Give correct, idiomatic and well-tested code with a short explanation. " +
      "Put every code sample in a fenced code block with its language, prefer the standard library, and point out edge cases.",
  },
  {
    name: "Storyteller",
    text:
      "You are a creative storyteller. Write vivid, imaginative and well-paced stories with memorable characters, " +
      "concrete sensory details and a satisfying ending. Keep the language simple enough for a young reader.",
  },
  { name: "None", text: "" },
];

const $ = (id) => document.getElementById(id);
const el = {
  app: $("app"),
  sidebar: $("sidebar"),
  backdrop: $("backdrop"),
  menuBtn: $("menu-btn"),
  sidebarClose: $("sidebar-close"),
  newSession: $("new-session"),
  sessionList: $("session-list"),
  sessionEmpty: $("session-empty"),
  title: $("chat-title"),
  meta: $("chat-meta"),
  connection: $("connection"),
  connectionLabel: $("connection-label"),
  cacheToggle: $("cache-toggle"),
  cachePanel: $("cache-panel"),
  banner: $("banner"),
  bannerText: $("banner-text"),
  bannerAction: $("banner-action"),
  transcript: $("transcript"),
  welcome: $("welcome"),
  presets: $("presets"),
  systemPrompt: $("system-prompt"),
  systemCard: $("system-card"),
  systemCardText: $("system-card-text"),
  messages: $("messages"),
  jump: $("jump"),
  composer: $("composer"),
  input: $("composer-input"),
  send: $("send"),
  stop: $("stop"),
  samplingSummary: $("sampling-summary"),
  settings: $("settings"),
  temperature: $("temperature"),
  temperatureOut: $("temperature-out"),
  topP: $("top-p"),
  topPOut: $("top-p-out"),
  maxTokens: $("max-tokens"),
  maxTokensHelp: $("max-tokens-help"),
  jsonMode: $("json-mode"),
  settingsSystemPrompt: $("settings-system-prompt"),
  themeToggle: $("theme-toggle"),
  transfer: $("transfer"),
  openTransfer: $("open-transfer"),
  exportMd: $("export-md"),
  exportJson: $("export-json"),
  importFile: $("import-file"),
  importAlert: $("import-alert"),
  help: $("help"),
  openHelp: $("open-help"),
  apiKey: $("api-key"),
  apiKeyAlert: $("api-key-alert"),
  toasts: $("toasts"),
};

let settings = store.settings();
const getKey = () => settings.apiKey || "";
const api = new Api(getKey);

const controllers = new Map(); // session id -> ChatSession with a socket
let current = null; // the ChatSession on screen (id null: a new chat not sent yet)
let serverSessions = []; // GET /v1/sessions
const msgEls = new Map(); // message key -> element, for the session on screen
const dirty = new Set();
let frameQueued = false;
let stickToBottom = true;
let editing = null; // {id, mode: "rename"|"delete"}
let branching = false; // a branch is being made (regenerate, edit and resend)

// ---- toasts and banner ----------------------------------------------------------------

function toast(text, kind = "info") {
  const t = h("div", { class: `toast toast-${kind}` }, text);
  el.toasts.appendChild(t);
  setTimeout(() => t.classList.add("toast-out"), 5000);
  setTimeout(() => t.remove(), 5600);
}

function showBanner(text, actionLabel, action) {
  el.bannerText.textContent = text;
  el.bannerAction.textContent = actionLabel;
  el.bannerAction.onclick = () => {
    hideBanner();
    action();
  };
  el.banner.hidden = false;
}

function hideBanner() {
  el.banner.hidden = true;
}

/** Tell screen readers that an answer ended (streaming text itself is not announced). */
function announce(msg) {
  const words = { stop: "The answer is complete.", length: "The answer reached the max tokens.", cancelled: "The answer was stopped." };
  $("sr-status").textContent = words[msg.finish] || `The answer ended: ${msg.finish}.`;
}

// ---- controllers ------------------------------------------------------------------------

function makeController(opts) {
  const s = new ChatSession({ api, getKey, ...opts });
  const mine = () => s === current;
  s.addEventListener("reset", () => mine() && renderTranscript());
  s.addEventListener("earlier", () => mine() && renderTranscript({ keepPosition: true }));
  s.addEventListener("message", (e) => mine() && onMessage(e.detail.msg));
  s.addEventListener("removed", (e) => {
    if (!mine()) return;
    const node = msgEls.get(e.detail.msg.key);
    if (node) node.remove();
    msgEls.delete(e.detail.msg.key);
    updateWelcome();
    syncMessageActions();
  });
  s.addEventListener("running", () => {
    if (mine()) {
      updateComposer();
      syncMessageActions();
    }
    markRunning(s);
  });
  s.addEventListener("conn", () => mine() && updateConnection());
  s.addEventListener("window", () => mine() && placeWindowMarker());
  s.addEventListener("limits", (e) => {
    setServerLimits(e.detail);
    // a first message sent before the limit was known: bound it before its user frame goes out
    const limit = settings.serverMaxTokens;
    if (limit && s.pending && s.pending.params && s.pending.params.max_tokens > limit) s.pending.params.max_tokens = limit;
  });
  s.addEventListener("meta", () => {
    if (mine()) updateHeader();
    const row = serverSessions.find((x) => x.id === s.id);
    if (row && s.title && row.title !== s.title) {
      row.title = s.title;
      renderSessionList();
    }
  });
  s.addEventListener("created", () => {
    controllers.set(s.id, s);
    if (mine()) store.setCurrent(s.id);
    if (!serverSessions.some((x) => x.id === s.id)) {
      serverSessions.unshift({ id: s.id, title: s.title, state: "hot", turns: 0, last_active_at: new Date().toISOString() });
    }
    renderSessionList();
    updateHeader();
    refreshSessions();
  });
  s.addEventListener("done", (e) => {
    if (mine()) announce(e.detail.msg);
    refreshSessions();
    cachePanel.refresh();
    if (!mine()) {
      s.close();
      controllers.delete(s.id);
    }
  });
  s.addEventListener("rejected", (e) => {
    if (!mine()) return;
    if (!el.input.value) {
      el.input.value = e.detail.content;
      autosize();
    }
    updateComposer();
    toast(`Not sent (${e.detail.code}): ${e.detail.message}`, "error");
  });
  s.addEventListener("notice", (e) => mine() && toast(e.detail.text, e.detail.kind));
  s.addEventListener("gone", () => {
    toast("That chat is not on the server (deleted, or not visible with this API key).", "error");
    forget(s.id);
    if (mine()) newChat();
  });
  s.addEventListener("conflict", () => {
    if (!mine()) {
      controllers.delete(s.id);
      return;
    }
    updateConnection();
    showBanner("This chat was opened in another tab or window.", "Use it here", () => s.takeOver());
  });
  s.addEventListener("auth", () => {
    if (mine()) updateConnection();
    openSettings("This server needs a valid API key.");
  });
  return s;
}

function forget(id) {
  store.forgetSession(id);
  const c = controllers.get(id);
  if (c) c.close();
  controllers.delete(id);
  serverSessions = serverSessions.filter((x) => x.id !== id);
  renderSessionList();
}

function leaveCurrent() {
  const s = current;
  if (!s) return;
  if (s.id && !s.running) {
    s.close();
    controllers.delete(s.id);
  } else if (!s.id && !s.running) {
    s.close();
  }
}

function show(session) {
  current = session;
  hideBanner();
  editing = null;
  renderTranscript();
  updateHeader();
  updateComposer();
  updateConnection();
  renderSessionList();
  cachePanel.refresh();
}

function newChat() {
  leaveCurrent();
  store.setCurrent(null);
  show(makeController({}));
  closeSidebar();
  el.input.focus({ preventScroll: true });
}

function openSession(id) {
  if (current && current.id === id) {
    closeSidebar();
    return;
  }
  leaveCurrent();
  let s = controllers.get(id);
  if (!s) {
    const row = serverSessions.find((x) => x.id === id);
    s = makeController({ id, title: row ? row.title : store.session(id)?.title || "" });
    controllers.set(id, s);
  }
  store.setCurrent(id);
  show(s);
  s.connect();
  closeSidebar();
  el.input.focus({ preventScroll: true });
}

// ---- transcript -------------------------------------------------------------------------

function renderTranscript({ keepPosition = false } = {}) {
  const fromBottom = el.transcript.scrollHeight - el.transcript.scrollTop;
  msgEls.clear();
  dirty.clear();
  const nodes = current.messages.map((m) => {
    const node = renderMessage(m);
    msgEls.set(m.key, node);
    return node;
  });
  el.messages.replaceChildren(...(current.offset > 0 ? [earlierButton()] : []), ...nodes);
  placeWindowMarker();
  updateWelcome();
  syncMessageActions();
  if (keepPosition) {
    // earlier messages went in above: the ones on screen stay where they were
    el.transcript.scrollTop = el.transcript.scrollHeight - fromBottom;
    return;
  }
  stickToBottom = true;
  scrollToBottom();
}

/** The history's earlier pages load on demand: this button, or scrolling to the top. */
function earlierButton() {
  const count = current.offset;
  return h("button", { type: "button", class: "load-earlier", "data-testid": "load-earlier",
                       onclick: () => current && current.loadEarlier(),
                       text: `Load earlier messages (${count} more)` });
}

/** A marker before the first exchange the model still sees. Exchanges that ended in an error are
 * not in the server's history, so they do not count. */
function placeWindowMarker() {
  el.messages.querySelector('[data-testid="truncation-marker"]')?.remove();
  const dropped = current ? current.truncatedTurns : 0;
  if (!dropped || dropped < current.offset / 2) return; // the view starts above the loaded messages
  const msgs = current.messages;
  let kept = current.offset / 2;
  for (let i = 0; i < msgs.length; i++) {
    if (msgs[i].role !== "user") continue;
    const answer = msgs[i + 1];
    if (answer && answer.role === "assistant" && answer.finish === "error") continue;
    if (kept++ < dropped) continue;
    const node = msgEls.get(msgs[i].key);
    if (!node || node.parentNode !== el.messages) return;
    const label = dropped === 1 ? "exchange" : "exchanges";
    const marker = h("div", { class: "window-marker", role: "note", "data-testid": "truncation-marker",
                              "data-truncated": String(dropped) },
      h("span", { text: `The model no longer sees the ${dropped} ${label} above; they stay in this chat.` }));
    el.messages.insertBefore(marker, node);
    return;
  }
}

function updateWelcome() {
  const draft = current && current.id === null && current.messages.length === 0;
  el.welcome.hidden = !draft;
  const sp = current && current.systemPrompt;
  el.systemCard.hidden = draft || !sp;
  el.systemCardText.textContent = sp || "";
  el.transcript.classList.toggle("is-empty", draft);
}

function onMessage(msg) {
  let node = msgEls.get(msg.key);
  if (!node) {
    node = renderMessage(msg);
    msgEls.set(msg.key, node);
    // keep DOM order equal to the model's order
    const idx = current.messages.indexOf(msg);
    let before = null;
    for (let i = idx + 1; i < current.messages.length && !before; i++) before = msgEls.get(current.messages[i].key) || null;
    el.messages.insertBefore(node, before && before.parentNode === el.messages ? before : null);
    updateWelcome();
    syncMessageActions();
    scheduleScroll();
    return;
  }
  if (msg.role === "assistant") {
    dirty.add(msg);
    queueFrame();
  }
}

function queueFrame() {
  if (frameQueued) return;
  frameQueued = true;
  requestAnimationFrame(() => {
    frameQueued = false;
    for (const msg of dirty) {
      const node = msgEls.get(msg.key);
      if (node) updateAssistantMessage(node, msg);
    }
    dirty.clear();
    if (stickToBottom) scrollToBottom();
  });
}

function scheduleScroll() {
  if (stickToBottom) queueFrame();
}

function scrollToBottom() {
  el.transcript.scrollTop = el.transcript.scrollHeight;
}

el.transcript.addEventListener(
  "scroll",
  () => {
    const gap = el.transcript.scrollHeight - el.transcript.scrollTop - el.transcript.clientHeight;
    stickToBottom = gap < 80;
    el.jump.hidden = stickToBottom;
    if (el.transcript.scrollTop < 40 && current && current.offset > 0) current.loadEarlier();
  },
  { passive: true }
);
el.jump.addEventListener("click", () => {
  stickToBottom = true;
  el.jump.hidden = true;
  el.transcript.scrollTo({ top: el.transcript.scrollHeight, behavior: "smooth" });
});

el.messages.addEventListener("click", async (e) => {
  const action = e.target.closest("[data-action='edit'], [data-action='edit-cancel'], [data-action='regenerate']");
  if (action) {
    const node = action.closest(".msg");
    const msg = current && current.messages.find((m) => m.key === node?.dataset.key);
    if (!msg) return;
    if (action.dataset.action === "edit") openEditor(node, msg);
    else if (action.dataset.action === "edit-cancel") closeEditor(node, true);
    else regenerate(msg);
    return;
  }
  const btn = e.target.closest("[data-action='copy-code'], [data-action='copy-raw']");
  if (!btn) return;
  const raw = btn.dataset.action === "copy-raw";
  const code = btn.closest(".codeblock")?.querySelector(raw ? "code.json-raw" : "code");
  const text = code ? code.textContent : "";
  try {
    await navigator.clipboard.writeText(text);
    btn.textContent = "Copied";
  } catch {
    btn.textContent = "Copy failed";
  }
  setTimeout(() => (btn.textContent = raw ? "Copy raw" : "Copy"), 1500);
});

// ---- regenerate, edit and resend: both branch the conversation ------------------------

const REGENERATE_KEYS = SHORTCUTS.find((x) => x.id === "regenerate").aria;

/** The answer that Regenerate applies to: the last message, when it is a finished answer to a user message. */
function regenerateTarget() {
  const msgs = current ? current.messages : [];
  const last = msgs[msgs.length - 1];
  return last && last.role === "assistant" && !last.streaming && msgs[msgs.length - 2]?.role === "user" ? last : null;
}

/** Regenerate on the last finished answer only; edit on every user message; none while a turn runs. */
function syncMessageActions() {
  if (!current) return;
  const busy = current.running || branching || !current.id;
  const target = regenerateTarget();
  for (const m of current.messages) {
    const node = msgEls.get(m.key);
    if (!node) continue;
    if (m.role === "user") {
      const edit = node.querySelector("[data-action='edit']");
      if (edit) edit.disabled = busy;
      const send = node.querySelector("[data-testid='edit-send']");
      if (send) send.disabled = busy || !node.querySelector("[data-testid='edit-input']").value.trim();
    } else {
      const regen = node.querySelector("[data-action='regenerate']");
      if (!regen) continue;
      regen.hidden = m !== target;
      regen.disabled = busy;
      regen.setAttribute("aria-keyshortcuts", REGENERATE_KEYS);
    }
  }
}

function openEditor(node, msg) {
  for (const other of el.messages.querySelectorAll(".msg-user.is-editing")) closeEditor(other, false);
  const form = renderMessageEditor(msg.content);
  const input = form.querySelector("textarea");
  const fit = () => {
    input.style.height = "auto";
    input.style.height = `${Math.min(input.scrollHeight + 2, Math.round(window.innerHeight * 0.4))}px`;
  };
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    resendEdited(msg, input.value);
  });
  input.addEventListener("input", () => {
    fit();
    form.querySelector("[data-testid='edit-send']").disabled = !input.value.trim() || !!(current && current.running) || branching;
  });
  input.addEventListener("keydown", (e) => {
    e.stopPropagation(); // the page's shortcuts stay out of the editor
    if (e.key === "Enter" && !e.shiftKey && !e.ctrlKey && !e.metaKey && !e.isComposing && e.keyCode !== 229) {
      e.preventDefault();
      form.requestSubmit();
    } else if (e.key === "Escape") {
      e.preventDefault();
      closeEditor(node, true);
    }
  });
  node.classList.add("is-editing");
  node.appendChild(form);
  syncMessageActions();
  fit();
  input.focus();
  input.setSelectionRange(input.value.length, input.value.length);
}

function closeEditor(node, refocus) {
  node.querySelector(".msg-editor")?.remove();
  node.classList.remove("is-editing");
  if (refocus) node.querySelector("[data-action='edit']")?.focus();
}

function regenerate(answer) {
  const msgs = current ? current.messages : [];
  const i = msgs.indexOf(answer);
  if (answer !== regenerateTarget() || i < 1) return;
  branchAndSend(current.exchangesBefore(i - 1), msgs[i - 1].content);
}

function resendEdited(userMsg, text) {
  const i = current ? current.messages.indexOf(userMsg) : -1;
  if (i < 0 || !text.trim()) return;
  branchAndSend(current.exchangesBefore(i), text);
}

/** Branch the open chat after its first `turns` complete exchanges (POST /v1/sessions/{id}/branch),
 * open the branch like any chat this page made, and send `text` there once its history is loaded.
 * The original stays as it was; the branch's turn reuses its KV blocks (the cached tokens show it). */
async function branchAndSend(turns, text) {
  const source = current;
  if (!source || !source.id || source.running || branching) return;
  branching = true;
  syncMessageActions();
  let res;
  try {
    res = await api.branchSession(source.id, turns);
  } catch (err) {
    toast(`Could not branch this chat: ${err.message}`, "error");
    return;
  } finally {
    branching = false;
    syncMessageActions();
  }
  store.saveSession(res.id, { token: res.resume_token, title: res.title });
  if (!serverSessions.some((x) => x.id === res.id)) {
    serverSessions.unshift({ id: res.id, title: res.title, state: "hot", turns: res.turns, last_active_at: new Date().toISOString() });
  }
  openSession(res.id);
  stickToBottom = true;
  current.sendWhenLoaded(text, sendParams());
  refreshSessions();
}

// ---- header ----------------------------------------------------------------------------

function updateHeader() {
  const s = current;
  const title = s && s.id ? s.title || "Untitled chat" : "New chat";
  el.title.textContent = title;
  document.title = `${title} · chatcore`;
  const parts = [];
  const info = s && s.info;
  if (info) {
    if (info.state) parts.push(info.state);
    const c = info.cache || {};
    if (typeof c.history_tokens === "number") parts.push(`${c.history_tokens.toLocaleString("en-US")} tokens`);
    if (typeof c.device_blocks === "number") parts.push(`${c.device_blocks} blocks on device`);
  } else if (!s || !s.id) {
    parts.push("Not started");
  }
  el.meta.textContent = parts.join(" · ");
  el.meta.title = info && info.state ? `Session state: hot (KV on the device), warm or cold (KV on disk / recomputed)` : "";
  updateWelcome();
}

function updateConnection() {
  const s = current;
  const state = s ? s.connState : "closed";
  el.connection.dataset.state = state;
  let label = "Idle";
  if (state === "open") label = "Connected";
  else if (state === "connecting") label = s && s.socket && s.socket.attempt > 0 ? "Reconnecting…" : "Connecting…";
  else if (s && s.id) label = "Disconnected";
  el.connectionLabel.textContent = label;
  el.connection.title = `WebSocket: ${state}`;
}

// ---- composer --------------------------------------------------------------------------

function autosize() {
  el.input.style.height = "auto";
  el.input.style.height = `${Math.min(el.input.scrollHeight, Math.round(window.innerHeight * 0.4))}px`;
}

function updateComposer() {
  const running = !!(current && current.running);
  el.stop.disabled = !running;
  el.send.disabled = running || !el.input.value.trim();
  el.composer.classList.toggle("is-running", running);
  const num = (x) => Number(x).toFixed(2).replace(/\.?0+$/, "") || "0";
  const parts = [`temperature ${num(settings.temperature)}`];
  if (Number(settings.topP) < 1) parts.push(`top-p ${num(settings.topP)}`);
  parts.push(`max ${settings.maxTokens} tokens`);
  if (settings.jsonMode) parts.push("JSON");
  el.samplingSummary.textContent = parts.join(" · ");
}

/** A turn's parameters, from the settings. */
function sendParams() {
  const params = { temperature: Number(settings.temperature), max_tokens: Number(settings.maxTokens) };
  if (Number(settings.topP) < 1) params.top_p = Number(settings.topP);
  if (settings.jsonMode) params.response_format = { type: "json_object" };
  return params;
}

function submit() {
  const text = el.input.value;
  if (!text.trim() || !current || current.running) return;
  if (current.id === null && current.messages.length === 0) {
    current.systemPrompt = el.systemPrompt.value.trim() || null;
  }
  if (current.sendMessage(text, sendParams())) {
    el.input.value = "";
    autosize();
    stickToBottom = true;
    updateComposer();
    updateWelcome();
  }
}

el.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  submit();
});
el.input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
    e.preventDefault();
    submit();
  } else if (e.key === "Escape" && !e.shiftKey && current && current.running) {
    e.preventDefault();
    current.cancel();
  }
});
el.input.addEventListener("input", () => {
  autosize();
  updateComposer();
});
el.stop.addEventListener("click", () => current && current.cancel());

function renderPresets() {
  const buttons = PRESETS.map((p) => {
    const b = h("button", { type: "button", class: "chip", "aria-pressed": "false" }, p.name);
    b.addEventListener("click", () => {
      el.systemPrompt.value = p.text;
      syncPresets();
      el.input.focus();
    });
    return b;
  });
  el.presets.replaceChildren(...buttons);
  el.systemPrompt.value = settings.systemPrompt ?? PRESETS[0].text;
  el.systemPrompt.addEventListener("input", syncPresets);
  syncPresets();
}

/** The new-chat system prompt is one setting, shown on the new-chat page and in the settings. */
function syncPresets() {
  settings = store.saveSettings({ systemPrompt: el.systemPrompt.value });
  const value = el.systemPrompt.value.trim();
  [...el.presets.children].forEach((b, i) => b.setAttribute("aria-pressed", String(PRESETS[i].text === value)));
}

// ---- session list ----------------------------------------------------------------------

let refreshTimer = null;
function refreshSessions() {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(loadSessions, 250);
}

async function loadSessions({ quiet = false } = {}) {
  try {
    const list = await api.listSessions();
    serverSessions = Array.isArray(list) ? list : list.sessions || [];
    const ids = new Set(serverSessions.map((s) => s.id));
    for (const id of store.knownSessionIds()) {
      if (!ids.has(id) && !(current && current.id === id && current.running)) store.forgetSession(id);
    }
    if (current && current.id && !ids.has(current.id) && current.loaded && !current.running) {
      // deleted elsewhere (or not visible with a new API key)
      if (!quiet) toast("This chat was deleted.", "info");
      newChat();
    }
    renderSessionList();
  } catch (err) {
    if (err instanceof ApiError && (err.status === 401 || err.status === 403)) openSettings("This server needs a valid API key.");
  }
}

function markRunning(s) {
  const li = el.sessionList.querySelector(`[data-session-id="${CSS.escape(s.id || "")}"]`);
  if (li) li.classList.toggle("is-running", s.running);
}

function renderSessionList() {
  const items = serverSessions.map((s) => sessionItem(s));
  el.sessionList.replaceChildren(...items);
  el.sessionEmpty.hidden = items.length > 0;
}

function focusRow(id) {
  el.sessionList.querySelector(`[data-session-id="${CSS.escape(id)}"] .session-open`)?.focus();
}

function sessionItem(s) {
  const view = {
    active: !!(current && current.id === s.id),
    running: !!controllers.get(s.id)?.running,
    mode: editing && editing.id === s.id ? editing.mode : null,
  };
  const edit = (mode) => () => {
    editing = mode ? { id: s.id, mode } : null;
    renderSessionList();
    if (!mode) focusRow(s.id);
  };
  return renderSessionItem(s, view, {
    open: () => openSession(s.id),
    startRename: edit("rename"),
    startDelete: edit("delete"),
    cancel: edit(null),
    confirmDelete: () => deleteSession(s.id),
    rename: (title) => renameSession(s, title),
  });
}

async function renameSession(s, title) {
  editing = null;
  if (title && title !== s.title) {
    try {
      await api.renameSession(s.id, title);
      s.title = title;
      const c = controllers.get(s.id);
      if (c) c.title = title;
      store.saveSession(s.id, { title });
      if (current && current.id === s.id) updateHeader();
    } catch (err) {
      toast(`Rename failed: ${err.message}`, "error");
    }
  }
  renderSessionList();
  focusRow(s.id);
}

async function deleteSession(id) {
  editing = null;
  try {
    const c = controllers.get(id);
    if (c) c.close();
    await api.deleteSession(id);
  } catch (err) {
    if (!(err instanceof ApiError && err.status === 404)) {
      toast(`Delete failed: ${err.message}`, "error");
      renderSessionList();
      return;
    }
  }
  const wasCurrent = current && current.id === id;
  forget(id);
  if (wasCurrent) newChat();
  cachePanel.refresh();
  refreshSessions();
}

// ---- sidebar (phone) -------------------------------------------------------------------

function openSidebar() {
  document.body.classList.add("sidebar-open");
  el.backdrop.hidden = false;
  el.menuBtn.setAttribute("aria-expanded", "true");
  el.newSession.focus();
}

function closeSidebar() {
  if (!document.body.classList.contains("sidebar-open")) return;
  document.body.classList.remove("sidebar-open");
  el.backdrop.hidden = true;
  el.menuBtn.setAttribute("aria-expanded", "false");
}

el.menuBtn.appendChild(icon("menu"));
el.sidebarClose.appendChild(icon("close"));
el.menuBtn.addEventListener("click", openSidebar);
el.sidebarClose.addEventListener("click", () => {
  closeSidebar();
  el.menuBtn.focus();
});
el.backdrop.addEventListener("click", closeSidebar);
el.newSession.addEventListener("click", newChat);
document.addEventListener("keydown", (e) => {
  if (e.key !== "Escape") return;
  if (document.body.classList.contains("sidebar-open")) {
    closeSidebar();
    el.menuBtn.focus();
  } else if (!el.cachePanel.hidden && window.matchMedia("(max-width: 1199px)").matches && !el.settings.open) {
    setCachePanel(false);
    el.cacheToggle.focus();
  }
});

// ---- cache panel -----------------------------------------------------------------------

const cachePanel = new CachePanel(el.cachePanel, api, {
  getCurrentId: () => (current ? current.id : null),
  onClose: () => {
    setCachePanel(false);
    el.cacheToggle.focus();
  },
  onOpenSession: (id) => openSession(id),
});

function setCachePanel(open) {
  el.cacheToggle.setAttribute("aria-pressed", String(open));
  document.body.classList.toggle("cache-open", open);
  settings = store.saveSettings({ showCache: open });
  if (open) cachePanel.open();
  else cachePanel.close();
}
el.cacheToggle.addEventListener("click", () => setCachePanel(el.cachePanel.hidden));

// ---- settings --------------------------------------------------------------------------

function openSettings(message) {
  el.temperature.value = settings.temperature;
  el.temperatureOut.textContent = Number(settings.temperature).toFixed(2);
  el.topP.value = settings.topP;
  el.topPOut.textContent = Number(settings.topP).toFixed(2);
  el.maxTokens.value = settings.maxTokens;
  showMaxTokensLimit();
  el.jsonMode.checked = !!settings.jsonMode;
  el.settingsSystemPrompt.value = el.systemPrompt.value;
  syncTheme();
  el.apiKey.value = settings.apiKey || "";
  el.apiKeyAlert.hidden = !message;
  el.apiKeyAlert.textContent = message || "";
  if (!el.settings.open) el.settings.showModal();
  if (message) el.apiKey.focus();
}

el.temperature.addEventListener("input", () => {
  const t = Math.max(0, Math.min(2, Number(el.temperature.value) || 0));
  el.temperatureOut.textContent = t.toFixed(2);
  settings = store.saveSettings({ temperature: t });
  updateComposer();
});
el.maxTokens.addEventListener("input", () => {
  const n = Math.round(Number(el.maxTokens.value));
  if (Number.isFinite(n) && n >= 1) {
    const limit = settings.serverMaxTokens;
    settings = store.saveSettings({ maxTokens: limit ? Math.min(n, limit) : n });
    updateComposer();
  }
});
el.maxTokens.addEventListener("change", () => {
  el.maxTokens.value = settings.maxTokens; // show the value kept (bounded by the server's limit)
});
el.topP.addEventListener("input", () => {
  const p = Math.max(0.05, Math.min(1, Number(el.topP.value) || 1));
  el.topPOut.textContent = p.toFixed(2);
  settings = store.saveSettings({ topP: p });
  updateComposer();
});
el.jsonMode.addEventListener("change", () => {
  settings = store.saveSettings({ jsonMode: el.jsonMode.checked });
  updateComposer();
});
el.settingsSystemPrompt.addEventListener("input", () => {
  el.systemPrompt.value = el.settingsSystemPrompt.value;
  syncPresets();
});
for (const radio of document.querySelectorAll('input[name="theme"]')) {
  radio.addEventListener("change", () => radio.checked && setTheme(radio.value));
}

/** The server's limits at start, before any chat is open (a page without its API key yet gets them
 * from the first session frame instead). */
async function loadLimits() {
  try {
    setServerLimits(await api.limits());
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
  }
}

/** The server's limits (GET /v1/limits, and each session frame): max tokens can no longer exceed what the server accepts. */
function setServerLimits(limits) {
  const limit = Number.isInteger(limits.max_tokens) && limits.max_tokens > 0 ? limits.max_tokens : null;
  if (!limit) return;
  const patch = { serverMaxTokens: limit };
  if (Number(settings.maxTokens) > limit) patch.maxTokens = limit;
  settings = store.saveSettings(patch);
  showMaxTokensLimit();
  updateComposer();
}

function showMaxTokensLimit() {
  const limit = settings.serverMaxTokens;
  if (limit) el.maxTokens.max = String(limit);
  else el.maxTokens.removeAttribute("max");
  el.maxTokensHelp.textContent = limit
    ? `The longest answer, in tokens: at most ${limit.toLocaleString("en-US")}, this server's limit.`
    : "The longest answer, in tokens (the server's limit is not known yet).";
}

// ---- theme -----------------------------------------------------------------------------

function setTheme(theme) {
  settings = store.saveSettings({ theme });
  applyTheme(theme);
  syncTheme();
}

function syncTheme() {
  const dark = effectiveTheme(settings.theme) === "dark";
  el.themeToggle.setAttribute("aria-pressed", String(dark));
  el.themeToggle.replaceChildren(icon(dark ? "sun" : "moon"));
  el.themeToggle.title = dark ? "Dark theme (click for light)" : "Light theme (click for dark)";
  for (const radio of document.querySelectorAll('input[name="theme"]')) radio.checked = radio.value === (settings.theme || "system");
}

el.themeToggle.addEventListener("click", () => setTheme(effectiveTheme(settings.theme) === "dark" ? "light" : "dark"));
onSystemThemeChange(syncTheme);
el.settings.addEventListener("close", () => {
  const key = el.apiKey.value.trim();
  if (key !== (settings.apiKey || "")) {
    settings = store.saveSettings({ apiKey: key });
    loadSessions({ quiet: true });
    if (current && current.socket) current.restart();
    cachePanel.refresh();
  }
  el.apiKeyAlert.hidden = true;
});
$("open-settings").addEventListener("click", () => openSettings());
$("open-settings-side").addEventListener("click", () => {
  closeSidebar();
  openSettings();
});
el.samplingSummary.addEventListener("click", () => openSettings());

// ---- export and import -----------------------------------------------------------------

function openTransfer() {
  const id = current && current.id;
  el.exportMd.disabled = !id;
  el.exportJson.disabled = !id;
  el.importFile.value = "";
  el.importAlert.hidden = true;
  if (!el.transfer.open) el.transfer.showModal();
}

async function exportCurrent(kind) {
  const id = current && current.id;
  if (!id) return;
  let detail;
  try {
    detail = await api.getSession(id);
  } catch (err) {
    toast(`Export failed: ${err.message}`, "error");
    return;
  }
  if (kind === "md") download(fileName(detail.title, "md"), "text/markdown", exportMarkdown(detail));
  else download(fileName(detail.title, "json"), "application/json", `${JSON.stringify(exportJSON(detail), null, 2)}\n`);
}

async function importFile(file) {
  const fail = (text) => {
    el.importAlert.textContent = text;
    el.importAlert.hidden = false;
  };
  let body;
  try {
    body = importBody(JSON.parse(await file.text()));
  } catch (err) {
    fail(err instanceof SyntaxError ? "This file is not JSON." : err.message);
    return;
  }
  let res;
  try {
    res = await api.importSession(body);
  } catch (err) {
    fail(`The server refused the import: ${err.message}`);
    return;
  }
  store.saveSession(res.id, { token: res.resume_token, title: res.title });
  if (!serverSessions.some((x) => x.id === res.id)) {
    serverSessions.unshift({ id: res.id, title: res.title, state: "hot", turns: res.turns, last_active_at: new Date().toISOString() });
  }
  el.transfer.close();
  openSession(res.id);
  refreshSessions();
  toast(`Imported "${res.title}" (${res.turns} ${res.turns === 1 ? "exchange" : "exchanges"}).`);
}

el.openTransfer.addEventListener("click", openTransfer);
el.exportMd.addEventListener("click", () => exportCurrent("md"));
el.exportJson.addEventListener("click", () => exportCurrent("json"));
el.importFile.addEventListener("change", () => el.importFile.files[0] && importFile(el.importFile.files[0]));

// ---- keyboard shortcuts ----------------------------------------------------------------

function openHelp() {
  if (!el.help.open) el.help.showModal();
}

const shortcutActions = {
  newChat: () => newChat(),
  focusComposer: () => el.input.focus(),
  stop: () => current && current.running && current.cancel(),
  regenerate: () => {
    const target = regenerateTarget();
    if (target) regenerate(target);
  },
  help: () => openHelp(),
};

renderShortcutList($("shortcut-list"), SHORTCUTS);
el.openHelp.addEventListener("click", openHelp);
document.addEventListener("keydown", (e) => {
  if (e.defaultPrevented || e.isComposing) return;
  if (document.querySelector("dialog[open]")) return; // a dialog has the keyboard (Escape closes it)
  const shortcut = matchShortcut(e, SHORTCUTS);
  if (!shortcut) return;
  if (shortcut.id === "stop" && (!(current && current.running) || document.body.classList.contains("sidebar-open"))) {
    return; // Escape keeps its other jobs (the drawer, the cache panel)
  }
  e.preventDefault();
  shortcutActions[shortcut.id]();
});

// ---- start -----------------------------------------------------------------------------

hydrateIcons();
applyTheme(settings.theme);
syncTheme();
showMaxTokensLimit();
renderPresets();
window.addEventListener("focus", () => refreshSessions());
const saved = store.current();
if (saved) {
  const s = makeController({ id: saved, title: store.session(saved)?.title || "" });
  controllers.set(saved, s);
  show(s);
  s.connect();
} else {
  show(makeController({}));
}
if (settings.showCache && window.matchMedia("(min-width: 1200px)").matches) setCachePanel(true);
loadSessions();
loadLimits();
autosize();
updateComposer();
