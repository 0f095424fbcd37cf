// Export a conversation (Markdown, JSON) and read a JSON export back for
// POST /v1/sessions/import. The export is built from GET /v1/sessions/{id}, the server's record.

export const EXPORT_FORMAT = "chatcore.chat";

/** The JSON export of a session detail (GET /v1/sessions/{id}). */
export function exportJSON(detail, now = new Date()) {
  return {
    format: EXPORT_FORMAT,
    version: 1,
    exported_at: now.toISOString(),
    id: detail.id,
    title: detail.title || "",
    system_prompt: detail.system_prompt ?? null,
    messages: (detail.history || []).map((m) => {
      const out = { role: m.role, content: m.content || "" };
      if (m.role === "assistant") {
        out.finish_reason = m.finish_reason ?? null;
        if (m.usage) out.usage = m.usage;
        if (m.timing) out.timing = m.timing;
      }
      return out;
    }),
  };
}

/** The Markdown export: a title, the system prompt as a quote, then each message under a heading. */
export function exportMarkdown(detail) {
  const lines = [`# ${detail.title || "Untitled chat"}`, ""];
  if (detail.system_prompt) {
    lines.push("**System prompt**", "", ...detail.system_prompt.split("\n").map((l) => `> ${l}`), "");
  }
  for (const m of detail.history || []) {
    lines.push(m.role === "user" ? "## You" : "## Assistant", "", m.content || "", "");
    if (m.role === "assistant" && m.finish_reason && m.finish_reason !== "stop") lines.push(`*(finish: ${m.finish_reason})*`, "");
  }
  return `${lines.join("\n").trimEnd()}\n`;
}

/** The body of POST /v1/sessions/import from a parsed JSON export; throws an Error saying what is wrong.
 * Only whole exchanges are kept: a question without an answer, or whose answer failed, is left out. */
export function importBody(data) {
  if (!data || typeof data !== "object" || !Array.isArray(data.messages)) {
    throw new Error("This is not a chat export: it has no \"messages\" list.");
  }
  const messages = [];
  const list = data.messages;
  for (let i = 0; i < list.length; i++) {
    const m = list[i];
    if (!m || typeof m !== "object" || typeof m.content !== "string") throw new Error(`Message ${i + 1} has no text.`);
    if (m.role === "system") continue;
    if (m.role !== "user") continue; // an answer without its question
    const a = list[i + 1];
    if (a && a.role === "assistant" && typeof a.content === "string" && a.finish_reason !== "error") {
      messages.push({ role: "user", content: m.content }, { role: "assistant", content: a.content });
      i += 1;
    }
  }
  if (!messages.length) throw new Error("The file holds no complete exchange (a question and its answer).");
  const system = typeof data.system_prompt === "string" ? data.system_prompt : list.find((m) => m && m.role === "system")?.content;
  const body = { messages };
  if (typeof data.title === "string" && data.title.trim()) body.title = data.title.trim().slice(0, 200);
  if (typeof system === "string" && system) body.system_prompt = system;
  return body;
}

/** A file name for `title` with `ext`. */
export function fileName(title, ext) {
  const slug = String(title || "chat").normalize("NFKD").replace(/[^\w\s-]/g, "").trim().replace(/[\s_]+/g, "-").toLowerCase().slice(0, 60);
  return `${slug || "chat"}.${ext}`;
}

/** Save `text` as a download named `name`. */
export function download(name, mime, text) {
  const url = URL.createObjectURL(new Blob([text], { type: mime }));
  const a = document.createElement("a");
  a.href = url;
  a.download = name;
  a.hidden = true;
  document.body.appendChild(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}
