// One chat session's state: its messages, its socket, and the rules that turn frames into
// text exactly once, across reconnects and page reloads. The view (app.js) listens to the
// events below and renders; nothing here touches the DOM.
//
// Events (CustomEvent `detail`):
//   reset                the message list was rebuilt
//   message {msg}        a message was added or changed
//   removed {msg}        a message was removed (a rejected turn)
//   running {running}    a turn started or ended (Stop enabled/disabled)
//   conn {state, retryInMs}
//   meta                 id, title, system prompt or cache figures changed
//   limits {max_tokens, max_message_tokens}  the server's limits (from the session frame)
//   created              a new session got its id
//   done {msg}           a turn finished (refresh the sidebar and the cache map)
//   rejected {content, code, message}  the server refused the user frame
//   notice {text, kind}  something the user should know
//   gone | conflict | auth

import { ApiError, SessionSocket } from "./protocol.js";
import { store } from "./store.js";

let keyCounter = 0;

export function uuid() {
  if (globalThis.crypto && typeof crypto.randomUUID === "function") return crypto.randomUUID();
  const b = crypto.getRandomValues(new Uint8Array(16));
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  const h = Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
  return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
}

export function titleFrom(text) {
  const line = text.trim().split("\n")[0].replace(/\s+/g, " ");
  return line.length > 48 ? `${line.slice(0, 47)}…` : line;
}

function makeMsg(role, content, extra = {}) {
  return {
    key: `m${++keyCounter}`,
    role,
    content,
    streaming: false,
    waiting: false,
    finish: null,
    usage: null,
    timing: null,
    turn: null,
    ...extra,
  };
}

/** Where a `session` or `history` frame's page starts in the whole history. */
function pageStart(f) {
  return Number.isInteger(f.history_start) && f.history_start > 0 ? f.history_start : 0;
}

/** How many of `messages` the server's history holds: a turn that ended in `error` is not kept there. */
export function canonicalCount(messages) {
  let n = 0;
  for (const m of messages) {
    if (m.role === "assistant" && m.finish === "error") n -= 1; // and its user message
    else n += 1;
  }
  return Math.max(0, n);
}

/** Whether an answer counts as a complete exchange on the server (a failed or interrupted one does not;
 * an answer loaded from the history without a finish reason does). */
function completes(answer) {
  return !!answer && answer.role === "assistant" && !answer.streaming && answer.finish !== "error" && answer.finish !== "interrupted";
}

/** The number of complete exchanges (a user message and its answer) before `messages[index]`: the
 * branch point (`POST /v1/sessions/{id}/branch`, `turns`) that keeps everything before it. */
export function exchangesBefore(messages, index) {
  let n = 0;
  for (let i = 0; i < index; i++) {
    if (messages[i].role === "user" && completes(messages[i + 1])) n += 1;
  }
  return n;
}

export class ChatSession extends EventTarget {
  constructor({ id = null, api, getKey, title = "", systemPrompt = null }) {
    super();
    this.id = id;
    this.api = api;
    this.getKey = getKey;
    this.title = title || "";
    this.systemPrompt = systemPrompt;
    this.messages = [];
    this.truncatedTurns = 0;
    // Messages of the server's history before messages[0], not loaded yet (`history_start`): a hello
    // brings the last page; `loadEarlier` asks for the one before (docs/protocol.md, "History pages").
    this.offset = 0;
    this.loadingEarlier = false;
    this.running = false;
    this.loaded = false;
    this.connState = "closed";
    this.socket = null;
    this.pending = null;
    this.sessionSeq = null;
    this.adopt = null;
    this.awaitBarrier = false;
    this.tokenRetried = false;
    this.closed = false;
    this.info = null; // GET /v1/sessions/{id}: state and cache figures
    this.queued = null; // {content, params}: a message to send once the history is loaded (a branch)
  }

  emit(type, detail = {}) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  // ---- connection ---------------------------------------------------------------------

  /** Attach to the server: resume `this.id`, or (id null) wait for the first message. */
  async connect() {
    if (!this.id || this.socket) return;
    let saved = store.session(this.id);
    if (!saved || !saved.token) {
      // a session this browser has no token for (created elsewhere, or storage was cleared)
      if (!(await this.refreshToken())) return;
      saved = store.session(this.id);
    }
    this.pending = saved.pending || null;
    let lastSeq = saved.lastSeq ?? null;
    if (this.pending && this.pending.startSeq != null) lastSeq = this.pending.startSeq - 1;
    this.openSocket({ sessionId: this.id, resumeToken: saved.token, lastSeq });
  }

  openSocket(opts) {
    const socket = new SessionSocket({ ...opts, getKey: this.getKey });
    this.socket = socket;
    socket.addEventListener("state", (e) => {
      if (socket !== this.socket) return;
      this.connState = e.detail.state;
      this.emit("conn", e.detail);
    });
    socket.addEventListener("session", (e) => socket === this.socket && this.onSession(e.detail));
    socket.addEventListener("frame", (e) => socket === this.socket && this.onFrame(e.detail));
    socket.addEventListener("pong", () => socket === this.socket && this.onPong());
    socket.addEventListener("history", (e) => socket === this.socket && this.onHistory(e.detail));
    socket.addEventListener("failure", (e) => socket === this.socket && this.onFailure(e.detail));
    socket.start();
  }

  async refreshToken() {
    try {
      const res = await this.api.newResumeToken(this.id);
      store.saveSession(this.id, { token: res.resume_token });
      return true;
    } catch (err) {
      if (err instanceof ApiError && err.status === 404) this.emit("gone");
      else if (err instanceof ApiError && (err.status === 401 || err.status === 403)) this.emit("auth");
      else this.emit("notice", { kind: "error", text: `Cannot resume this chat: ${err.message}` });
      return false;
    }
  }

  /** Take the session back after another tab took it over (`conflict`). */
  takeOver() {
    if (!this.socket) return this.connect();
    this.socket.start();
  }

  /** Reconnect after the API key changed. */
  restart() {
    if (!this.socket) return;
    this.socket.close();
    const { sessionId, resumeToken, lastSeq, systemPrompt, title } = this.socket;
    this.openSocket({ sessionId, resumeToken: store.session(sessionId)?.token || resumeToken, lastSeq, systemPrompt, title });
  }

  close() {
    this.closed = true;
    if (this.socket) this.socket.close();
  }

  // ---- frames -----------------------------------------------------------------------

  onSession(f) {
    const isNew = this.id === null;
    this.id = f.session_id;
    this.sessionSeq = typeof f.seq === "number" ? f.seq : null;
    this.tokenRetried = false;
    this.setWindow(f.truncated_turns);
    if (f.limits && typeof f.limits === "object") this.emit("limits", f.limits);
    if (typeof f.title === "string" && (f.title || !this.title)) this.title = f.title;
    store.saveSession(this.id, { token: f.resume_token, title: this.title });
    if (isNew) {
      store.saveSession(this.id, { lastSeq: null });
      if (this.pending) store.saveSession(this.id, { pending: this.pending });
      this.loaded = true;
      this.emit("created");
      this.emit("meta");
      if (this.pending && this.pending.startSeq == null) this.sendUser();
      return;
    }
    const history = Array.isArray(f.history) ? f.history : [];
    const start = pageStart(f);
    if (!this.loaded) {
      this.build(history, start);
      this.loaded = true;
      this.emit("reset");
      this.loadDetails();
    } else {
      this.reconcile(history, start);
    }
    this.emit("meta");
    if (this.queued && !this.pending && !this.running) {
      const { content, params } = this.queued;
      this.queued = null;
      this.sendMessage(content, params);
      return;
    }
    if (this.pending && this.pending.startSeq == null) {
      // we never saw this turn start: after the replay (a ping's pong marks its end), resend
      // the user frame; its id makes that idempotent on the server
      this.awaitBarrier = true;
      this.socket.sendNow({ type: "ping" });
    }
  }

  build(history, start = 0) {
    this.offset = start;
    const hist = [];
    for (const m of history) {
      if (m.role === "system") {
        if (!this.systemPrompt) this.systemPrompt = m.content;
      } else if (m.role === "user" || m.role === "assistant") {
        hist.push(makeMsg(m.role, m.content || "", { finish: m.finish_reason || null }));
      }
    }
    const p = this.pending;
    this.adopt = null;
    let running = false;
    if (p) {
      const at = Math.max(0, p.base - start); // where the turn is in the loaded page
      if (hist.length >= at + 2 && hist[at].role === "user" && hist[at + 1].role === "assistant") {
        // the history already holds this turn (it finished while we were away, or the server
        // lists it in flight): replayed frames only confirm its text and bring its statistics
        this.adopt = { msg: hist[at + 1], turn: p.turn, shadow: "", fromPending: true, sawStart: false };
        this.clearPending(); // nothing to resend: the server has the whole exchange
      } else {
        hist.length = Math.min(hist.length, at); // a running turn's user message is ours to show
        hist.push(makeMsg("user", p.user, { clientId: p.clientId }));
        hist.push(makeMsg("assistant", "", { streaming: true, waiting: true, turn: p.turn }));
        running = true;
      }
    }
    this.messages = hist;
    this.setRunning(running);
  }

  reconcile(history, start = 0) {
    // Same page, new socket: our messages stay, the replay continues the running turn.
    // Only if the server knows more completed turns than we show (another tab) do we rebuild.
    const completed = this.offset + canonicalCount(this.messages.filter((m) => !m.streaming && !(m.role === "user" && this.isPendingUser(m))));
    const serverCount = start + history.filter((m) => m.role !== "system").length;
    const ours = this.running ? completed + 2 : completed;
    if (serverCount > ours) {
      this.build(history, start);
      this.emit("reset");
      this.loadDetails();
    }
  }

  /** Ask for the page of history before the loaded messages (a `history` frame). */
  loadEarlier() {
    if (this.offset <= 0 || this.loadingEarlier || !this.socket || !this.socket.attached) return false;
    this.loadingEarlier = true;
    this.socket.sendNow({ type: "history", before: this.offset });
    return true;
  }

  onHistory(f) {
    this.loadingEarlier = false;
    const page = Array.isArray(f.history) ? f.history : [];
    const start = pageStart(f);
    if (start + page.length !== this.offset) return; // not the page before ours (the history was rebuilt)
    const earlier = page.filter((m) => m.role === "user" || m.role === "assistant")
      .map((m) => makeMsg(m.role, m.content || "", { finish: m.finish_reason || null }));
    this.messages = [...earlier, ...this.messages];
    this.offset = start;
    this.emit("earlier", { count: earlier.length });
  }

  /** The number of complete exchanges before `messages[index]`, counting those not loaded yet. */
  exchangesBefore(index) {
    return this.offset / 2 + exchangesBefore(this.messages, index);
  }

  isPendingUser(m) {
    return this.pending && m.clientId === this.pending.clientId;
  }

  onPong() {
    if (!this.awaitBarrier) return;
    this.awaitBarrier = false;
    const p = this.pending;
    if (!p || p.startSeq != null) return;
    if (p.cancelled) {
      const msg = this.streamingMsg();
      if (msg) this.finishMsg(msg, { finish_reason: "cancelled" });
      this.clearPending();
      this.setRunning(false);
      return;
    }
    this.sendUser();
  }

  sendUser() {
    const p = this.pending;
    if (!p || !this.socket) return;
    this.socket.sendNow({ type: "user", id: p.clientId, content: p.user, params: p.params });
  }

  streamingMsg(turn = null) {
    for (let i = this.messages.length - 1; i >= 0; i--) {
      const m = this.messages[i];
      if (m.role === "assistant" && m.streaming && (turn === null || m.turn === null || m.turn === turn)) return m;
    }
    return null;
  }

  isLive(f) {
    return this.sessionSeq === null || f.seq > this.sessionSeq;
  }

  /** The model's view starts after this many complete exchanges (the context policy truncated them). */
  setWindow(truncated) {
    const n = Number.isInteger(truncated) && truncated > 0 ? truncated : 0;
    if (n === this.truncatedTurns) return;
    this.truncatedTurns = n;
    this.emit("window");
  }

  onFrame(f) {
    if (f.type === "start" && this.isLive(f)) this.setWindow(f.truncated_turns);
    const a = this.adopt;
    if (a && (a.turn === null || a.turn === undefined || a.turn === f.turn)) {
      this.onAdoptFrame(a, f);
      return;
    }
    if (f.type === "start") {
      let msg = this.streamingMsg(f.turn);
      if (msg) {
        msg.turn = f.turn;
        if (this.pending) {
          this.pending.startSeq = f.seq;
          this.pending.turn = f.turn;
          this.persistPending();
        }
        this.emit("message", { msg });
      } else {
        const last = this.messages[this.messages.length - 1];
        if (last && last.role === "assistant" && !this.isLive(f)) {
          // a replay of a turn this page did not start: probably the last one in the history
          this.adopt = { msg: last, turn: f.turn, shadow: "", fromPending: false, sawStart: true };
          return;
        }
        msg = makeMsg("assistant", "", { streaming: true, waiting: true, turn: f.turn, foreign: true });
        this.messages.push(msg);
        this.emit("message", { msg });
      }
      this.setRunning(true);
      return;
    }
    let msg = this.streamingMsg(f.turn);
    if (!msg) {
      if (f.type === "done") return;
      // a token of a turn whose start we missed: show it rather than lose it
      msg = makeMsg("assistant", "", { streaming: true, turn: f.turn, foreign: true });
      this.messages.push(msg);
      this.setRunning(true);
    }
    if (f.type === "token") {
      if ((f.index || 0) !== 0) return;
      msg.content += f.text || "";
      msg.waiting = false;
      this.emit("message", { msg });
    } else if (f.type === "done") {
      this.finishMsg(msg, f);
      this.afterDone(msg, f);
    }
  }

  onAdoptFrame(a, f) {
    // The replayed text is the whole answer when its `start` was replayed too; otherwise it
    // is only a tail, and the text from the history stays.
    const whole = () => a.sawStart || a.shadow.startsWith(a.msg.content);
    if (f.type === "start") {
      a.turn = f.turn;
      a.sawStart = true;
      return;
    }
    if (f.type === "token") {
      if ((f.index || 0) !== 0) return;
      a.shadow += f.text || "";
      if (this.isLive(f) && (a.fromPending || a.shadow.startsWith(a.msg.content))) {
        // still running: the history held a partial answer; continue it live
        if (whole()) a.msg.content = a.shadow;
        a.msg.streaming = true;
        a.msg.turn = f.turn;
        this.adopt = null;
        this.setRunning(true);
        this.emit("message", { msg: a.msg });
      } else if (this.isLive(f)) {
        this.adopt = null;
        const msg = makeMsg("assistant", a.shadow, { streaming: true, turn: f.turn, foreign: true });
        this.messages.push(msg);
        this.setRunning(true);
        this.emit("message", { msg });
      }
      return;
    }
    if (f.type === "done") {
      if (whole() && a.shadow.length >= a.msg.content.length && (a.fromPending || a.shadow.startsWith(a.msg.content))) {
        a.msg.content = a.shadow;
      }
      this.adopt = null;
      this.finishMsg(a.msg, f);
      this.afterDone(a.msg, f);
    }
  }

  finishMsg(msg, f) {
    msg.streaming = false;
    msg.waiting = false;
    msg.finish = f.finish_reason || msg.finish || "stop";
    if (f.usage) msg.usage = f.usage;
    if (f.timing) msg.timing = f.timing;
    this.emit("message", { msg });
  }

  afterDone(msg, f) {
    if (this.pending) this.clearPending();
    if (this.socket && this.socket.lastSeq !== null) store.saveSession(this.id, { lastSeq: this.socket.lastSeq });
    this.setRunning(false);
    this.emit("done", { msg });
    this.loadDetails(!!msg.foreign);
  }

  onFailure({ code, message }) {
    this.loadingEarlier = false; // a refused history frame (busy) may be asked again
    if (code === "unauthorized") {
      if (this.id && !this.tokenRetried) {
        this.tokenRetried = true;
        this.refreshToken().then((ok) => {
          if (ok && !this.closed) {
            this.socket.resumeToken = store.session(this.id).token;
            this.socket.start();
          }
        });
      } else {
        this.emit("auth");
      }
      return;
    }
    if (code === "conflict") {
      this.emit("conflict");
      return;
    }
    if (code === "not_found" && !(this.socket && this.socket.attached)) {
      // the hello failed: the session is gone, or belongs to another tenant
      this.emit("gone");
      return;
    }
    const p = this.pending;
    if (p && p.startSeq == null && !this.awaitBarrier && ["busy", "too_large", "bad_request", "not_found"].includes(code)) {
      // the server refused our user frame: take the turn back and give the text back
      const drop = this.messages.filter((m) => m.clientId === p.clientId || (m.role === "assistant" && m.streaming));
      this.messages = this.messages.filter((m) => !drop.includes(m));
      for (const msg of drop) this.emit("removed", { msg });
      this.clearPending();
      this.setRunning(false);
      this.emit("rejected", { content: p.user, code, message });
      return;
    }
    if (code === "busy" && this.awaitBarrier) return; // our turn is running; its replay comes
    this.emit("notice", { kind: "error", text: `${code}: ${message}` });
  }

  // ---- actions ----------------------------------------------------------------------

  /** Start a turn. For a new session (id null) this opens the socket with a hello first. */
  sendMessage(content, params) {
    if (this.running) return false;
    const clientId = uuid();
    const base = this.offset + canonicalCount(this.messages);
    this.messages.push(makeMsg("user", content, { clientId }));
    const reply = makeMsg("assistant", "", { streaming: true, waiting: true });
    this.messages.push(reply);
    this.emit("message", { msg: this.messages[this.messages.length - 2] });
    this.emit("message", { msg: reply });
    this.pending = { clientId, user: content, params, base, startSeq: null, turn: null };
    this.setRunning(true);
    if (!this.socket) {
      if (!this.title) this.title = titleFrom(content);
      this.openSocket({ sessionId: null, systemPrompt: this.systemPrompt || null, title: this.title || null });
    } else {
      this.persistPending();
      if (this.socket.attached) this.sendUser();
      else this.socket.kick();
    }
    return true;
  }

  /** Send a message in a session that is being opened: after its history is on screen (so the turn
   * knows where it starts). A session already loaded sends at once. */
  sendWhenLoaded(content, params) {
    if (this.loaded) return this.sendMessage(content, params);
    this.queued = { content, params };
    return true;
  }

  cancel() {
    if (!this.running || !this.socket) return;
    if (this.pending && this.pending.startSeq == null && !this.socket.attached) this.pending.cancelled = true;
    this.socket.send({ type: "cancel" });
  }

  setRunning(running) {
    if (this.running === running) return;
    this.running = running;
    this.emit("running", { running });
  }

  persistPending() {
    if (this.id) store.saveSession(this.id, { pending: this.pending });
  }

  clearPending() {
    this.pending = null;
    if (this.id) store.saveSession(this.id, { pending: null });
  }

  /** Per-answer statistics for the history, the system prompt and the cache figures. */
  async loadDetails(rebuildForeign = false) {
    if (!this.id) return;
    let d;
    try {
      d = await this.api.getSession(this.id);
    } catch {
      return;
    }
    if (this.closed) return;
    this.info = d;
    if (d.system_prompt !== undefined) this.systemPrompt = d.system_prompt;
    if (typeof d.title === "string") this.title = d.title;
    const hist = (d.history || []).filter((m) => m.role === "user" || m.role === "assistant");
    if (rebuildForeign && !this.running) {
      // a turn started elsewhere finished: the server's history is the whole truth
      this.messages = hist.map((m) => makeMsg(m.role, m.content || "", { finish: m.finish_reason, usage: m.usage, timing: m.timing }));
      this.offset = 0;
      this.emit("reset");
    } else {
      // walk both lists in order; the stored one may hold more rows (failed or running turns)
      let j = 0;
      for (const h of hist) {
        const m = this.messages[j];
        if (!m) break;
        if (m.role !== h.role || (m.content !== (h.content || "") && !m.streaming)) continue;
        j += 1;
        if (h.role !== "assistant" || m.streaming) continue;
        let changed = false;
        if (!m.usage && h.usage) (m.usage = h.usage), (changed = true);
        if (!m.timing && h.timing) (m.timing = h.timing), (changed = true);
        if (!m.finish && h.finish_reason) (m.finish = h.finish_reason), (changed = true);
        if (changed) this.emit("message", { msg: m });
      }
    }
    this.emit("meta");
  }
}
