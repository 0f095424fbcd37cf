// Keyboard shortcuts: one table, used both to handle keys (app.js) and to list them in the help
// dialog, so the list can never drift from what the keys do.

const isMac = /Mac|iPhone|iPad/.test(navigator.platform || navigator.userAgent || "");
const mod = (e) => (isMac ? e.metaKey : e.ctrlKey);
const plain = (e) => !e.ctrlKey && !e.metaKey && !e.altKey;

/** Whether the key goes to a text field (then single-key shortcuts stay out of the way). */
function typing(e) {
  const t = e.target;
  if (!t || !(t instanceof Element)) return false;
  return t.isContentEditable || t.matches("textarea, select, input:not([type=checkbox]):not([type=radio]):not([type=button]):not([type=range])");
}

export const SHORTCUTS = [
  {
    id: "newChat",
    label: "New chat",
    keys: [[isMac ? "⌘" : "Ctrl", "Shift", "O"]],
    match: (e) => mod(e) && e.shiftKey && !e.altKey && e.key.toLowerCase() === "o",
  },
  {
    id: "regenerate",
    label: "Regenerate the last answer",
    keys: [[isMac ? "⌘" : "Ctrl", "Shift", "Enter"]],
    aria: `${isMac ? "Meta" : "Control"}+Shift+Enter`,
    match: (e) => mod(e) && e.shiftKey && !e.altKey && e.key === "Enter",
  },
  {
    id: "focusComposer",
    label: "Focus the message box",
    keys: [["/"], ["Shift", "Esc"]],
    match: (e) => (e.key === "/" && plain(e) && !typing(e)) || (e.key === "Escape" && e.shiftKey && plain(e)),
  },
  {
    id: "stop",
    label: "Stop the answer",
    keys: [["Esc"]],
    match: (e) => e.key === "Escape" && !e.shiftKey && plain(e),
  },
  {
    id: "help",
    label: "Show these shortcuts",
    keys: [["?"]],
    match: (e) => e.key === "?" && !e.ctrlKey && !e.metaKey && !e.altKey && !typing(e),
  },
];

export function matchShortcut(e, list = SHORTCUTS) {
  return list.find((s) => s.match(e)) || null;
}

/** Fill a <dl> with one row per shortcut: its keys (<kbd>), then what it does. */
export function renderShortcutList(dl, list = SHORTCUTS) {
  const rows = [];
  for (const s of list) {
    const dt = document.createElement("dt");
    s.keys.forEach((combo, i) => {
      if (i) dt.append(" or ");
      combo.forEach((k, j) => {
        if (j) dt.append("+");
        const kbd = document.createElement("kbd");
        kbd.textContent = k;
        dt.appendChild(kbd);
      });
    });
    const dd = document.createElement("dd");
    dd.textContent = s.label;
    const row = document.createElement("div");
    row.className = "shortcut";
    row.setAttribute("data-testid", "shortcut");
    row.dataset.shortcut = s.id;
    row.append(dt, dd);
    rows.push(row);
  }
  dl.replaceChildren(...rows);
}
