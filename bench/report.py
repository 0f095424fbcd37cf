"""The Markdown table of a results.json, and README's Performance section made from it.

    python -m chatcore.bench.report [--results bench/results/results.json] [--readme README.md] [--docs docs/bench]

With --readme, the table replaces what lies between the `<!-- bench:begin -->` and
`<!-- bench:end -->` markers of README's Performance section, and the plots are copied to
--docs (committed copies: bench/results/ is git-ignored).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(data: dict[str, Any]) -> str:
    lines = _preamble(data.get("machine", {})) + _targets_table(data.get("targets", []))
    suites = data.get("suites", {})
    lines += _single_table(suites.get("single", {}))
    lines += _throughput_table(suites.get("throughput", {}))
    lines += _sessions_table(suites.get("sessions", {}))
    lines += _measured_elsewhere(data.get("cpu"), suites)
    for name, s in suites.items():
        if s.get("error"):
            lines.append(f"\nSuite {name} failed: {s['error']}")
    return "\n".join(lines) + "\n"


def _measured_elsewhere(cpu: dict[str, Any] | None, suites: dict[str, Any]) -> list[str]:
    """A line for each suite, kept from an earlier run, that was measured on another CPU than the header's."""
    lines = []
    for name, s in suites.items():
        theirs = s.get("measured_on", {}).get("cpu")
        if cpu and theirs and theirs != cpu:
            lines.append(f"\nSuite {name} was measured on another CPU: {theirs['model']} "
                         f"({', '.join(theirs['flags']) or 'none of the flags above'}), {theirs['threads']} threads.")
    return lines


def _preamble(machine: dict[str, Any]) -> list[str]:
    """The machine and the run's mode, and the targets table's header."""
    mode = "tiny" if machine.get("tiny") else "quick" if machine.get("quick") else "full"
    flags = ", ".join(machine.get("cpu_flags") or []) or "none of avx2, avx512f, avx512_bf16, amx_bf16"
    return [
        f"Measured on {machine.get('cpu', '?')} ({flags}), {machine.get('cores', '?')} cores, "
        f"{machine.get('threads', '?')} torch threads, torch {machine.get('torch', '?')}, transformers "
        f"{machine.get('transformers', '?')}, {machine.get('dtype', '?')}, {machine.get('weights', 'full')} weights, "
        f"block size {machine.get('block_size', '?')} ({mode} run). Medians of repeats; every baseline was measured "
        "in the same run.",
        "",
        "| suite | target | measured | goal | |",
        "|---|---|---|---|---|",
    ]


def _targets_table(targets: list[dict[str, Any]]) -> list[str]:
    lines = []
    for t in targets:
        goal = "" if t["met"] is None else f"{t['op']} {_num(t['threshold'])}"
        verdict = t.get("verdict") or ("reported" if t["met"] is None else "met" if t["met"] else "missed")
        verdict = verdict if verdict in ("met", "reported") else f"**{verdict}**"
        lines.append(f"| {t['suite']} | {t['name']} | {_num(t['value'])} | {goal} | {verdict} |")
    return lines


THROUGHPUT_SYSTEMS = {"chatcore": "chatcore (in-process engine), prefix sharing",
                      "chatcore_no_sharing": "chatcore, each request in its own cache scope (no sharing)",
                      "hf_sequential": "transformers `generate`, one at a time",
                      "hf_static": "transformers static batched `generate` (static cache)",
                      "hf_generate_batch": "transformers `generate_batch` (CB, sharing)"}


def _throughput_table(suite: dict[str, Any]) -> list[str]:
    thr = suite.get("systems")
    if not thr:
        return []
    lines = ["", ("| system (throughput suite) | output tok/s | mean TTFT from arrival (s) | decode tok/s | "
                  "prompt tokens from its prefix cache |"), "|---|---|---|---|---|"]
    for key, label in THROUGHPUT_SYSTEMS.items():
        s = thr.get(key, {})
        cached = _num(s["cached_tokens"]) if key in ("chatcore", "chatcore_no_sharing", "hf_generate_batch") \
            and "cached_tokens" in s else "n/a"
        lines.append(f"| {label} | {_num(s.get('tok_s'))} | {_num(s.get('ttft_mean_s'))} | "
                     f"{_num(s.get('decode_tok_s'))} | {cached} |")
    share = suite.get("shared_fraction")
    if share is not None:
        lines.append(f"\nWorkload: {len(suite.get('prompt_tokens', []))} chats; "
                     f"{_num(share * 100)}% of each prompt is a shared prefix "
                     f"({suite.get('shared_prefix_tokens')} tokens).")
    return lines + _decode_limit(suite.get("limit", {}), thr) + _efficiency(suite.get("efficiency", {}))


def _decode_limit(lim: dict[str, Any], thr: dict[str, Any]) -> list[str]:
    """chatcore's full-batch decode against the streaming-GEMM bound and a cached GEMM of the step's shape."""
    if "streaming_gemm_ceiling_tok_s" not in lim:
        return []
    return ["", f"Decode efficiency: chatcore's full-batch decode ({_num(thr['chatcore'].get('decode_tok_s'))} "
                f"tok/s) reaches {_num(lim['chatcore_decode_fraction_of_streaming'] * 100)}% of the "
                f"{_num(lim['streaming_gemm_ceiling_tok_s'])} tok/s that one step's matmuls allow with the "
                f"weights streaming from memory ({_num(lim['streaming_gemm_step_ms'])} ms per step), the "
                f"bound for this batch; and {_num(lim.get('chatcore_decode_fraction', 0) * 100)}% of a GEMM "
                f"of the step's shape with its weights in cache "
                f"({_num(lim.get('gemm_flops', 0) / 1e9)} GFLOP/s at "
                f"{'x'.join(str(d) for d in lim.get('gemm_shape', []))})."]


def _efficiency(efficiency: dict[str, Any]) -> list[str]:
    """The decode step and prefill chunk against the chain of the model's linears (the efficiency run)."""
    eff = efficiency.get("summary")
    if not eff:
        return []
    chunk = efficiency.get("chunk_tokens")
    parts = ", ".join(f"{k} {_num(eff['breakdown_ms'][k])} ms ({_num(v * 100)}%)"
                      for k, v in eff["breakdown_share"].items())
    return ["", f"Efficiency ({efficiency['sizes']['requests']} chats decoding, sharing on): a step takes "
                f"{_num(eff['decode_step_ms'])} ms, {_num(eff['decode_ratio'])}x the "
                f"{_num(eff['chain_decode_ms'])} ms chain of the model's "
                f"{efficiency.get('chain_linears')} linears as torch.mm at the same rows. "
                f"Profiled, {_num(eff['profiled_step_ms'])} ms: {parts}; everything but the linears "
                f"{_num(eff['non_linear_over_linears'])}x the linears. Prefill in {chunk}-token "
                f"chunks: {_num(eff['prefill_tok_s'])} tok/s, {_num(eff['prefill_fraction'] * 100)}% of the "
                f"chain's {_num(eff['chain_tok_s'])} tok/s at {chunk} rows (the table above judges all three)."]


SINGLE_SYSTEMS = {"chatcore": "chatcore (in-process engine)",
                  "hf_static": "transformers `generate`, static cache",
                  "hf_static_compiled": "transformers `generate`, static cache, compiled",
                  "llama_server": "llama.cpp `llama-server`",
                  "llama_cpp": "llama.cpp (`llama-cpp-python`, in process)"}


def _single_table(suite: dict[str, Any]) -> list[str]:
    systems = suite.get("systems")
    if not systems:
        return []
    lines = ["", "| system (single suite: one chat) | decode tok/s | ITL p50 / p99 (ms) | TTFT (ms) | "
             "share of the memory bound | weights, dtype |", "|---|---|---|---|---|---|"]
    bound = suite.get("memory_bound_tok_s") or float("nan")
    for key, label in SINGLE_SYSTEMS.items():
        s = systems.get(key, {})
        if "decode_tok_s" not in s:
            why = s.get("skipped") or s.get("compile", {}).get("error") or "not measured"
            lines.append(f"| {label} | n/a: {why} | | | | |")
            continue
        ttft = _num(s["ttft_s"] * 1e3) if s.get("ttft_s") is not None else "n/a"
        if key == "chatcore":
            ttft = f"{ttft} cold, {_num(systems.get('chatcore_warm', {}).get('ttft_s', float('nan')) * 1e3)} warm"
        lines.append(f"| {label} | {_num(s['decode_tok_s'])} | {_num(s.get('itl_p50_ms'))} / "
                     f"{_num(s.get('itl_p99_ms'))} | {ttft} | {_share(key, s['decode_tok_s'], bound)} | "
                     f"{s.get('weights', '?')}, {s.get('dtype', '?')} |")
    memory = suite.get("memory", {})
    warm = suite.get("systems", {}).get("chatcore_warm", {})
    lines.append(f"\nOne chat: {suite.get('prompt_tokens')} prompt tokens, {suite.get('sizes', {}).get('new_tokens')} "
                 f"new tokens, {suite.get('dtype')}, {suite.get('weights')} weights. Memory bound "
                 f"{_num(bound)} tok/s: {_num(memory.get('weight_bytes_read', 0) / 1e6)} MB of weights read per token "
                 f"at {_num(memory.get('copy_bandwidth_bytes_s', 0) / 1e9)} GB/s (a copy, bytes read + written). "
                 f"The warm turn: {_num(warm.get('prompt_tokens'))} prompt tokens, "
                 f"{_num(warm.get('cached_tokens'))} from the prefix cache.")
    if suite.get("decode_over_llama_cpp") is not None:
        peer = systems["llama_cpp"]
        lines.append(f"chatcore decodes {_num(suite['decode_over_llama_cpp'])}x as fast as llama.cpp "
                     f"{peer.get('version', '')} on {peer.get('weights')} blocks of the same GGUF at the same threads "
                     f"(llama.cpp's own counters: {_num(peer.get('own_decode_tok_s'))} tok/s).")
    return lines


GGUF_SYSTEMS = ("llama_server", "llama_cpp")


def _share(key: str, decode: float, bound: float) -> str:
    """A system's decode over the memory bound of chatcore's weights; llama.cpp reads the GGUF's bytes
    per token, another bound, so its share of this one is not shown."""
    return "n/a: reads the GGUF's bytes" if key in GGUF_SYSTEMS else _num(decode / bound)


def _sessions_table(suite: dict[str, Any]) -> list[str]:
    runs = suite.get("runs")
    if not runs:
        return []
    policies = ("lru", "cost", "session", "belady", "one_slot")
    lines = ["", "| sessions run | tiers (device / disk blocks) | final-turn TTFT median (ms) | hot (ms) | / hot | "
             "cold (ms) | / cold | from disk: turns, / hot | replay hit rate: " + " / ".join(policies) + " |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        hits = r["replay"]["policies"]
        lines.append(f"| {name} ({r['sessions']} x {r['turns']}) | {_num(r['device_blocks'])} / "
                     f"{_num(r['disk_blocks'])} | {_num(r['per_turn'][-1]['ttft_median_ms'])} | "
                     f"{_num(r.get('hot', {}).get('ttft_ms'))} | {_num(r.get('final_over_hot'))} | "
                     f"{_num(r['cold']['ttft_ms'])} | {_num(r['final_over_cold'])} | {r['disk_final']['turns']}, "
                     f"{_num(r['disk_final'].get('over_hot'))} | "
                     + " / ".join(f"{hits[p]['hit_rate']:.1%}" if p in hits else "n/a" for p in policies) + " |")
    for name, r in runs.items():
        lines += ["", f"Run {name}, per turn (means of tokens over its sessions; TTFT from the server's `done` frames):",
                  "", "| turn | prompt | cached in the pool | read from disk | recomputed | TTFT median (ms) | p90 (ms) |",
                  "|---|---|---|---|---|---|---|"]
        for t in r["per_turn"]:
            lines.append(f"| {t['turn']} | {t['mean_prompt_tokens']:.0f} | {t['mean_cached_device_tokens']:.0f} | "
                         f"{t['mean_cached_disk_tokens']:.0f} | {t['mean_recomputed_tokens']:.0f} | "
                         f"{_num(t['ttft_median_ms'])} | {_num(t['ttft_p90_ms'])} |")
        if "hot" in r:  # results of runs before the hot baseline have none
            lines.append(f"| hot, the final turn of sessions alone on the server | | | | | {_num(r['hot']['ttft_ms'])} | |")
        lines.append(f"| cold, a fresh session of the final turn's length | | | | | {_num(r['cold']['ttft_ms'])} | |")
    return lines


def update_readme(readme: Path, table: str, plots: list[str]) -> None:
    text = readme.read_text()
    images = "\n".join(f"![{Path(p).stem}]({p})" for p in plots)
    block = f"{BEGIN}\n{table}\n{images}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} markers")
    readme.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="bench/results/results.json")
    parser.add_argument("--readme", default=None)
    parser.add_argument("--docs", default="docs/bench")
    args = parser.parse_args()
    results = Path(args.results)
    data = json.loads(results.read_text())
    table = markdown_table(data)
    print(table)
    if args.readme:
        docs = Path(args.docs)
        docs.mkdir(parents=True, exist_ok=True)
        copied = []
        for suite in data.get("suites", {}).values():
            for plot in suite.get("plots", []):
                src = results.parent / Path(plot).name
                if src.exists():
                    shutil.copy(src, docs / src.name)
                    copied.append(f"{docs.as_posix()}/{src.name}")
        shutil.copy(results, docs / "results.json")
        update_readme(Path(args.readme), table, copied)


if __name__ == "__main__":
    main()
