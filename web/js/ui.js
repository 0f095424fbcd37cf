// DOM helpers: icons, message bubbles, per-answer statistics, the session list.
// Text always goes in through textContent / createTextNode; markup only through
// createElement. Nothing here uses innerHTML.

import { renderAnswer } from "./answer.js";

const SVG = "http://www.w3.org/2000/svg";
const ICONS = {
  plus: ["M12 5v14", "M5 12h14"],
  settings: [
    "M12 15a3 3 0 1 0 0-6 3 3 0 0 0 0 6z",
    "M19.4 15a1.7 1.7 0 0 0 .3 1.8l.1.1a2 2 0 1 1-2.8 2.8l-.1-.1a1.7 1.7 0 0 0-1.8-.3 1.7 1.7 0 0 0-1 1.5V21a2 2 0 1 1-4 0v-.1a1.7 1.7 0 0 0-1.1-1.5 1.7 1.7 0 0 0-1.8.3l-.1.1a2 2 0 1 1-2.8-2.8l.1-.1a1.7 1.7 0 0 0 .3-1.8 1.7 1.7 0 0 0-1.5-1H3a2 2 0 1 1 0-4h.1a1.7 1.7 0 0 0 1.5-1.1 1.7 1.7 0 0 0-.3-1.8l-.1-.1a2 2 0 1 1 2.8-2.8l.1.1a1.7 1.7 0 0 0 1.8.3H9a1.7 1.7 0 0 0 1-1.5V3a2 2 0 1 1 4 0v.1a1.7 1.7 0 0 0 1 1.5 1.7 1.7 0 0 0 1.8-.3l.1-.1a2 2 0 1 1 2.8 2.8l-.1.1a1.7 1.7 0 0 0-.3 1.8V9a1.7 1.7 0 0 0 1.5 1H21a2 2 0 1 1 0 4h-.1a1.7 1.7 0 0 0-1.5 1z",
  ],
  grid: ["M4 4h6v6H4z", "M14 4h6v6h-6z", "M4 14h6v6H4z", "M14 14h6v6h-6z"],
  menu: ["M4 6h16", "M4 12h16", "M4 18h16"],
  close: ["M6 6l12 12", "M18 6L6 18"],
  send: ["M12 19V5", "M5 12l7-7 7 7"],
  stop: [{ rect: [7, 7, 10, 10] }],
  down: ["M12 5v14", "M19 12l-7 7-7-7"],
  edit: ["M12 20h9", "M16.5 3.5a2.1 2.1 0 0 1 3 3L7 19l-4 1 1-4z"],
  trash: ["M3 6h18", "M8 6V4h8v2", "M19 6l-1 14H6L5 6", "M10 11v6", "M14 11v6"],
  refresh: ["M21 12a9 9 0 1 1-3-6.7", "M21 3v6h-6"],
  copy: ["M9 9h11v11H9z", "M5 15H4V4h11v1"],
  moon: ["M21 12.8A9 9 0 1 1 11.2 3a7 7 0 0 0 9.8 9.8z"],
  sun: ["M12 17a5 5 0 1 0 0-10 5 5 0 0 0 0 10z", "M12 1v2", "M12 21v2", "M4.2 4.2l1.4 1.4", "M18.4 18.4l1.4 1.4", "M1 12h2", "M21 12h2", "M4.2 19.8l1.4-1.4", "M18.4 5.6l1.4-1.4"],
  transfer: ["M12 3v12", "M7 10l5 5 5-5", "M5 21h14"],
  keyboard: [{ rect: [2, 6, 20, 12], outline: true }, "M6 10h.01", "M10 10h.01", "M14 10h.01", "M18 10h.01", "M7 14h10"],
};

export function icon(name) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 24 24");
  svg.setAttribute("width", "18");
  svg.setAttribute("height", "18");
  svg.setAttribute("aria-hidden", "true");
  svg.setAttribute("focusable", "false");
  svg.classList.add("icon");
  for (const part of ICONS[name] || []) {
    let node;
    if (typeof part === "string") {
      node = document.createElementNS(SVG, "path");
      node.setAttribute("d", part);
    } else {
      node = document.createElementNS(SVG, "rect");
      const [x, y, w, hgt] = part.rect;
      node.setAttribute("x", x);
      node.setAttribute("y", y);
      node.setAttribute("width", w);
      node.setAttribute("height", hgt);
      node.setAttribute("rx", 1.5);
      if (!part.outline) node.classList.add("filled");
    }
    svg.appendChild(node);
  }
  return svg;
}

/** Fill every `[data-icon]` element under `root` with its SVG (once). */
export function hydrateIcons(root = document) {
  for (const el of root.querySelectorAll("[data-icon]")) {
    if (!el.querySelector("svg")) el.prepend(icon(el.dataset.icon));
  }
}

/** h("div", {class: "x", dataset: {a: 1}, onclick}, child, "text") */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k === "text") el.textContent = v;
    else if (k.startsWith("on") && typeof v === "function") el.addEventListener(k.slice(2), v);
    else if (v === true) el.setAttribute(k, "");
    else el.setAttribute(k, String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.appendChild(typeof c === "string" || typeof c === "number" ? document.createTextNode(String(c)) : c);
  }
  return el;
}

const FINISH_LABELS = {
  stop: null,
  length: "Reached the max tokens",
  cancelled: "Stopped",
  disconnected: "Stopped: no client was connected",
  error: "The server hit an error",
  interrupted: "Interrupted by a server restart",
};

export function fmtInt(n) {
  return typeof n === "number" && Number.isFinite(n) ? Math.round(n).toLocaleString("en-US") : "–";
}

export function fmtMs(ms) {
  if (typeof ms !== "number" || !Number.isFinite(ms)) return "–";
  if (ms >= 10000) return `${(ms / 1000).toFixed(1)} s`;
  if (ms >= 1000) return `${(ms / 1000).toFixed(2)} s`;
  return `${Math.round(ms)} ms`;
}

/** Decode speed: tokens after the first, over the time after the first token. */
export function tokensPerSecond(usage, timing) {
  if (!usage || !timing) return null;
  const n = usage.completion_tokens;
  const total = timing.total_ms;
  const ttft = timing.ttft_ms;
  if (typeof n !== "number" || typeof total !== "number" || n <= 0) return null;
  if (n > 1 && typeof ttft === "number" && total - ttft > 0) return ((n - 1) * 1000) / (total - ttft);
  return total > 0 ? (n * 1000) / total : null;
}

function stat(value, label, title, extraClass) {
  return h("span", { class: `stat ${extraClass || ""}`.trim(), title }, h("b", {}, value), " ", label);
}

/** The `usage` line under an answer; figures also sit in data-* attributes for tools and tests. */
export function renderUsage(usage, timing) {
  const u = usage || {};
  const t = timing || {};
  const prompt = u.prompt_tokens ?? null;
  const cached = u.cached_tokens ?? null;
  const device = u.cached_device_tokens ?? null;
  const disk = u.cached_disk_tokens ?? null;
  const recomputed = u.recomputed_tokens ?? (prompt !== null && cached !== null ? prompt - cached : null);
  const tps = tokensPerSecond(u, t);
  const box = h("div", {
    class: "usage",
    "data-testid": "usage",
    "data-prompt-tokens": prompt,
    "data-cached-tokens": cached,
    "data-cached-device-tokens": device,
    "data-cached-disk-tokens": disk,
    "data-recomputed-tokens": recomputed,
    "data-completion-tokens": u.completion_tokens ?? null,
    "data-queue-ms": t.queue_ms ?? null,
    "data-ttft-ms": t.ttft_ms ?? null,
    "data-total-ms": t.total_ms ?? null,
    "data-tokens-per-second": tps === null ? null : tps.toFixed(2),
  });
  if (prompt) {
    const pct = (x) => `${Math.max(0, Math.min(100, ((x || 0) / prompt) * 100)).toFixed(1)}%`;
    const share = cached ? Math.round((cached / prompt) * 100) : 0;
    const bar = h(
      "span",
      { class: "cachebar", role: "img", "aria-label": `${share}% of the prompt came from the cache` },
      h("span", { class: "cachebar-device" }),
      h("span", { class: "cachebar-disk" })
    );
    bar.children[0].style.width = pct(device ?? cached);
    bar.children[1].style.width = pct(disk);
    box.append(bar, h("span", { class: "cache-share", title: "Share of the prompt served from the KV cache" }, `${share}% cached`));
  }
  box.append(
    stat(fmtInt(prompt), "prompt", "Prompt tokens: the whole conversation the model read for this answer"),
    h(
      "span",
      {
        class: "stat stat-cached",
        title: `Cached tokens: ${fmtInt(device)} found in the device KV pool, ${fmtInt(disk)} read back from the disk tier`,
      },
      h("b", {}, fmtInt(cached)),
      " cached ",
      h("span", { class: "stat-split" }, `(${fmtInt(device)} device · ${fmtInt(disk)} disk)`)
    ),
    stat(fmtInt(recomputed), "computed", "Prompt tokens computed for this answer"),
    stat(fmtInt(u.completion_tokens), "out", "Completion tokens"),
    stat(fmtMs(t.ttft_ms), "TTFT", `Time to first token (queue ${fmtMs(t.queue_ms)}, total ${fmtMs(t.total_ms)})`),
    stat(tps === null ? "–" : tps.toFixed(1), "tok/s", "Decode speed after the first token")
  );
  return box;
}

/** A small icon button of a message's action row (its name is its aria-label; no text, so the
 * message's own text stays the article's text). */
function actionButton(action, testid, label, iconName) {
  return h("button", { type: "button", class: "icon-btn small", "data-action": action, "data-testid": testid,
                       "aria-label": label, title: label }, icon(iconName));
}

export function renderUserMessage(msg) {
  return h(
    "article",
    { class: "msg msg-user", "data-testid": "message-user", "data-key": msg.key, "aria-label": "You" },
    h("div", { class: "bubble" }, msg.content),
    h("div", { class: "msg-actions" }, actionButton("edit", "edit-message", "Edit and resend this message", "edit"))
  );
}

let editorCount = 0;

/** The inline editor of a user message: a textarea holding `text`, Cancel and Send. */
export function renderMessageEditor(text) {
  const id = `message-editor-${++editorCount}`;
  const input = h("textarea", { id, class: "msg-editor-input", "data-testid": "edit-input", rows: 3 });
  input.value = text;
  return h(
    "form",
    { class: "msg-editor", "data-testid": "message-editor", "aria-label": "Edit your message" },
    h("label", { class: "visually-hidden", for: id }, "Edited message"),
    input,
    h(
      "div",
      { class: "msg-editor-actions" },
      h("span", { class: "msg-editor-hint" }, "Sends in a new branch of this chat; this one stays as it is."),
      h("button", { type: "button", class: "btn btn-small", "data-action": "edit-cancel", "data-testid": "edit-cancel" }, "Cancel"),
      h("button", { type: "submit", class: "btn btn-small btn-primary", "data-testid": "edit-send" }, "Send")
    )
  );
}

export function renderAssistantMessage(msg) {
  const regenerate = actionButton("regenerate", "regenerate", "Regenerate this answer", "refresh");
  regenerate.hidden = true; // the page shows it on the last finished answer only
  const el = h(
    "article",
    { class: "msg msg-assistant", "data-testid": "message-assistant", "data-key": msg.key, "aria-label": "Assistant" },
    h("div", { class: "avatar", "aria-hidden": "true" }),
    h(
      "div",
      { class: "msg-main" },
      h("div", { class: "md" }),
      h("div", { class: "typing", "aria-label": "The assistant is thinking", role: "img" }, h("span"), h("span"), h("span")),
      h("div", { class: "msg-foot" }),
      h("div", { class: "msg-actions" }, regenerate)
    )
  );
  updateAssistantMessage(el, msg);
  return el;
}

function placeCaret(md) {
  let node = md;
  while (node.lastElementChild && !["PRE", "TABLE", "BR", "HR", "DIV"].includes(node.lastElementChild.tagName)) {
    node = node.lastElementChild;
  }
  if (node.lastElementChild && node.lastElementChild.classList.contains("codeblock")) {
    node = node.lastElementChild.querySelector("code") || node;
  }
  node.appendChild(h("span", { class: "caret", "aria-hidden": "true" }));
}

export function updateAssistantMessage(el, msg) {
  const md = el.querySelector(".md");
  if (el._rendered !== msg.content || el._streaming !== msg.streaming) {
    md.replaceChildren(renderAnswer(msg.content, { streaming: msg.streaming }));
    if (msg.streaming && msg.content) placeCaret(md);
    el._rendered = msg.content;
    el._streaming = msg.streaming;
  }
  el.dataset.streaming = msg.streaming ? "true" : "false";
  if (msg.finish) el.dataset.finish = msg.finish;
  else delete el.dataset.finish;
  if (msg.turn !== null && msg.turn !== undefined) el.dataset.turn = String(msg.turn);
  el.setAttribute("aria-busy", msg.streaming ? "true" : "false");
  el.querySelector(".typing").hidden = !(msg.streaming && !msg.content);
  const foot = el.querySelector(".msg-foot");
  const key = JSON.stringify([msg.finish, msg.usage, msg.timing, msg.streaming]);
  if (foot._key !== key) {
    foot._key = key;
    foot.replaceChildren();
    const label = msg.streaming ? null : FINISH_LABELS[msg.finish];
    if (label) foot.appendChild(h("span", { class: `finish finish-${msg.finish}` }, label));
    // an imported answer has no statistics (all zero): none are shown
    const u = msg.usage || {};
    if (u.prompt_tokens || u.completion_tokens || (msg.timing && msg.timing.total_ms != null)) {
      foot.appendChild(renderUsage(msg.usage, msg.timing));
    }
  }
}

export function renderMessage(msg) {
  return msg.role === "user" ? renderUserMessage(msg) : renderAssistantMessage(msg);
}

export function relativeTime(value) {
  if (!value) return "";
  const t = typeof value === "number" ? (value < 1e12 ? value * 1000 : value) : Date.parse(value);
  if (!Number.isFinite(t)) return "";
  const s = Math.max(0, (Date.now() - t) / 1000);
  if (s < 60) return "just now";
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  return new Date(t).toLocaleDateString();
}
