// localStorage persistence. One key per concern, so two tabs never overwrite each other's
// sessions: chatcore.settings, chatcore.current, chatcore.session.<id>.
//
// Per session: {token, lastSeq, title, pending}. `pending` describes a turn this browser
// started and has not seen finish: {clientId, user, params, base, startSeq, turn}, where
// `base` is the number of history messages before it. After a reload the UI re-attaches
// with last_seq = startSeq - 1, so the server replays the whole running turn and the page
// rebuilds it from frames, each applied once (see docs/ui.md).

const PREFIX = "chatcore.";

function read(key, fallback) {
  try {
    const raw = localStorage.getItem(PREFIX + key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

function write(key, value) {
  try {
    if (value === null || value === undefined) localStorage.removeItem(PREFIX + key);
    else localStorage.setItem(PREFIX + key, JSON.stringify(value));
  } catch {
    /* storage full or disabled: the UI keeps working for this page's lifetime */
  }
}

// serverMaxTokens: the server's max_tokens limit, from the last session frame (null: not known yet).
// systemPrompt: null until set, then the new-chat system prompt. theme: "system", "light" or "dark".
export const DEFAULT_SETTINGS = {
  temperature: 0.7,
  topP: 1,
  maxTokens: 512,
  serverMaxTokens: null,
  jsonMode: false,
  systemPrompt: null,
  theme: "system",
  apiKey: "",
  showCache: false,
};

export const store = {
  settings() {
    return { ...DEFAULT_SETTINGS, ...read("settings", {}) };
  },
  saveSettings(patch) {
    const next = { ...this.settings(), ...patch };
    write("settings", next);
    return next;
  },
  current() {
    return read("current", null);
  },
  setCurrent(id) {
    write("current", id);
  },
  session(id) {
    return read(`session.${id}`, null);
  },
  saveSession(id, patch) {
    const next = { ...(read(`session.${id}`, null) || {}), ...patch };
    write(`session.${id}`, next);
    return next;
  },
  forgetSession(id) {
    write(`session.${id}`, null);
    if (this.current() === id) this.setCurrent(null);
  },
  knownSessionIds() {
    const ids = [];
    for (let i = 0; i < localStorage.length; i++) {
      const key = localStorage.key(i);
      if (key && key.startsWith(`${PREFIX}session.`)) ids.push(key.slice(PREFIX.length + 8));
    }
    return ids;
  },
};
