// The colour theme: "system" (follow prefers-color-scheme), "light" or "dark", kept in
// settings.theme and applied as <html data-theme> (theme-boot.js applies it before the first paint).

const media = window.matchMedia("(prefers-color-scheme: dark)");

export function applyTheme(theme) {
  const root = document.documentElement;
  if (theme === "light" || theme === "dark") root.dataset.theme = theme;
  else delete root.dataset.theme;
}

/** The theme on screen now: "light" or "dark". */
export function effectiveTheme(theme) {
  if (theme === "light" || theme === "dark") return theme;
  return media.matches ? "dark" : "light";
}

/** Call `fn` when the system's preference changes (it matters while the theme is "system"). */
export function onSystemThemeChange(fn) {
  media.addEventListener("change", fn);
}
