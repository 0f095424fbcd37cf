// Loaded synchronously in <head> (a file, as the CSP allows no inline script): applies the saved
// theme before the first paint, so a page set to light or dark never flashes the other one.
// No saved choice (or "system"): no attribute, and style.css follows prefers-color-scheme.
(function () {
  try {
    var theme = JSON.parse(localStorage.getItem("chatcore.settings") || "{}").theme;
    if (theme === "light" || theme === "dark") document.documentElement.setAttribute("data-theme", theme);
  } catch (e) {
    /* storage disabled: follow the system */
  }
})();
