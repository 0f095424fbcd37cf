// The "cache" panel: the KV block map from GET /v1/admin/cache.
//
// Two views of the same data:
//   chains  one row per session, its blocks in table order. A block other sessions also
//           hold is drawn as shared, so a system prompt stored once shows up as the same
//           leading run of blocks in every session that uses it.
//   pool    every listed (non-free) block by id, coloured by state (used / cached). A block
//           with ref > 1 carries a marker. Hovering or focusing a session highlights its
//           blocks; hovering a block highlights the sessions that hold it.

import { ApiError } from "./protocol.js";
import { fmtInt, h, icon } from "./ui.js";

const REFRESH_MS = 2000;

function blockIdsOf(session, blocks) {
  if (Array.isArray(session.blocks)) return session.blocks.map((b) => (typeof b === "object" && b ? b.id : b));
  return blocks.filter((b) => Array.isArray(b.sessions) && b.sessions.includes(session.id)).map((b) => b.id);
}

export class CachePanel {
  constructor(root, api, { getCurrentId, onClose, onOpenSession }) {
    this.root = root;
    this.api = api;
    this.getCurrentId = getCurrentId;
    this.onClose = onClose;
    this.onOpenSession = onOpenSession;
    this.timer = null;
    this.data = null;
    this.hover = null; // {kind: "session"|"block", id}
    this.pinned = null; // a session id chosen by click
    this.loading = false;
    this.build();
  }

  build() {
    this.status = h("p", { class: "cache-status", role: "status" });
    this.summary = h("div", { class: "cache-summary" });
    this.chains = h("ul", { class: "chain-list", "aria-label": "Sessions and their block chains" });
    this.grid = h("div", { class: "block-grid", role: "img" });
    this.freeNote = h("p", { class: "cache-note" });
    const refresh = h("button", { type: "button", class: "icon-btn", "aria-label": "Refresh the cache map" }, icon("refresh"));
    refresh.addEventListener("click", () => this.refresh());
    const close = h("button", { type: "button", class: "icon-btn", "aria-label": "Close the cache panel" }, icon("close"));
    close.addEventListener("click", () => this.onClose());
    const legend = h(
      "ul",
      { class: "legend", "aria-label": "Legend" },
      h("li", {}, h("span", { class: "cell state-used", "aria-hidden": "true" }), "used"),
      h("li", {}, h("span", { class: "cell state-cached", "aria-hidden": "true" }), "cached, reusable"),
      h("li", {}, h("span", { class: "cell state-used shared", "aria-hidden": "true" }), "ref > 1 (shared)"),
      h("li", {}, h("span", { class: "cell state-used hl", "aria-hidden": "true" }), "selected session")
    );
    this.root.replaceChildren(
      h("div", { class: "cache-head" }, h("h2", {}, "KV cache"), h("div", { class: "cache-head-actions" }, refresh, close)),
      this.status,
      this.summary,
      legend,
      h("h3", { class: "cache-sub" }, "Chains"),
      h("p", { class: "cache-hint" }, "Each session's blocks in order. Shared blocks are stored once and referenced by every session that holds them."),
      this.chains,
      h("h3", { class: "cache-sub" }, "Pool"),
      this.grid,
      this.freeNote
    );
    this.chains.addEventListener("mouseleave", () => this.setHover(null));
    this.grid.addEventListener("mouseleave", () => this.setHover(null));
    this.grid.addEventListener("mouseover", (e) => {
      const cell = e.target.closest(".cell[data-block]");
      if (cell) this.setHover({ kind: "block", id: Number(cell.dataset.block) });
    });
    this.chains.addEventListener("mouseover", (e) => {
      const cell = e.target.closest(".cell[data-block]");
      if (cell) return this.setHover({ kind: "block", id: Number(cell.dataset.block) });
      const row = e.target.closest("[data-session]");
      if (row) this.setHover({ kind: "session", id: row.dataset.session });
    });
    this.chains.addEventListener("focusin", (e) => {
      const row = e.target.closest("[data-session]");
      if (row) this.setHover({ kind: "session", id: row.dataset.session });
    });
    this.chains.addEventListener("focusout", () => this.setHover(null));
  }

  get isOpen() {
    return !this.root.hidden;
  }

  open() {
    this.root.hidden = false;
    this.refresh();
    clearInterval(this.timer);
    this.timer = setInterval(() => {
      if (document.visibilityState === "visible") this.refresh();
    }, REFRESH_MS);
  }

  close() {
    this.root.hidden = true;
    clearInterval(this.timer);
    this.timer = null;
  }

  async refresh() {
    if (!this.isOpen || this.loading) return;
    this.loading = true;
    try {
      this.data = await this.api.cacheMap();
      this.status.textContent = "";
      this.status.hidden = true;
      this.render();
    } catch (err) {
      this.status.hidden = false;
      if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
        this.status.textContent = "The cache map needs an admin API key (Settings → API key).";
      } else if (err instanceof ApiError && err.status === 404) {
        this.status.textContent = "This server does not expose /v1/admin/cache.";
      } else {
        this.status.textContent = `Cannot load the cache map: ${err.message}`;
      }
    } finally {
      this.loading = false;
    }
  }

  render() {
    const d = this.data || {};
    const audit = d.audit || {};
    const blocks = Array.isArray(d.blocks) ? d.blocks : [];
    const sessions = Array.isArray(d.sessions) ? d.sessions : [];
    const byId = new Map(blocks.map((b) => [b.id, b]));
    const total = audit.total ?? blocks.length;
    const used = audit.used ?? blocks.filter((b) => b.state === "used").length;
    const cached = audit.cached ?? blocks.filter((b) => b.state === "cached").length;
    const free = audit.free ?? Math.max(0, total - used - cached);
    const shared = blocks.filter((b) => (b.ref || 0) > 1).length;
    const sumRefs = audit.sum_refs ?? blocks.reduce((a, b) => a + (b.ref || 0), 0);
    const bs = d.block_size || 0;

    const bar = h("div", { class: "occupancy", role: "img", "aria-label": `${used} used, ${cached} cached and ${free} free blocks of ${total}` });
    for (const [cls, n] of [["used", used], ["cached", cached], ["free", free]]) {
      const seg = h("span", { class: `occ-${cls}` });
      seg.style.flexGrow = String(n);
      if (n > 0 && cls !== "free") seg.style.minWidth = "4px";
      bar.appendChild(seg);
    }
    const ok = audit.ok !== false;
    const violations = Array.isArray(audit.violations) ? audit.violations.length : audit.violations || 0;
    this.summary.replaceChildren(
      bar,
      h(
        "dl",
        { class: "cache-figures" },
        h("div", {}, h("dt", {}, "used"), h("dd", {}, fmtInt(used))),
        h("div", {}, h("dt", {}, "cached"), h("dd", {}, fmtInt(cached))),
        h("div", {}, h("dt", {}, "free"), h("dd", {}, fmtInt(free))),
        h("div", {}, h("dt", {}, "shared"), h("dd", {}, fmtInt(shared))),
        h("div", {}, h("dt", {}, "refs"), h("dd", {}, fmtInt(sumRefs))),
        h("div", {}, h("dt", {}, "block"), h("dd", {}, bs ? `${bs} tok` : "–"))
      ),
      h("p", { class: `audit ${ok ? "audit-ok" : "audit-bad"}` }, ok ? "Audit OK: every reference is accounted for" : `Audit failed: ${violations} violation(s)`)
    );
    const saved = Math.max(0, sumRefs - used); // references served by a block stored once
    if (saved > 0) {
      this.summary.appendChild(
        h(
          "p",
          { class: "cache-saving" },
          h("b", {}, fmtInt(saved)),
          ` block${saved === 1 ? "" : "s"}${bs ? ` (${fmtInt(saved * bs)} tokens)` : ""} of KV not stored twice, thanks to sharing`
        )
      );
    }

    // chains
    const current = this.getCurrentId();
    const holders = new Map(); // block id -> number of sessions holding it
    const chainIds = sessions.map((s) => blockIdsOf(s, blocks));
    chainIds.forEach((ids) => new Set(ids).forEach((id) => holders.set(id, (holders.get(id) || 0) + 1)));
    const order = sessions.map((s, i) => i).sort((a, b) => (sessions[b].id === current) - (sessions[a].id === current));
    const rows = order.map((i) => {
      const s = sessions[i];
      const ids = chainIds[i];
      const sharedHere = ids.filter((id) => (holders.get(id) || 0) > 1 || (byId.get(id)?.ref || 0) > 1).length;
      const chain = h("span", { class: "chain", "aria-hidden": "true" });
      for (const id of ids) {
        const b = byId.get(id) || { id, state: "used", ref: 1 };
        chain.appendChild(this.cell(b, (holders.get(id) || 0) > 1));
      }
      const name = s.title || "Untitled";
      const open = h(
        "button",
        { type: "button", class: "chain-name", "aria-label": `${name}: ${ids.length} blocks, ${sharedHere} shared. Open this chat.` },
        h("span", { class: "chain-title" }, name),
        h("span", { class: "chain-count" }, `${ids.length} blk · ${sharedHere} shared`)
      );
      open.addEventListener("click", () => this.onOpenSession(s.id));
      return h(
        "li",
        { class: `chain-row${s.id === current ? " is-current" : ""}`, dataset: { session: s.id } },
        open,
        chain
      );
    });
    this.chains.replaceChildren(...(rows.length ? rows : [h("li", { class: "cache-note" }, "No session holds blocks yet.")]));

    // pool
    const sorted = [...blocks].sort((a, b) => a.id - b.id);
    const frag = document.createDocumentFragment();
    for (const b of sorted) frag.appendChild(this.cell(b, Array.isArray(b.sessions) && b.sessions.length > 1));
    this.grid.replaceChildren(frag);
    this.grid.setAttribute(
      "aria-label",
      `${blocks.length} blocks in use or cached, ${shared} of them referenced more than once`
    );
    this.freeNote.textContent = free ? `+ ${fmtInt(free)} free blocks not drawn` : "";
    this.applyHighlight();
  }

  cell(b, multiSession) {
    const ref = b.ref || 0;
    const n = Array.isArray(b.sessions) ? b.sessions.length : 0;
    const cls = ["cell", `state-${b.state || "used"}`];
    if (ref > 1 || multiSession) cls.push("shared");
    return h("span", {
      class: cls.join(" "),
      dataset: { block: String(b.id), sessions: Array.isArray(b.sessions) ? b.sessions.join(" ") : "" },
      title: `block ${b.id} · ${b.state} · ref ${ref}${n ? ` · ${n} session${n > 1 ? "s" : ""}` : ""}`,
    });
  }

  setHover(hover) {
    this.hover = hover;
    this.applyHighlight();
  }

  applyHighlight() {
    const d = this.data;
    if (!d) return;
    const sessions = Array.isArray(d.sessions) ? d.sessions : [];
    const blocks = Array.isArray(d.blocks) ? d.blocks : [];
    let sessionIds = null;
    let blockIds = null;
    const focus = this.hover || (this.getCurrentId() ? { kind: "session", id: this.getCurrentId() } : null);
    if (focus && focus.kind === "session") {
      const s = sessions.find((x) => x.id === focus.id);
      if (s) {
        sessionIds = new Set([s.id]);
        blockIds = new Set(blockIdsOf(s, blocks));
      }
    } else if (focus && focus.kind === "block") {
      blockIds = new Set([focus.id]);
      sessionIds = new Set(sessions.filter((s) => blockIdsOf(s, blocks).includes(focus.id)).map((s) => s.id));
    }
    const active = !!blockIds && !!this.hover;
    this.root.classList.toggle("has-focus", active);
    for (const cell of this.root.querySelectorAll(".cell[data-block]")) {
      cell.classList.toggle("hl", !!blockIds && blockIds.has(Number(cell.dataset.block)));
    }
    for (const row of this.chains.querySelectorAll("[data-session]")) {
      row.classList.toggle("hl", !!sessionIds && sessionIds.has(row.dataset.session));
    }
  }
}
