// One row of the session list: open, rename (inline), delete (inline confirmation).
// Pure DOM building; the page (app.js) owns the state and passes callbacks.

import { h, icon, relativeTime } from "./ui.js";

/**
 * @param {{id, title, state, turns, last_active_at}} s  a row of GET /v1/sessions
 * @param {{active: boolean, running: boolean, mode: null|"rename"|"delete"}} view
 * @param {{open, startRename, rename, cancel, startDelete, confirmDelete}} on  callbacks
 */
export function renderSessionItem(s, view, on) {
  const title = s.title || "Untitled chat";
  const li = h("li", {
    class: `session-item${view.active ? " is-active" : ""}${view.running ? " is-running" : ""}`,
    "data-testid": "session-item",
    dataset: { sessionId: s.id },
  });

  if (view.mode === "rename") {
    const input = h("input", { type: "text", class: "rename-input", value: s.title || "", "aria-label": "Chat title", maxlength: "200" });
    let settled = false;
    const finish = (save) => {
      if (settled) return;
      settled = true;
      if (save) on.rename(input.value.trim());
      else on.cancel();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") {
        e.preventDefault();
        finish(true);
      } else if (e.key === "Escape") {
        e.preventDefault();
        finish(false);
      }
    });
    input.addEventListener("blur", () => finish(true));
    li.append(input);
    queueMicrotask(() => {
      input.focus();
      input.select();
    });
    return li;
  }

  const state = s.state || "hot";
  const meta = [typeof s.turns === "number" ? `${s.turns} turn${s.turns === 1 ? "" : "s"}` : null, relativeTime(s.last_active_at)];
  const open = h(
    "button",
    { type: "button", class: "session-open", "aria-current": view.active ? "page" : null },
    h("span", { class: "session-title", title }, title),
    h(
      "span",
      { class: "session-meta" },
      h("span", { class: `state-badge state-${state}`, title: `Session state: ${state}` }, state),
      meta.filter(Boolean).join(" · ")
    )
  );
  open.addEventListener("click", on.open);

  if (view.mode === "delete") {
    const yes = h("button", { type: "button", class: "btn btn-danger btn-small" }, "Delete");
    const no = h("button", { type: "button", class: "btn btn-small" }, "Cancel");
    yes.addEventListener("click", on.confirmDelete);
    no.addEventListener("click", on.cancel);
    li.append(
      h("div", { class: "confirm", role: "group", "aria-label": `Delete “${title}”?` }, h("span", {}, "Delete this chat?"), yes, no)
    );
    queueMicrotask(() => no.focus());
    return li;
  }

  const rename = h("button", { type: "button", class: "icon-btn small", "aria-label": `Rename “${title}”`, title: "Rename" }, icon("edit"));
  rename.addEventListener("click", on.startRename);
  const del = h("button", { type: "button", class: "icon-btn small", "aria-label": `Delete “${title}”`, title: "Delete" }, icon("trash"));
  del.addEventListener("click", on.startDelete);
  li.append(open, h("div", { class: "session-actions" }, rename, del));
  return li;
}
