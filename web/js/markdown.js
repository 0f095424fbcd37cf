// A small, safe Markdown renderer for chat answers.
//
// Safety model: the source text is never handed to the HTML parser. `parse()` turns it into
// a tiny syntax tree, and `toDOM()` builds elements with createElement/createTextNode, so
// every character of the input ends up as text (the DOM equivalent of escaping all HTML
// first). Links are kept only for http(s) URLs; a code fence's language is a
// [A-Za-z0-9_+#.-] word used as a class name; code in a known language is highlighted by
// highlight.js (vendored), through highlight.js's token tree, never its HTML (highlight.js in
// this folder). `renderMarkdown()` is the one entry point
// the UI uses; `parse()` is exported for tests.
//
// Supported: paragraphs (single newlines are kept as line breaks), ATX headings, fenced
// code blocks (``` or ~~~, with a language; an unclosed fence runs to the end, which is
// what a streaming answer looks like), blockquotes, bullet and ordered lists (nested by
// indentation), GFM tables, horizontal rules, inline code, **bold**, *italic*, ~~strike~~,
// [links](https://...), bare http(s) URLs and backslash escapes.

import { highlightInto } from "./highlight.js";

const MAX_DEPTH = 12;
const PUNCT = "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";
const FENCE_RE = /^( {0,3})(`{3,}|~{3,})[ \t]*([^\s`]*)[^`]*$/;
const HEADING_RE = /^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$/;
const HR_RE = /^ {0,3}([-*_])(?:[ \t]*\1){2,}[ \t]*$/;
const QUOTE_RE = /^ {0,3}> ?(.*)$/;
const LIST_RE = /^( *)([-*+]|\d{1,9}[.)])(?:([ \t]+)(.*)|$)/;
const TABLE_SEP_RE = /^ {0,3}\|?[ \t]*:?-+:?[ \t]*(?:\|[ \t]*:?-+:?[ \t]*)*\|?[ \t]*$/;

const isBlank = (line) => /^[ \t]*$/.test(line);
const indentOf = (line) => line.length - line.trimStart().length;

export function safeUrl(raw) {
  const text = String(raw || "").trim();
  if (!/^https?:\/\//i.test(text)) return null;
  try {
    const url = new URL(text);
    return url.protocol === "http:" || url.protocol === "https:" ? url.href : null;
  } catch {
    return null;
  }
}

function safeLang(raw) {
  return /^[A-Za-z0-9_+#.-]{1,32}$/.test(raw || "") ? raw : "";
}

function startsBlock(line) {
  return FENCE_RE.test(line) || HEADING_RE.test(line) || HR_RE.test(line) || QUOTE_RE.test(line) || LIST_RE.test(line);
}

function listItem(line) {
  const m = LIST_RE.exec(line);
  if (!m) return null;
  if (HR_RE.test(line)) return null;
  const ordered = /\d/.test(m[2]);
  let gap = m[3] ? m[3].length : 1;
  if (gap > 4) gap = 1; // indented code after a marker is not supported: treat as text
  return {
    indent: m[1].length,
    ordered,
    start: ordered ? parseInt(m[2], 10) : null,
    contentIndent: m[1].length + m[2].length + gap,
    first: m[3] ? (m[3].length > 4 ? m[3].slice(1) : "") + (m[4] || "") : "",
  };
}

function splitRow(line) {
  let text = line.trim();
  if (text.startsWith("|")) text = text.slice(1);
  if (text.endsWith("|") && !text.endsWith("\\|")) text = text.slice(0, -1);
  const cells = [];
  let cell = "";
  let inCode = false;
  for (let i = 0; i < text.length; i++) {
    const ch = text[i];
    if (ch === "\\" && text[i + 1] === "|") {
      cell += "|";
      i++;
    } else if (ch === "`") {
      inCode = !inCode;
      cell += ch;
    } else if (ch === "|" && !inCode) {
      cells.push(cell.trim());
      cell = "";
    } else {
      cell += ch;
    }
  }
  cells.push(cell.trim());
  return cells;
}

function parseBlocks(lines, depth) {
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (isBlank(line)) {
      i++;
      continue;
    }
    let m = FENCE_RE.exec(line);
    if (m) {
      const indent = m[1].length;
      const fence = m[2];
      const body = [];
      let closed = false;
      i++;
      while (i < lines.length) {
        const close = /^ {0,3}(`{3,}|~{3,})[ \t]*$/.exec(lines[i]);
        if (close && close[1][0] === fence[0] && close[1].length >= fence.length) {
          closed = true;
          i++;
          break;
        }
        let text = lines[i];
        if (indent) text = text.replace(new RegExp(`^ {0,${indent}}`), "");
        body.push(text);
        i++;
      }
      out.push({ t: "code", lang: safeLang(m[3]), text: body.join("\n"), closed });
      continue;
    }
    m = HEADING_RE.exec(line);
    if (m) {
      out.push({ t: "h", level: m[1].length, c: parseInline(m[2] || "", depth) });
      i++;
      continue;
    }
    if (HR_RE.test(line)) {
      out.push({ t: "hr" });
      i++;
      continue;
    }
    if (QUOTE_RE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = QUOTE_RE.exec(lines[i]))) {
        inner.push(m[1]);
        i++;
      }
      out.push(depth < MAX_DEPTH ? { t: "quote", c: parseBlocks(inner, depth + 1) } : para(inner, depth));
      continue;
    }
    const item = listItem(line);
    if (item && depth < MAX_DEPTH) {
      const list = { t: item.ordered ? "ol" : "ul", start: item.start, items: [] };
      while (i < lines.length) {
        const it = listItem(lines[i]);
        if (!it || it.ordered !== item.ordered || it.indent >= item.contentIndent) break;
        const body = [it.first];
        i++;
        let more = false;
        while (i < lines.length) {
          const l = lines[i];
          if (isBlank(l)) {
            let j = i + 1;
            while (j < lines.length && isBlank(lines[j])) j++;
            if (j < lines.length && indentOf(lines[j]) >= it.contentIndent) {
              for (; i < j; i++) body.push("");
              continue;
            }
            const next = j < lines.length ? listItem(lines[j]) : null;
            if (next && next.ordered === item.ordered && next.indent < item.contentIndent) {
              i = j;
              more = true;
            }
            break;
          }
          if (indentOf(l) >= it.contentIndent) {
            body.push(l.slice(it.contentIndent));
            i++;
            continue;
          }
          if (listItem(l)) {
            more = true;
            break;
          }
          if (!startsBlock(l) && !isBlank(body[body.length - 1])) {
            body.push(l.trim()); // lazy continuation of the item's paragraph
            i++;
            continue;
          }
          break;
        }
        list.items.push(parseBlocks(body, depth + 1));
        if (!more) break;
      }
      out.push(list);
      continue;
    }
    if (line.includes("|") && i + 1 < lines.length && TABLE_SEP_RE.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      const head = splitRow(line);
      const align = splitRow(lines[i + 1]).map((c) =>
        c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : ""
      );
      if (align.length === head.length || align.length >= 1) {
        i += 2;
        const rows = [];
        while (i < lines.length && !isBlank(lines[i]) && lines[i].includes("|")) {
          rows.push(splitRow(lines[i]));
          i++;
        }
        const cols = head.length;
        const cell = (text) => parseInline(text || "", depth);
        out.push({
          t: "table",
          align: Array.from({ length: cols }, (_, k) => align[k] || ""),
          head: head.map(cell),
          rows: rows.map((r) => Array.from({ length: cols }, (_, k) => cell(r[k]))),
        });
        continue;
      }
    }
    const text = [line];
    i++;
    while (i < lines.length && !isBlank(lines[i]) && !startsBlock(lines[i])) {
      text.push(lines[i]);
      i++;
    }
    out.push(para(text, depth));
  }
  return out;
}

function para(lines, depth) {
  return { t: "p", c: parseInline(lines.map((l) => l.trim()).join("\n"), depth) };
}

const isSpace = (ch) => ch === undefined || /\s/.test(ch);
const isWord = (ch) => ch !== undefined && /[\p{L}\p{N}]/u.test(ch);

// Find the closing delimiter `delim` for an emphasis opened at `from`; -1 if none.
function findClose(s, from, delim) {
  const ch = delim[0];
  let j = from;
  while (j < s.length) {
    if (s[j] === "\\") {
      j += 2;
      continue;
    }
    if (s[j] === "`") {
      let run = 1;
      while (s[j + run] === "`") run++;
      const end = s.indexOf("`".repeat(run), j + run);
      j = end < 0 ? j + run : end + run;
      continue;
    }
    if (s.startsWith(delim, j) && !isSpace(s[j - 1])) {
      let run = 0;
      while (s[j + run] === ch) run++;
      // `**` must not close a single `*`; a longer run may close a shorter delimiter at its end
      if (run === delim.length || (run > delim.length && delim.length >= 2)) {
        if (ch === "_" && isWord(s[j + delim.length])) {
          j += run;
          continue;
        }
        return j;
      }
      j += run;
      continue;
    }
    j++;
  }
  return -1;
}

function matchLink(s, i) {
  // [text](url) or [text](url "title"); brackets in the text may nest one level
  let depth = 0;
  let j = i;
  for (; j < s.length; j++) {
    if (s[j] === "\\") {
      j++;
      continue;
    }
    if (s[j] === "[") depth++;
    else if (s[j] === "]") {
      depth--;
      if (depth === 0) break;
    } else if (s[j] === "\n" && s[j + 1] === "\n") return null;
  }
  if (j >= s.length || s[j + 1] !== "(") return null;
  const m = /^\(\s*<?([^\s<>()]*(?:\([^\s<>()]*\)[^\s<>()]*)*)>?(?:\s+"[^"]*")?\s*\)/.exec(s.slice(j + 1));
  if (!m) return null;
  return { text: s.slice(i + 1, j), url: m[1], end: j + 1 + m[0].length };
}

function parseInline(s, depth = 0) {
  const out = [];
  let buf = "";
  const flush = () => {
    if (buf) out.push({ t: "text", v: buf });
    buf = "";
  };
  const push = (node) => {
    flush();
    out.push(node);
  };
  let i = 0;
  while (i < s.length) {
    const ch = s[i];
    if (ch === "\\" && i + 1 < s.length && PUNCT.includes(s[i + 1])) {
      buf += s[i + 1];
      i += 2;
      continue;
    }
    if (ch === "\n") {
      push({ t: "br" });
      i++;
      continue;
    }
    if (ch === "`") {
      let run = 1;
      while (s[i + run] === "`") run++;
      const end = s.indexOf("`".repeat(run), i + run);
      if (end >= 0 && s[end + run] !== "`") {
        let code = s.slice(i + run, end).replace(/\n/g, " ");
        if (code.length > 2 && code.startsWith(" ") && code.endsWith(" ") && code.trim()) code = code.slice(1, -1);
        push({ t: "code", v: code });
        i = end + run;
        continue;
      }
      buf += "`".repeat(run);
      i += run;
      continue;
    }
    if (ch === "[" && depth < MAX_DEPTH) {
      const link = matchLink(s, i);
      if (link) {
        const href = safeUrl(link.url);
        const children = parseInline(link.text, depth + 1);
        if (href) push({ t: "a", href, c: children });
        else {
          flush();
          out.push(...children); // unsafe or relative URL: keep only the text
        }
        i = link.end;
        continue;
      }
    }
    if ((ch === "h" || ch === "H") && !isWord(s[i - 1])) {
      const m = /^https?:\/\/[^\s<>"'`]+/i.exec(s.slice(i));
      if (m) {
        let url = m[0];
        while (/[.,;:!?*_~)\]]$/.test(url)) {
          if (url.endsWith(")") && (url.match(/\(/g) || []).length >= (url.match(/\)/g) || []).length) break;
          url = url.slice(0, -1);
        }
        const href = safeUrl(url);
        if (href) {
          push({ t: "a", href, c: [{ t: "text", v: url }] });
          i += url.length;
          continue;
        }
      }
    }
    if ((ch === "*" || ch === "_" || ch === "~") && depth < MAX_DEPTH) {
      let run = 1;
      while (s[i + run] === ch) run++;
      const after = s[i + run];
      const canOpen = !isSpace(after) && !(ch === "_" && isWord(s[i - 1]));
      if (canOpen) {
        const tries = ch === "~" ? (run === 2 ? [2] : []) : run >= 3 ? [3, 2, 1] : run === 2 ? [2, 1] : [1];
        let done = false;
        for (const n of tries) {
          const delim = ch.repeat(n);
          const close = findClose(s, i + n, delim);
          if (close > i + n) {
            const inner = parseInline(s.slice(i + n, close), depth + 1);
            let node;
            if (ch === "~") node = { t: "del", c: inner };
            else if (n === 3) node = { t: "strong", c: [{ t: "em", c: inner }] };
            else node = { t: n === 2 ? "strong" : "em", c: inner };
            buf += ch.repeat(run - n);
            push(node);
            i = close + n;
            done = true;
            break;
          }
        }
        if (done) continue;
      }
      buf += ch.repeat(run);
      i += run;
      continue;
    }
    buf += ch;
    i++;
  }
  flush();
  return out;
}

/** The syntax tree of `src` (plain objects, no DOM). */
export function parse(src) {
  const lines = String(src ?? "").replace(/\r\n?/g, "\n").replace(/\0/g, "\uFFFD").split("\n");
  return parseBlocks(lines, 0);
}

function el(doc, tag, className) {
  const node = doc.createElement(tag);
  if (className) node.className = className;
  return node;
}

function inlineToDOM(doc, nodes, parent) {
  for (const n of nodes) {
    switch (n.t) {
      case "text":
        parent.appendChild(doc.createTextNode(n.v));
        break;
      case "br":
        parent.appendChild(el(doc, "br"));
        break;
      case "code": {
        const code = el(doc, "code");
        code.textContent = n.v;
        parent.appendChild(code);
        break;
      }
      case "a": {
        const a = el(doc, "a");
        a.href = n.href;
        a.target = "_blank";
        a.rel = "noopener noreferrer nofollow";
        inlineToDOM(doc, n.c, a);
        parent.appendChild(a);
        break;
      }
      case "strong":
      case "em":
      case "del": {
        const node = el(doc, n.t);
        inlineToDOM(doc, n.c, node);
        parent.appendChild(node);
        break;
      }
    }
  }
}

function blocksToDOM(doc, blocks, parent) {
  for (const b of blocks) {
    switch (b.t) {
      case "p": {
        const p = el(doc, "p");
        inlineToDOM(doc, b.c, p);
        parent.appendChild(p);
        break;
      }
      case "h": {
        const h = el(doc, `h${b.level}`);
        inlineToDOM(doc, b.c, h);
        parent.appendChild(h);
        break;
      }
      case "hr":
        parent.appendChild(el(doc, "hr"));
        break;
      case "quote": {
        const q = el(doc, "blockquote");
        blocksToDOM(doc, b.c, q);
        parent.appendChild(q);
        break;
      }
      case "ul":
      case "ol": {
        const list = el(doc, b.t);
        if (b.t === "ol" && b.start !== 1) list.start = b.start;
        for (const item of b.items) {
          const li = el(doc, "li");
          blocksToDOM(doc, item, li);
          list.appendChild(li);
        }
        parent.appendChild(list);
        break;
      }
      case "table": {
        const wrap = el(doc, "div", "table-wrap");
        const table = el(doc, "table");
        const thead = el(doc, "thead");
        const tr = el(doc, "tr");
        b.head.forEach((cell, k) => {
          const th = el(doc, "th");
          if (b.align[k]) th.className = `align-${b.align[k]}`;
          inlineToDOM(doc, cell, th);
          tr.appendChild(th);
        });
        thead.appendChild(tr);
        table.appendChild(thead);
        const tbody = el(doc, "tbody");
        for (const row of b.rows) {
          const r = el(doc, "tr");
          row.forEach((cell, k) => {
            const td = el(doc, "td");
            if (b.align[k]) td.className = `align-${b.align[k]}`;
            inlineToDOM(doc, cell, td);
            r.appendChild(td);
          });
          tbody.appendChild(r);
        }
        table.appendChild(tbody);
        wrap.appendChild(table);
        parent.appendChild(wrap);
        break;
      }
      case "code": {
        const box = el(doc, "div", "codeblock");
        const head = el(doc, "div", "codeblock-head");
        const label = el(doc, "span", "codeblock-lang");
        label.textContent = b.lang || "text";
        const copy = el(doc, "button", "codeblock-copy");
        copy.type = "button";
        copy.dataset.action = "copy-code";
        copy.textContent = "Copy";
        copy.setAttribute("aria-label", `Copy ${b.lang || "code"} to the clipboard`);
        head.append(label, copy);
        const pre = el(doc, "pre");
        const code = el(doc, "code");
        if (b.lang) code.className = `language-${b.lang}`;
        highlightInto(code, b.text, b.lang, doc);
        pre.appendChild(code);
        box.append(head, pre);
        parent.appendChild(box);
        break;
      }
    }
  }
}

/** Build a DocumentFragment for `src`; no input character is ever parsed as HTML. */
export function renderMarkdown(src, doc = globalThis.document) {
  const frag = doc.createDocumentFragment();
  blocksToDOM(doc, parse(src), frag);
  return frag;
}
