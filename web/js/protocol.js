// The wire: HTTP calls (with the API key, if any) and one WebSocket per chat session that
// reconnects with exponential backoff and replays from `last_seq`.
//
// `SessionSocket` applies every `start`/`token`/`done` frame at most once: a frame whose
// seq <= the last seq applied is dropped, so a replay after a reconnect (or a duplicate
// frame) can never duplicate text. Names and frames follow docs/protocol.md.

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message || code || `HTTP ${status}`);
    this.status = status;
    this.code = code || "http_error";
  }
}

export class Api {
  /** @param {() => string} getKey the API key ("" in open mode) */
  constructor(getKey) {
    this.getKey = getKey;
  }

  async request(method, path, body) {
    const headers = { Accept: "application/json" };
    const key = this.getKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let res;
    try {
      res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    } catch (err) {
      throw new ApiError(0, "network", "The server cannot be reached.");
    }
    if (res.status === 204) return null;
    let data = null;
    const text = await res.text();
    if (text) {
      try {
        data = JSON.parse(text);
      } catch {
        data = null;
      }
    }
    if (!res.ok) {
      const e = (data && data.error) || {};
      throw new ApiError(res.status, e.code, e.message);
    }
    return data;
  }

  limits() {
    return this.request("GET", "/v1/limits");
  }
  listSessions() {
    return this.request("GET", "/v1/sessions");
  }
  createSession(title, systemPrompt) {
    return this.request("POST", "/v1/sessions", { title, system_prompt: systemPrompt });
  }
  getSession(id) {
    return this.request("GET", `/v1/sessions/${encodeURIComponent(id)}`);
  }
  importSession(body) {
    return this.request("POST", "/v1/sessions/import", body);
  }
  /** A new session holding the first `turns` complete exchanges of `id` (regenerate, edit and resend). */
  branchSession(id, turns) {
    return this.request("POST", `/v1/sessions/${encodeURIComponent(id)}/branch`, { turns });
  }
  renameSession(id, title) {
    return this.request("PATCH", `/v1/sessions/${encodeURIComponent(id)}`, { title });
  }
  deleteSession(id) {
    return this.request("DELETE", `/v1/sessions/${encodeURIComponent(id)}`);
  }
  newResumeToken(id) {
    return this.request("POST", `/v1/sessions/${encodeURIComponent(id)}/token`);
  }
  cacheMap() {
    return this.request("GET", "/v1/admin/cache");
  }
}

/**
 * The socket URL; `sessionId` in the query lets a router (nginx) keep a session on its replica.
 * The API key never goes in it (proxies log URLs): the socket sends it as its first frame.
 */
export function wsUrl(sessionId = null) {
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const params = new URLSearchParams();
  if (sessionId) params.set("session_id", sessionId);
  const query = params.toString();
  return `${scheme}://${location.host}/v1/ws${query ? `?${query}` : ""}`;
}

const SEQ_FRAMES = new Set(["start", "token", "done"]);
const PING_EVERY_MS = 15000;
const DEAD_AFTER_MS = 35000;

/**
 * One session's socket. Events (CustomEvent, data in `detail`):
 *   state    {state: "connecting"|"open"|"closed", attempt, retryInMs}
 *   session  the `session` frame (after every successful hello)
 *   frame    a start/token/done frame not seen before
 *   pong     a pong frame
 *   history  a `history` frame (an earlier page of the history, asked for with {type: "history"})
 *   failure  {code, message}: an `error` frame (`unauthorized`, `conflict` and `not_found`
 *            on hello stop the reconnect loop; the owner decides what to do next)
 */
export class SessionSocket extends EventTarget {
  constructor({ sessionId = null, resumeToken = null, lastSeq = null, systemPrompt = null, title = null, getKey }) {
    super();
    this.sessionId = sessionId;
    this.resumeToken = resumeToken;
    this.lastSeq = lastSeq;
    this.systemPrompt = systemPrompt;
    this.title = title;
    this.getKey = getKey;
    this.state = "closed";
    this.ws = null;
    this.attempt = 0;
    this.timer = null;
    this.pingTimer = null;
    this.lastHeard = 0;
    this.attached = false; // a `session` frame arrived on the current socket
    this.stopped = true;
    this.queue = [];
    this._onOnline = () => this.kick();
    this._onVisible = () => {
      if (document.visibilityState === "visible") this.kick();
    };
  }

  emit(type, detail) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  setState(state, extra = {}) {
    this.state = state;
    this.emit("state", { state, attempt: this.attempt, ...extra });
  }

  start() {
    this.stopped = false;
    window.addEventListener("online", this._onOnline);
    document.addEventListener("visibilitychange", this._onVisible);
    this.open();
  }

  /** Reconnect now if a retry is pending (the network came back, the tab became visible). */
  kick() {
    if (this.stopped || this.state === "open") return;
    if (this.ws && this.ws.readyState === WebSocket.CONNECTING) return;
    clearTimeout(this.timer);
    this.attempt = 0;
    this.open();
  }

  open() {
    clearTimeout(this.timer);
    this.attached = false;
    this.setState("connecting");
    let ws;
    try {
      ws = new WebSocket(wsUrl(this.sessionId));
    } catch {
      this.retry();
      return;
    }
    this.ws = ws;
    ws.onopen = () => {
      if (ws !== this.ws) return;
      this.lastHeard = Date.now();
      const key = this.getKey();
      if (key) ws.send(JSON.stringify({ type: "auth", api_key: key }));
      ws.send(
        JSON.stringify({
          type: "hello",
          session_id: this.sessionId,
          resume_token: this.sessionId ? this.resumeToken : null,
          last_seq: this.sessionId ? this.lastSeq : null,
          system_prompt: this.sessionId ? null : this.systemPrompt,
          title: this.sessionId ? null : this.title,
        })
      );
    };
    ws.onmessage = (ev) => {
      if (ws !== this.ws) return;
      this.lastHeard = Date.now();
      let frame;
      try {
        frame = JSON.parse(ev.data);
      } catch {
        return;
      }
      this.handle(frame);
    };
    ws.onclose = (ev) => {
      if (ws !== this.ws) return;
      this.ws = null;
      this.attached = false;
      clearInterval(this.pingTimer);
      if (this.stopped) {
        this.setState("closed");
        return;
      }
      if (ev.code === 1008 || ev.code === 4409 || ev.code === 1009) {
        // unauthorized / conflict / too large: the owner decides (an error frame came first)
        this.stopped = true;
        this.setState("closed");
        return;
      }
      this.retry();
    };
  }

  retry() {
    if (this.stopped) return;
    const base = Math.min(10000, 300 * 2 ** this.attempt);
    const delay = Math.round(base * (0.8 + Math.random() * 0.4));
    this.attempt += 1;
    this.setState("connecting", { retryInMs: delay });
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.open(), delay);
  }

  handle(frame) {
    switch (frame.type) {
      case "session":
        this.sessionId = frame.session_id;
        this.resumeToken = frame.resume_token;
        this.attached = true;
        this.attempt = 0;
        this.setState("open");
        this.startPing();
        this.emit("session", frame);
        for (const f of this.queue.splice(0)) this.send(f);
        break;
      case "pong":
        this.emit("pong", frame);
        break;
      case "history":
        this.emit("history", frame);
        break;
      case "error":
        if (frame.code === "unauthorized" || frame.code === "conflict" || (frame.code === "not_found" && !this.attached)) {
          this.stopped = true;
          if (this.ws) this.ws.close();
          this.ws = null;
          clearInterval(this.pingTimer);
          clearTimeout(this.timer);
          this.setState("closed");
        }
        this.emit("failure", { code: frame.code, message: frame.message || frame.code });
        break;
      default:
        if (SEQ_FRAMES.has(frame.type)) {
          if (typeof frame.seq === "number") {
            if (this.lastSeq !== null && frame.seq <= this.lastSeq) return; // already applied
            this.lastSeq = frame.seq;
          }
          this.emit("frame", frame);
        }
    }
  }

  startPing() {
    clearInterval(this.pingTimer);
    this.pingTimer = setInterval(() => {
      if (!this.ws || this.ws.readyState !== WebSocket.OPEN) return;
      if (Date.now() - this.lastHeard > DEAD_AFTER_MS) {
        // a half-open socket: drop it and reconnect
        const ws = this.ws;
        this.ws = null;
        ws.onclose = null;
        ws.close();
        clearInterval(this.pingTimer);
        this.retry();
        return;
      }
      this.ws.send(JSON.stringify({ type: "ping" }));
    }, PING_EVERY_MS);
  }

  /** Send a frame now if attached, else once the next `session` frame arrives. */
  send(frame) {
    if (this.ws && this.attached && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify(frame));
      return true;
    }
    this.queue.push(frame);
    return false;
  }

  /** Send only if attached right now (used for frames that make no sense later, e.g. ping). */
  sendNow(frame) {
    if (this.ws && this.attached && this.ws.readyState === WebSocket.OPEN) {
      this.ws.send(JSON.stringify(frame));
      return true;
    }
    return false;
  }

  /** Forget queued frames of one type (e.g. a cancel made moot). */
  dropQueued(type) {
    this.queue = this.queue.filter((f) => f.type !== type);
  }

  close() {
    this.stopped = true;
    clearTimeout(this.timer);
    clearInterval(this.pingTimer);
    window.removeEventListener("online", this._onOnline);
    document.removeEventListener("visibilitychange", this._onVisible);
    const ws = this.ws;
    this.ws = null;
    this.attached = false;
    if (ws) {
      ws.onclose = null;
      ws.close(1000);
    }
    this.setState("closed");
  }
}
