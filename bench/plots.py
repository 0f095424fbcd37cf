"""PNG plots of each suite's results (matplotlib, no display needed).

matplotlib is a development dependency and the wheel ships this module, so it is imported only
when a plot is drawn (`_pyplot`); `chatcore bench` checks `available()` first and says plots need it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MISSING = ("plots need matplotlib, a development dependency (pip install matplotlib); results.json and table.md "
           "are written without them")

LABELS = {"chatcore": "chatcore", "hf_sequential": "HF generate\n(one at a time)", "hf_static": "HF static batch",
          "hf_generate_batch": "HF generate_batch\n(CB, sharing)"}


def available() -> bool:
    """Whether matplotlib imports here, so that `plot` can draw."""
    try:
        _pyplot()
    except ImportError:
        return False
    return True


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed), imported at the first plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: Path, name: str) -> str:
    path = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path.name


def plot(suite: str, result: dict[str, Any], out: Path) -> list[str]:
    if result.get("error"):
        return []
    fn = globals().get(f"_plot_{suite}")
    return fn(result, out) if fn else []


def _plot_single(r: dict[str, Any], out: Path) -> list[str]:
    names = {"chatcore": "chatcore", "hf_static": "HF static\ncache", "hf_static_compiled": "HF static\ncompiled",
             "llama_server": "llama-server", "llama_cpp": "llama.cpp\n(binding)"}
    systems = [k for k in names if r["systems"].get(k, {}).get("decode_tok_s")]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar([names[k] for k in systems], [r["systems"][k]["decode_tok_s"] for k in systems],
           color=["tab:green" if k == "chatcore" else "tab:gray" for k in systems])
    bound = r["memory_bound_tok_s"]
    ax.axhline(bound, color="tab:red", linestyle="--", label=f"memory bound {bound:.0f} tok/s")
    ax.axhline(0.7 * bound, color="tab:red", linestyle=":", label="70% of it (target)")
    ax.set_ylabel("decode tokens/s, one chat")
    ax.set_title(f"one chat, {r['sizes']['new_tokens']} tokens, {r['dtype']}, {r['weights']} weights")
    ax.legend(fontsize=8)
    return [_save(fig, out, "single")]


def _plot_throughput(r: dict[str, Any], out: Path) -> list[str]:
    systems = [k for k in LABELS if r["systems"].get(k, {}).get("tok_s") is not None]
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    tps = [r["systems"][k]["tok_s"] for k in systems]
    ttft = [r["systems"][k]["ttft_mean_s"] for k in systems]
    colors = ["tab:green" if k == "chatcore" else "tab:gray" for k in systems]
    a.bar([LABELS[k] for k in systems], tps, color=colors)
    a.set_ylabel("output tokens/s")
    a.set_title(f"{r['sizes']['requests']} concurrent requests, {r['sizes']['new_tokens']} tokens each")
    b.bar([LABELS[k] for k in systems], ttft, color=colors)
    b.set_ylabel("mean TTFT from arrival (s)")
    b.set_title("time to first token")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    return [_save(fig, out, "throughput")]


def _plot_multiturn(r: dict[str, Any], out: Path) -> list[str]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, style in (("chatcore", "chatcore (prefix cache)", "o-"),
                              ("chatcore_no_cache", "chatcore, prefix cache off", "s--"),
                              ("hf_generate", "transformers generate (full prompt)", "^:")):
        rows = [t for t in r["turns"] if t.get(f"{key}_ttft_ms") is not None]
        if rows:
            ax.plot([t["prompt_tokens"] for t in rows], [t[f"{key}_ttft_ms"] for t in rows], style, label=label)
    ax.set_xlabel("prompt tokens (history + new user message)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("TTFT per turn as the history grows")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return [_save(fig, out, "multiturn")]


def _plot_hitrate(r: dict[str, Any], out: Path) -> list[str]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fractions = [row["cache_fraction"] for row in r["rows"]]
    labels = {"lru": "LRU", "pool_cost": "pool's cost policy (leaves, then least branched, of 16 LRU; default)",
              "cost_aware": "GreedyDual over leaves, cost = tokens x sharers", "gd_flops": "GreedyDual, cost = FLOPs at depth"}
    for policy, style in (("lru", "o-"), ("pool_cost", "d-."), ("cost_aware", "s--"), ("gd_flops", "^:")):
        if policy in r["rows"][0]:
            ax.plot([f * 100 for f in fractions], [row[policy]["of_oracle"] * 100 for row in r["rows"]], style,
                    label=labels[policy])
    ax.set_xlabel("cache size (% of the working set)")
    ax.set_ylabel("token hit rate (% of the oracle's)")
    ax.set_title(f"prefix-cache hit rate on the trace (oracle: {r['oracle_hit_rate'] * 100:.1f}% of prompt tokens)",
                 fontsize=10)
    ax.invert_xaxis()
    ax.grid(True, alpha=0.3)
    ax.legend()
    return [_save(fig, out, "hitrate")]


def _plot_memory(r: dict[str, Any], out: Path) -> list[str]:
    schemes = list(r["schemes"])
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    bars = a.bar(schemes, [r["schemes"][s]["waste_pct"] for s in schemes], color=["tab:green", "tab:blue", "tab:gray"])
    a.bar_label(bars, fmt="%.2f%%")
    a.set_ylabel("KV waste (% of reserved slots empty)")
    a.set_yscale("log")
    bars = b.bar(schemes, [r["schemes"][s]["sessions_held"] for s in schemes], color=["tab:green", "tab:blue", "tab:gray"])
    b.bar_label(bars)
    b.set_ylabel(f"sessions held in {r['budget_tokens']:,} token slots")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    return [_save(fig, out, "memory")]


def _plot_sharing(r: dict[str, Any], out: Path) -> list[str]:
    cases = list(r["cases"])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(cases))
    ax.bar([i - 0.2 for i in x], [r["cases"][c]["shared_peak_blocks"] for c in cases], 0.4, label="shared (chatcore)",
           color="tab:green")
    ax.bar([i + 0.2 for i in x], [r["cases"][c]["unshared_peak_blocks"] for c in cases], 0.4,
           label="4 independent requests", color="tab:gray")
    ax.set_xticks(list(x), cases)
    ax.set_ylabel("peak KV blocks in use")
    ax.legend()
    return [_save(fig, out, "sharing")]


def _plot_resume(r: dict[str, Any], out: Path) -> list[str]:
    rows = r["rows"]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([x["history_tokens"] for x in rows], [x["disk_ttft_ms"] for x in rows], "o-", label="disk tier")
    ax.plot([x["history_tokens"] for x in rows], [x["recompute_ttft_ms"] for x in rows], "s--", label="recompute")
    ax.set_xlabel("history tokens")
    ax.set_ylabel("TTFT of the first turn after restart (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return [_save(fig, out, "resume")]


def _plot_server(r: dict[str, Any], out: Path) -> list[str]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    names = ["in-process engine", "WebSocket server"]
    ax.bar(names, [r["engine"]["tok_s"], r["server"]["tok_s"]], color=["tab:green", "tab:blue"])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{r['sessions']} concurrent sessions")
    return [_save(fig, out, "server")]


def _plot_sessions(r: dict[str, Any], out: Path) -> list[str]:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, run) in enumerate(r["runs"].items()):
        color = f"C{i}"
        turns = [t["turn"] for t in run["per_turn"]]
        ax.plot(turns, [t["ttft_median_ms"] for t in run["per_turn"]], "o-", color=color, label=f"{name}: median")
        ax.plot(turns, [t["ttft_p90_ms"] for t in run["per_turn"]], ":", color=color, label=f"{name}: p90")
        ax.axhline(run["cold"]["ttft_ms"], color=color, linestyle="--", alpha=0.6, label=f"{name}: cold, final length")
        if "hot" in run:  # results of runs before the hot baseline have none
            ax.axhline(run["hot"]["ttft_ms"], color=color, linestyle="-.", alpha=0.6, label=f"{name}: hot, final turn")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_xlabel("turn (all sessions round-robin)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title("TTFT per turn, sessions taking turns round-robin")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    return [_save(fig, out, "sessions")]
