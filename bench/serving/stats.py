"""From measured requests to result rows: percentiles per repeat, then medians over repeats.

speedup_vs_plain is a ratio taken inside each repeat, between the two modes' runs of the same
rounds (same prompts, same arrival schedule), and only then reduced to its median. So is
ratio_vs_<peer>: a mode's decode tokens/s over a peer's (llama.cpp) in the same repeat.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

import numpy as np

from bench.serving.client import RequestResult
from bench.serving.runner import MODES, Measurement, ModeRun

Row = dict[str, Any]
PCTS = (50, 90, 99)
_IDENTITY = ("category", "load", "concurrency", "request_rate", "mode")


def percentiles(values: list[float], prefix: str) -> dict[str, float | None]:
    if not values:
        return {f"{prefix}_p{p}_s": None for p in PCTS}
    arr = np.asarray(values, dtype=np.float64)
    return {f"{prefix}_p{p}_s": float(np.percentile(arr, p)) for p in PCTS}


def mode_figures(run: ModeRun) -> Row:
    """The figures of one mode in one repeat."""
    ok = [r for r in run.results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    row: Row = {
        "num_requests": len(run.results),
        "num_errors": len(run.results) - len(ok),
        "output_tokens": tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "duration_s": run.wall_s,
        "output_tokens_per_s": tokens / run.wall_s if run.wall_s > 0 else None,
        "request_throughput_per_s": len(ok) / run.wall_s if run.wall_s > 0 else None,
        "decode_tokens_per_s": decode_rate(ok),
    }
    row.update(percentiles([r.ttft_s for r in ok if r.ttft_s is not None], "ttft"))
    row.update(percentiles([gap for r in ok for gap in r.itl_s], "itl"))
    row.update(percentiles([r.e2e_s for r in ok if r.e2e_s is not None], "e2e"))
    row.update(percentiles([t for r in ok if (t := r.tpot_s) is not None], "tpot"))
    row.update(acceptance_figures(run))
    forced = run.counters.num_forced_tokens if run.counters is not None else 0.0
    row["grammar_forced_share"] = forced / tokens if tokens and forced else None
    return row


def decode_rate(results: list[RequestResult]) -> float | None:
    """Tokens/s after the first token of each request: what decoding does, whatever prefill cost."""
    spans = [
        (r.output_tokens - 1, r.e2e_s - r.ttft_s)
        for r in results
        if r.ttft_s is not None and r.e2e_s is not None and r.output_tokens > 1
    ]
    seconds = sum(s for _, s in spans)
    return sum(n for n, _ in spans) / seconds if seconds > 0 else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def acceptance_figures(run: ModeRun) -> Row:
    counters = run.counters
    row: Row = {
        "acceptance_rate": None,
        "mean_acceptance_length": None,
        "acceptance_per_pos": [],
        "num_drafts": None,
        "num_draft_tokens": None,
        "num_accepted_tokens": None,
    }
    if counters is not None and counters.num_drafts > 0:
        row.update(
            acceptance_rate=counters.acceptance_rate,
            mean_acceptance_length=counters.mean_acceptance_length,
            acceptance_per_pos=counters.acceptance_per_pos(),
            num_drafts=counters.num_drafts,
            num_draft_tokens=counters.num_draft_tokens,
            num_accepted_tokens=counters.num_accepted_tokens,
        )
    row.update(response_acceptance(run))
    if row["acceptance_rate"] is None:  # no /metrics: fall back on the responses' own summaries
        row["acceptance_rate"] = row["acceptance_rate_responses"]
        row["mean_acceptance_length"] = row["mean_acceptance_length_responses"]
    return row


def response_acceptance(run: ModeRun) -> Row:
    """Acceptance summed over the per-response summaries the server attaches."""
    drafts = drafted = accepted = 0.0
    for result in run.results:
        summary = result.spec_summary or {}
        drafts += float(summary.get("num_drafts") or 0)
        drafted += float(summary.get("drafted_tokens") or summary.get("draft_tokens") or 0)
        accepted += float(summary.get("accepted_tokens") or summary.get("num_accepted_tokens") or 0)
    return {
        "acceptance_rate_responses": accepted / drafted if drafted else None,
        "mean_acceptance_length_responses": 1 + accepted / drafts if drafts else None,
    }


def measurement_rows(m: Measurement) -> list[Row]:
    """One row per mode of one repeat, with the speedup of this repeat's paired runs."""
    figures = {mode: mode_figures(run) for mode, run in m.runs.items()}
    plain_tps = figures["plain"]["output_tokens_per_s"]
    peers = [mode for mode in figures if mode not in MODES]
    rows = []
    for mode, fig in figures.items():
        speedup = _ratio(fig["output_tokens_per_s"], plain_tps)
        vs_peers = {
            f"ratio_vs_{peer}": _ratio(
                fig["decode_tokens_per_s"], figures[peer]["decode_tokens_per_s"]
            )
            for peer in peers
        }
        prompts = _prompts(m.runs[mode])
        rows.append({**_key(m, mode), **fig, "speedup_vs_plain": speedup, **vs_peers, **prompts})
    return rows


def _key(m: Measurement, mode: str) -> Row:
    return {
        "category": m.category,
        "load": m.load.label,
        "concurrency": m.load.concurrency,
        "request_rate": m.load.request_rate,
        "mode": mode,
    }


def _prompts(run: ModeRun) -> Row:
    return {"prompt_ids": sorted({r.prompt_id for r in run.results})}


def median_rows(per_repeat: list[Row]) -> list[Row]:
    """Groups rows by (category, load, mode) and reduces every number to its median over repeats."""
    groups: dict[tuple[Any, ...], list[Row]] = defaultdict(list)
    for row in per_repeat:
        groups[(row["category"], row["load"], row["mode"])].append(row)
    return [_median_of(rows) for rows in groups.values()]


def _median_of(rows: list[Row]) -> Row:
    out: Row = {"repeats": len(rows)}
    for key, first in rows[0].items():
        values = [r.get(key) for r in rows]
        out[key] = first if key in _IDENTITY else _median_value(first, values)
    out["speedup_vs_plain_per_repeat"] = [r.get("speedup_vs_plain") for r in rows]
    return out


def _median_value(first: Any, values: list[Any]) -> Any:
    if isinstance(first, bool) or not isinstance(first, (int, float, list)) and first is not None:
        return first
    if isinstance(first, list):
        if not all(isinstance(x, (int, float)) for v in values for x in v or []):
            return first
        width = max(len(v or []) for v in values)
        return [_median([v[i] for v in values if v and i < len(v)]) for i in range(width)]
    return _median(values)


def _median(values: list[Any]) -> float | None:
    numbers = [v for v in values if v is not None]
    return statistics.median(numbers) if numbers else None


def peer_rows(records: list[Row]) -> list[Row]:
    """Rows for the transformers peers (concurrency 1): one repeat's requests run back to back."""
    runs: dict[tuple[str, int, str], ModeRun] = defaultdict(lambda: ModeRun(""))
    for rec in records:
        fields = {k: v for k, v in rec.items() if k not in ("category", "repeat")}
        result = RequestResult(**fields)
        run = runs[(rec["category"], rec["repeat"], result.mode)]
        run.mode = result.mode
        run.results.append(result)
        run.wall_s += result.e2e_s or 0.0
    per_repeat = []
    for (category, repeat, mode), run in runs.items():
        fig = mode_figures(run)
        base = runs.get((category, repeat, "hf"))
        base_tps = mode_figures(base)["output_tokens_per_s"] if base else None
        tps = fig["output_tokens_per_s"]
        key = {"category": category, "load": "c=1", "concurrency": 1, "request_rate": None}
        speedup = tps / base_tps if tps is not None and base_tps else None
        per_repeat.append(
            {**key, "mode": mode, **fig, "speedup_vs_plain": speedup, **_prompts(run)}
        )
    return median_rows(per_repeat)


def add_server_ratios(peer: list[Row], requests: list[Row]) -> None:
    """Each peer's tokens/s over specserve's plain tokens/s at concurrency 1 on the same prompts
    (at c=1 a round is one request, so its wall time is the request's E2E)."""
    for row in peer:
        ids = set(row["prompt_ids"])
        plain = [
            r
            for r in requests
            if r["category"] == row["category"] and r["load"] == "c=1" and r["mode"] == "plain"
            and r["ok"] and r["prompt_id"] in ids
        ]  # fmt: skip
        seconds = sum(r["e2e_s"] for r in plain)
        base = sum(r["output_tokens"] for r in plain) / seconds if seconds else None
        tps = row["output_tokens_per_s"]
        row["ratio_vs_server_plain"] = tps / base if tps is not None and base else None
