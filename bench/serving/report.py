"""report.md with the tables, and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

Row = dict[str, Any]

PLOTS = ("speedup.png", "acceptance_per_position.png", "latency.png")
_MODE_COLORS = {
    "spec": "tab:orange", "plain": "tab:blue", "llamacpp": "tab:green",
    "llama-server": "tab:green", "llama-server-draft": "tab:olive", "llama-server-ngram": "tab:cyan",
}  # fmt: skip
PEER_LABELS = {
    "llamacpp": "llama.cpp",
    "llama-server": "llama-server",
    "llama-server-draft": "llama-server draft",
    "llama-server-ngram": "llama-server ngram-mod",
}
MACHINE_KEYS = ("cpu", "cores", "cpu_flags", "llamacpp_build")  # meta keys of the Machine block
_PEER_NOTE = (
    "Decode tokens/s per request, the first token excluded, median over repeats; in brackets the "
    "ratio to {label} within each repeat. Its prompts are not primed (specserve's are), so its "
    "TTFT may pay the prefill."
)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f}"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def _order(rows: list[Row]) -> tuple[list[str], list[str]]:
    categories = list(dict.fromkeys(r["category"] for r in rows))
    loads = list(dict.fromkeys(r["load"] for r in rows))
    return categories, loads


def speedup_table(rows: list[Row]) -> list[str]:
    """Median speedup per cell; with several repeats, their range in brackets."""
    categories, loads = _order(rows)
    spec = {(r["category"], r["load"]): r for r in rows if r["mode"] == "spec"}
    body = [[c] + [_speedup_cell(spec.get((c, load), {})) for load in loads] for c in categories]
    return _table(["category", *loads], body)


def _speedup_cell(row: Row) -> str:
    cell = _fmt(row.get("speedup_vs_plain")) + "x"
    each = [v for v in row.get("speedup_vs_plain_per_repeat") or [] if v is not None]
    return cell + (f" ({min(each):.2f}-{max(each):.2f})" if len(each) > 1 else "")


def category_table(rows: list[Row], category: str) -> list[str]:
    header = [
        "load", "mode", "out tok/s", "speedup", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
        "E2E p50/p90/p99 s", "accept rate", "mean accept len", "grammar-forced share",
        "requests (errors)",
    ]  # fmt: skip
    body = []
    for r in (r for r in rows if r["category"] == category):
        body.append([
            r["load"], r["mode"], _fmt(r["output_tokens_per_s"]), _fmt(r["speedup_vs_plain"]),
            "/".join(_ms(r.get(f"ttft_p{p}_s")) for p in (50, 90, 99)),
            "/".join(_ms(r.get(f"itl_p{p}_s")) for p in (50, 90, 99)),
            "/".join(_fmt(r.get(f"e2e_p{p}_s")) for p in (50, 90, 99)),
            _fmt(r["acceptance_rate"]), _fmt(r["mean_acceptance_length"]),
            _fmt(r.get("grammar_forced_share")),
            f"{_fmt(r['num_requests'])} ({_fmt(r['num_errors'])})",
        ])  # fmt: skip
    return _table(header, body)


def position_table(rows: list[Row]) -> list[str]:
    spec = [r for r in rows if r["mode"] == "spec" and r.get("acceptance_per_pos")]
    if not spec:
        return ["(no per-position counts: the server's /metrics had none)"]
    width = max(len(r["acceptance_per_pos"]) for r in spec)
    body = [
        [r["category"], r["load"]]
        + [_fmt(v) for v in r["acceptance_per_pos"]]
        + [""] * (width - len(r["acceptance_per_pos"]))
        for r in spec
    ]
    return _table(["category", "load", *[f"pos {i + 1}" for i in range(width)]], body)


def peer_table(peers: list[Row]) -> list[str]:
    header = [
        "category", "mode", "out tok/s", "speedup vs hf", "vs specserve plain",
        "TTFT p50 ms", "ITL p50 ms", "E2E p50 s",
    ]  # fmt: skip
    body = [
        [
            r["category"], r["mode"], _fmt(r["output_tokens_per_s"]), _fmt(r["speedup_vs_plain"]),
            _fmt(r.get("ratio_vs_server_plain")), _ms(r["ttft_p50_s"]), _ms(r["itl_p50_s"]),
            _fmt(r["e2e_p50_s"]),
        ]
        for r in peers
    ]  # fmt: skip
    return _table(header, body)


def peer_comparison_table(rows: list[Row], peer: str) -> list[str]:
    """Per category at c=1: the peer's plain decoding beside specserve's two modes, each with its
    ratio to the peer. Empty when the peer did not run."""
    at_c1 = {(r["category"], r["mode"]): r for r in rows if r["load"] == "c=1"}
    categories = [c for c in _order(rows)[0] if (c, peer) in at_c1]
    if not categories:
        return []
    label = PEER_LABELS.get(peer, peer)
    header = [
        "category", f"{label} tok/s", "specserve plain tok/s", "specserve spec tok/s",
        f"TTFT p50 ms ({label} / plain / spec)", f"E2E tok/s ({label} / plain / spec)",
    ]  # fmt: skip
    body = []
    for c in categories:
        p_row, plain, spec = (at_c1.get((c, m), {}) for m in (peer, "plain", "spec"))
        body.append([
            c, _fmt(p_row.get("decode_tokens_per_s")),
            _vs_peer(plain, peer), _vs_peer(spec, peer),
            " / ".join(_ms(r.get("ttft_p50_s")) for r in (p_row, plain, spec)),
            " / ".join(_fmt(r.get("output_tokens_per_s")) for r in (p_row, plain, spec)),
        ])  # fmt: skip
    return _table(header, body)


def _vs_peer(row: Row, peer: str) -> str:
    ratio = row.get(f"ratio_vs_{peer}")
    tps = _fmt(row.get("decode_tokens_per_s"))
    return tps if ratio is None else f"{tps} ({ratio:.2f}x)"


def machine_lines(meta: dict[str, Any]) -> list[str]:
    return ["", "## Machine", ""] + [f"- {k}: `{meta[k]}`" for k in MACHINE_KEYS if meta.get(k)]


def write_report(path: Path, rows: list[Row], peers: list[Row], meta: dict[str, Any]) -> None:
    lines = ["# specserve bench", ""]
    lines += [f"- {k}: `{v}`" for k, v in meta.items() if k not in MACHINE_KEYS]
    lines += machine_lines(meta)
    peer = next((r["mode"] for r in rows if r["mode"] in PEER_LABELS), None)
    comparison = peer_comparison_table(rows, peer) if peer else []
    if peer and comparison:
        label = PEER_LABELS[peer]
        lines += ["", f"## specserve vs {label} (same GGUF file, concurrency 1)", ""]
        lines += [_PEER_NOTE.format(label=label), ""] + comparison
    title = "Speedup (speculative tokens/s over plain tokens/s, same prompts)"
    if meta.get("control"):
        title = "A/A control (both modes decode plainly: the ratio is the host's noise)"
    lines += [
        "",
        f"## {title}",
        "",
        "Median over repeats; with several, their range in brackets.",
        "",
    ]
    lines += speedup_table(rows)
    for category in _order(rows)[0]:
        lines += ["", f"## {category}", ""] + category_table(rows, category)
    lines += ["", "## Acceptance by draft position (spec mode)", ""] + position_table(rows)
    if peers:
        lines += ["", "## Peers: transformers generate, concurrency 1", ""] + peer_table(peers)
    lines += ["", "## Plots", ""] + [f"![{p[:-4]}]({p})" for p in PLOTS]
    path.write_text("\n".join(lines) + "\n")


# ---------------------------------------------------------------- plots


def write_plots(out: Path, rows: list[Row], peers: list[Row], requests: list[Row]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    paths = [out / name for name in PLOTS]
    plot_speedup(paths[0], rows, peers)
    plot_acceptance(paths[1], rows)
    plot_latency(paths[2], requests)
    return paths


def plot_speedup(path: Path, rows: list[Row], peers: list[Row]) -> None:
    import matplotlib.pyplot as plt

    categories, loads = _order(rows)
    spec = {(r["category"], r["load"]): r["speedup_vs_plain"] for r in rows if r["mode"] == "spec"}
    series = [(f"specserve {load}", [spec.get((c, load)) for c in categories]) for load in loads]
    for mode in dict.fromkeys(r["mode"] for r in peers if r["mode"] != "hf"):
        by_cat = {r["category"]: r["speedup_vs_plain"] for r in peers if r["mode"] == mode}
        series.append((f"{mode} (vs hf)", [by_cat.get(c) for c in categories]))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(categories) * max(1, len(series)) / 2), 4))
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(categories))]
        ax.bar(xs, [v or 0.0 for v in values], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("speedup over plain decoding (tokens/s ratio)")
    ax.set_title("Speculative speedup by category and load")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_acceptance(path: Path, rows: list[Row]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    spec = [r for r in rows if r["mode"] == "spec" and r.get("acceptance_per_pos")]
    for r in spec:
        values = r["acceptance_per_pos"]
        ax.plot(range(1, len(values) + 1), values, marker="o", label=f"{r['category']} {r['load']}")
    if not spec:
        ax.text(0.5, 0.5, "no per-position counts in /metrics", ha="center", transform=ax.transAxes)
    width = max((len(r["acceptance_per_pos"]) for r in spec), default=1)
    ax.set_xticks(range(1, width + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of drafts accepted at this position")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    if spec:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def latency_groups(requests: list[Row]) -> dict[tuple[str, str, str], dict[str, list[float]]]:
    """Samples of TTFT, ITL and E2E per (category, load, mode), from the request records."""
    groups: dict[tuple[str, str, str], dict[str, list[float]]] = defaultdict(
        lambda: {"ttft_s": [], "itl_s": [], "e2e_s": []}
    )
    for req in requests:
        if not req.get("ok"):
            continue
        g = groups[(req["category"], req["load"], req["mode"])]
        for metric in ("ttft_s", "e2e_s"):
            if req.get(metric) is not None:
                g[metric].append(req[metric])
        g["itl_s"].extend(req.get("itl_s") or [])
    return groups


def plot_latency(path: Path, requests: list[Row]) -> None:
    import matplotlib.pyplot as plt

    groups = latency_groups(requests)
    keys = list(groups)
    fig, axes = plt.subplots(3, 1, figsize=(max(6, 0.6 * len(keys) + 2), 9))
    for ax, metric, title in zip(
        axes, ("ttft_s", "itl_s", "e2e_s"), ("TTFT", "ITL", "E2E"), strict=True
    ):
        data = [groups[k][metric] or [0.0] for k in keys]
        boxes = ax.boxplot(
            data, showfliers=False, patch_artist=True, medianprops={"color": "black"}
        )
        for box, key in zip(boxes["boxes"], keys, strict=True):
            box.set_facecolor(_MODE_COLORS.get(key[2], "lightgrey"))
        ax.set_xticks(range(1, len(keys) + 1), ["\n".join(k) for k in keys], fontsize=7)
        ax.set_ylabel(f"{title} (s)")
    axes[0].set_title("Latency distributions by category, load and mode")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
