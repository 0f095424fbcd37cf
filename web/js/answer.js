// How an assistant answer is shown: Markdown (markdown.js), with two special shapes on top.
//
// - Tool calls: a model whose chat template supports tools writes each call as
//   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Hermes / Qwen style). Each
//   well-formed block becomes a card (the function's name, its arguments pretty-printed and
//   highlighted); the text around the blocks is Markdown as usual. A block whose body is not a
//   JSON object with a string `name` (and an object, or a JSON string holding one, as
//   `arguments`) stays as text, and so does an unclosed one (still streaming).
// - JSON answers: a finished answer that is, as a whole, a JSON object or array (JSON mode
//   gives those) is shown pretty-printed and highlighted in a monospace block, with buttons to
//   copy the formatted text or the raw answer. While it streams, an answer that starts like a
//   JSON object or array is shown as it comes, in the same monospace block, and formatted once
//   it is done.
//
// Like markdown.js, everything is built with createElement/createTextNode.

import { highlightInto } from "./highlight.js";
import { renderMarkdown } from "./markdown.js";

const TOOL_CALL_RE = /<tool_call>([\s\S]*?)<\/tool_call>/g;

/** The parsed JSON object or array that `text` is as a whole, or undefined. */
export function jsonAnswer(text) {
  const t = String(text || "").trim();
  if (!(t.startsWith("{") && t.endsWith("}")) && !(t.startsWith("[") && t.endsWith("]"))) return undefined;
  try {
    const value = JSON.parse(t);
    return value !== null && typeof value === "object" ? value : undefined;
  } catch {
    return undefined;
  }
}

/** {name, arguments} from a tool-call block's body, or null when it is malformed. */
export function parseToolCall(body) {
  let call;
  try {
    call = JSON.parse(body);
  } catch {
    return null;
  }
  if (!call || typeof call !== "object" || Array.isArray(call)) return null;
  if (typeof call.name !== "string" || !call.name.trim()) return null;
  let args = call.arguments ?? call.parameters ?? {};
  if (typeof args === "string") {
    try {
      args = JSON.parse(args);
    } catch {
      return null;
    }
  }
  if (!args || typeof args !== "object" || Array.isArray(args)) return null;
  return { name: call.name, arguments: args };
}

/** The answer cut into text and tool-call parts: [{t: "text", text} | {t: "tool", name, arguments, raw}]. */
export function splitToolCalls(text) {
  const parts = [];
  let last = 0;
  let pending = "";
  for (const m of String(text || "").matchAll(TOOL_CALL_RE)) {
    const call = parseToolCall(m[1].trim());
    if (!call) continue; // malformed: it stays in the text around it
    pending += text.slice(last, m.index);
    if (pending.trim()) parts.push({ t: "text", text: pending.replace(/^\n+|\n+$/g, "") });
    pending = "";
    parts.push({ t: "tool", ...call, raw: m[0] });
    last = m.index + m[0].length;
  }
  pending += String(text || "").slice(last);
  if (pending.trim() || !parts.length) parts.push({ t: "text", text: parts.length ? pending.replace(/^\n+|\n+$/g, "") : pending });
  return parts;
}

function el(doc, tag, className, text) {
  const node = doc.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function copyButton(doc, action, label, aria) {
  const b = el(doc, "button", "codeblock-copy", label);
  b.type = "button";
  b.dataset.action = action;
  b.setAttribute("aria-label", aria);
  return b;
}

function toolCard(doc, part) {
  const card = el(doc, "section", "toolcall");
  card.setAttribute("data-testid", "tool-call");
  card.dataset.name = part.name;
  card.setAttribute("role", "group");
  card.setAttribute("aria-label", `Tool call: ${part.name}`);
  const head = el(doc, "div", "toolcall-head");
  head.append(el(doc, "span", "toolcall-kind", "Tool call"), el(doc, "code", "toolcall-name", part.name));
  const pre = el(doc, "pre", "toolcall-args");
  const code = el(doc, "code", "language-json");
  code.setAttribute("data-testid", "tool-call-arguments");
  highlightInto(code, JSON.stringify(part.arguments, null, 2), "json", doc);
  pre.appendChild(code);
  card.append(head, pre);
  return card;
}

function jsonBlock(doc, raw, value) {
  const box = el(doc, "div", "codeblock jsonblock");
  box.setAttribute("data-testid", "json-answer");
  box.dataset.state = value === undefined ? "streaming" : "formatted";
  const head = el(doc, "div", "codeblock-head");
  head.appendChild(el(doc, "span", "codeblock-lang", value === undefined ? "JSON (streaming)" : "JSON"));
  if (value !== undefined) {
    head.append(copyButton(doc, "copy-code", "Copy", "Copy the formatted JSON"),
                copyButton(doc, "copy-raw", "Copy raw", "Copy the answer as the model wrote it"));
  }
  const pre = el(doc, "pre");
  const code = el(doc, "code", "language-json");
  if (value === undefined) code.textContent = raw;
  else highlightInto(code, JSON.stringify(value, null, 2), "json", doc);
  const rawNode = el(doc, "code", "json-raw", raw); // what "Copy raw" copies
  rawNode.hidden = true;
  pre.appendChild(code);
  box.append(head, pre, rawNode);
  return box;
}

/** A DocumentFragment for an assistant answer (`streaming`: it is not finished yet). */
export function renderAnswer(text, { streaming = false } = {}, doc = globalThis.document) {
  const src = String(text || "");
  const frag = doc.createDocumentFragment();
  const parts = splitToolCalls(src);
  if (parts.some((p) => p.t === "tool")) {
    for (const p of parts) frag.appendChild(p.t === "tool" ? toolCard(doc, p) : renderMarkdown(p.text, doc));
    return frag;
  }
  const t = src.trimStart();
  if (!streaming) {
    const value = jsonAnswer(src);
    if (value !== undefined) {
      frag.appendChild(jsonBlock(doc, src, value));
      return frag;
    }
  } else if (/^(\{|\[\s*($|[[{"\d\]-]))/.test(t)) {
    frag.appendChild(jsonBlock(doc, src, undefined));
    return frag;
  }
  frag.appendChild(renderMarkdown(src, doc));
  return frag;
}
