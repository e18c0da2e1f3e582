"""What the stopping rule would have saved: a finished run's pairs of draws replayed in their draw order.

    python -m replaynoise.power stopping reference/gpu-vllm/ladder/qwen-1.5b ... [--when resolved] [--json OUT]

For every configuration of a run folder with two pairs of draws or more, the rule (``analysis.stopping``) is replayed
over the run's own pairs from its credit tables, with max_pairs the run's pairs (the fixed design it ran) unless the
run's configuration has a ``replay.stop`` of its own. The table says at which pair it stops, its interval there (at
the look's spent level), the pairs and GPU-minutes it saves and whether its verdict (resolved, and on which side)
is the full design's. A pass's GPU time is its job's seconds from the run's ``h200-pipeline.json`` rows, else from
its Snakemake benchmark TSVs (``benchmarks/replay_<pass>/``, read as the cost report reads them); a run with neither
is given in pairs alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from replaynoise.analysis.replicated import crossed_interval
from replaynoise.analysis.runs import run_cells
from replaynoise.analysis.stopping import StopRule, replay, verdict
from replaynoise.io import UnreadableFileError, json_field, read_json, read_parquet, write_json, write_text
from replaynoise.report.cost import read_benchmark
from replaynoise.settings import comparison_metric
from replaynoise.vouching import require_intact

TIMINGS = "h200-pipeline.json"


def pass_seconds(folder: Path, config: str, name: str) -> float | None:
    """A pass's job seconds over its shards: the run's pipeline record's rows, else its benchmark TSVs' wall
    seconds (``report.cost.read_benchmark``); None where the run has neither."""
    record = folder / TIMINGS
    if record.is_file():
        rows = [r for r in read_json(record).get("rows", []) if r.get("config") == config]
        found = [float(r["seconds"]) for r in rows if r.get("rule") == f"replay_{name}"]
        if found:
            return sum(found)
    tables = sorted((folder / "benchmarks" / f"replay_{name}").glob(f"{config}.*.tsv"))
    measured = [read_benchmark(table) for table in tables]
    return sum(m["seconds"] for m in measured if m is not None) if tables else None


def run_config(folder: Path) -> dict:
    """The configuration a run folder records (``provenance.json``, or a partial run's ``partial.json``)."""
    for name in ("provenance.json", "partial.json"):
        if (folder / name).is_file():
            record = read_json(folder / name)
            return record.get("config") or {}
    return {}


def stop_rule(folder: Path, pairs: int, given: dict[str, Any]) -> StopRule:
    """The run's own ``replay.stop`` if it has one, else the given rule with max_pairs the run's pairs."""
    own = run_config(folder).get("replay", {}).get("stop")
    if own:
        return StopRule.from_config(own)
    return StopRule(max_pairs=pairs, **given)


def saving(folder: Path, config: str, given: dict[str, Any]) -> dict[str, Any]:
    """One configuration's replay of the rule and what it saves, or why it has none."""
    row: dict[str, Any] = {"run": folder.as_posix(), "config": config}
    comparison = read_json(folder / "analysis" / config / "comparison.json")
    parameters = json_field(comparison, f"{folder}/analysis/{config}/comparison.json", "parameters")
    ci = float(parameters["ci"])
    credit = {p.stem: read_parquet(p) for p in sorted((folder / "credit" / config).glob("*.parquet"))}
    try:
        cells = run_cells(credit, "main", comparison_metric(parameters))
    except ValueError as exc:
        return {**row, "skipped": str(exc)}
    pairs = len(cells.pairs)
    if pairs < given["min_pairs"]:
        return {**row, "pairs": pairs, "skipped": f"{pairs} pair(s) of draws: nothing to stop early"}
    rule = stop_rule(folder, pairs, given)
    full = crossed_interval(cells.s, cells.n, ci, 100.0)
    stopped = replay(cells.s, cells.n, rule, ci)
    seconds = [[pass_seconds(folder, config, name) for name in pair] for pair in cells.pairs]
    known = all(x is not None for pair in seconds for x in pair)
    after = seconds[stopped["stopped_at"] :]
    row.update(
        pairs=pairs,
        draws=[list(p) for p in cells.pairs],
        ci=ci,
        rule=vars(rule),
        full={k: full[k] for k in ("estimate", "ci_lo", "ci_hi")} | {"verdict": verdict(full)},
        stop=stopped,
        pairs_saved=pairs - stopped["stopped_at"],
        pair_gpu_minutes=[sum(x or 0.0 for x in p) / 60 for p in seconds] if known else None,
        gpu_minutes_saved=sum(x or 0.0 for p in after for x in p) / 60 if known else None,
        same_verdict=stopped["verdict"] == verdict(full),
    )
    return row


def _cell(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:+.{digits}f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The savings table: one line per configuration replayed, then the skipped ones with why."""
    head = (
        "| run | config | pairs | full design, 95% | stops at | reason | stopped interval (level) | pairs saved "
        "| GPU-min saved (of the pairs') | same verdict |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in (r for r in rows if "skipped" not in r):
        f, s = r["full"], r["stop"]
        minutes = (
            f"{r['gpu_minutes_saved']:.1f} (of {sum(r['pair_gpu_minutes']):.1f})"
            if r["gpu_minutes_saved"] is not None
            else "n/a (no timings)"
        )
        lines.append(
            f"| {r['run']} | {r['config']} | {r['pairs']} | {_cell(f['estimate'])} [{_cell(f['ci_lo'])}, "
            f"{_cell(f['ci_hi'])}] {f['verdict']} | {s['stopped_at']} | {s['reason']} | {_cell(s['estimate'])} "
            f"[{_cell(s['ci_lo'])}, {_cell(s['ci_hi'])}] ({s['level']:.4f}) {s['verdict']} | {r['pairs_saved']} | "
            f"{minutes} | {'yes' if r['same_verdict'] else 'NO'} |"
        )
    skipped = [f"- {r['run']} {r['config']}: {r['skipped']}" for r in rows if "skipped" in r]
    return "\n".join(lines + ([""] + skipped if skipped else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m replaynoise.power stopping", description=__doc__.split("\n")[0])
    ap.add_argument("folders", type=Path, nargs="+", help="run or reference folders (credit/<config>/*.parquet)")
    ap.add_argument("--when", choices=("resolved", "bounded"), default="resolved")
    ap.add_argument("--min-pairs", type=int, default=2)
    ap.add_argument("--half-width", type=float, default=3.0, help="pp, for --when bounded")
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    args = ap.parse_args(argv)
    given = {"when": args.when, "min_pairs": args.min_pairs, "half_width_pp": args.half_width}
    rows = []
    try:
        for folder in args.folders:
            require_intact(folder, "stopping", reads=["credit/*/*.parquet", "analysis/*/comparison.json"])
            for config in sorted(p.name for p in (folder / "credit").iterdir() if p.is_dir()):
                rows.append(saving(folder, config, given))
    except (OSError, ValueError, UnreadableFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = markdown(rows)
    print(table, end="")
    if args.json is not None:
        write_json({"rule": given, "rows": rows}, args.json)
    if args.markdown is not None:
        write_text(table, args.markdown)
    return 0
