// Syntax highlighting for code blocks, with the vendored highlight.js (web/vendor/highlight/).
//
// highlight.js produces HTML; we do not use it. Its token tree (`result._emitter.root`: nodes
// {scope, children} and plain strings) is turned into <span class="hl-…"> elements and text
// nodes, so nothing goes through innerHTML and every character stays text. A language that is
// not registered, or a block over MAX_CHARS, stays plain.

import hljs from "../vendor/highlight/core.min.js";
import bash from "../vendor/highlight/languages/bash.min.js";
import c from "../vendor/highlight/languages/c.min.js";
import cpp from "../vendor/highlight/languages/cpp.min.js";
import css from "../vendor/highlight/languages/css.min.js";
import diff from "../vendor/highlight/languages/diff.min.js";
import go from "../vendor/highlight/languages/go.min.js";
import java from "../vendor/highlight/languages/java.min.js";
import javascript from "../vendor/highlight/languages/javascript.min.js";
import json from "../vendor/highlight/languages/json.min.js";
import plaintext from "../vendor/highlight/languages/plaintext.min.js";
import python from "../vendor/highlight/languages/python.min.js";
import rust from "../vendor/highlight/languages/rust.min.js";
import shell from "../vendor/highlight/languages/shell.min.js";
import sql from "../vendor/highlight/languages/sql.min.js";
import typescript from "../vendor/highlight/languages/typescript.min.js";
import xml from "../vendor/highlight/languages/xml.min.js";
import yaml from "../vendor/highlight/languages/yaml.min.js";

const LANGUAGES = { bash, c, cpp, css, diff, go, java, javascript, json, plaintext, python, rust, shell, sql, typescript, xml, yaml };
for (const [name, grammar] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, grammar);
hljs.configure({ ignoreUnescapedHTML: true, throwUnescapedHTML: false });

const MAX_CHARS = 100_000;

/** The registered language's name for a fence's tag (aliases too: `py` is python, `js` javascript,
 * `sh` bash, `html` xml…), or null. */
export function languageOf(tag) {
  if (!tag) return null;
  const lang = hljs.getLanguage(String(tag).toLowerCase());
  return lang ? Object.keys(LANGUAGES).find((name) => hljs.getLanguage(name) === lang) || null : null;
}

function classesOf(scope) {
  // highlight.js's own naming: "title.function" -> hljs-title function_; we prefix ours with hl-
  if (scope.startsWith("language:")) return [];
  const [first, ...rest] = scope.split(".");
  return [`hl-${first}`, ...rest.map((x, i) => `hl-${x}${"_".repeat(i + 1)}`)];
}

function build(doc, node, parent) {
  for (const child of node.children || []) {
    if (typeof child === "string") {
      parent.appendChild(doc.createTextNode(child));
    } else {
      const classes = child.scope ? classesOf(child.scope) : [];
      if (!classes.length) {
        build(doc, child, parent);
        continue;
      }
      const span = doc.createElement("span");
      span.className = classes.join(" ");
      build(doc, child, span);
      parent.appendChild(span);
    }
  }
}

/** Fill `codeEl` with `text`, highlighted as `tag` when that language is known. Returns whether it was. */
export function highlightInto(codeEl, text, tag, doc = globalThis.document) {
  const language = languageOf(tag);
  if (!language || text.length > MAX_CHARS) {
    codeEl.textContent = text;
    return false;
  }
  let root;
  try {
    root = hljs.highlight(text, { language, ignoreIllegals: true })._emitter.root;
  } catch {
    codeEl.textContent = text;
    return false;
  }
  const frag = doc.createDocumentFragment();
  build(doc, root, frag);
  codeEl.replaceChildren(frag);
  if (codeEl.textContent !== text) {
    codeEl.textContent = text; // never show anything but the exact text
    return false;
  }
  codeEl.dataset.highlighted = language;
  return true;
}
