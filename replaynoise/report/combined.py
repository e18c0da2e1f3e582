"""Several runs of one campaign read from their reference folders and combined (``analysis.runs``), as JSON and
markdown: a reader sees the mean over runs with an interval that covers the run-to-run shift, and how poorly a few
runs estimate that shift."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from replaynoise.analysis.runs import combine_runs
from replaynoise.io import read_json, read_parquet, sha256_file, write_json, write_text

#: the conditionings combined: the paper's main one, and the one whose sets do not depend on the treatment
COMBINED = ("main", "treatment_independent")


def run_config(folder: Path) -> dict:
    """A reference folder's recorded configuration: a finished run's ``provenance.json``, a cut-short one's
    ``partial.json``."""
    for name in ("provenance.json", "partial.json"):
        if (folder / name).is_file():
            return read_json(folder / name)["config"]
    raise FileNotFoundError(f"{folder}: neither provenance.json nor partial.json (not a reference folder?)")


def common_configuration(folders: list[Path], configuration: str | None) -> str:
    """The configuration every folder has credit tables of: the one named, or the only one they share."""
    shared = set.intersection(*({p.name for p in (f / "credit").glob("*") if p.is_dir()} for f in folders))
    if configuration is not None:
        if configuration not in shared:
            raise ValueError(f"configuration {configuration!r} is not in every folder's credit/ (shared: {shared})")
        return configuration
    if len(shared) != 1:
        raise ValueError(f"the folders share configurations {sorted(shared) or 'none'}: name one with --config")
    return shared.pop()


def _card(folder: Path) -> str:
    hardware = (
        read_json(folder / "provenance.json").get("hardware", {}) if (folder / "provenance.json").is_file() else {}
    )
    return ", ".join(hardware.get("cuda") or []) or "not recorded"


def combine_folders(folders: list[Path], configuration: str | None = None) -> dict[str, Any]:
    """The runs of ``folders`` combined over one configuration, refusing runs analysed at different interval
    levels or metrics; settings in which their configurations differ are named, not hidden."""
    if len(folders) < 2:
        raise ValueError("combine takes two reference folders or more")
    name = common_configuration(folders, configuration)
    configs = [run_config(f) for f in folders]
    analysis = [(c["analysis"]["ci"], c["analysis"]["metric"]) for c in configs]
    if len(set(analysis)) != 1:
        raise ValueError(f"the runs' (ci, metric) differ: {analysis}; combine like with like")
    ci, metric = analysis[0]
    keys = sorted({k for c in configs for k in c["configs"][name]} | {"replay", "dataset", "rollouts"})
    first = configs[0]
    differ = [
        k
        for k in keys
        if any(c["configs"][name].get(k, c.get(k)) != first["configs"][name].get(k, first.get(k)) for c in configs)
    ]
    credits: list[dict] = []
    seen: dict[tuple, Path] = {}
    for folder in folders:
        files = sorted((folder / "credit" / name).glob("*.parquet"))
        digest = tuple((p.name, sha256_file(p)) for p in files)
        if digest in seen:  # a copy has no run-to-run variance of its own: the run-level F test is undefined
            raise ValueError(f"{folder} and {seen[digest]} hold the same credit tables: combine takes distinct runs")
        seen[digest] = folder
        credits.append({p.stem: read_parquet(p) for p in files})
    result = combine_runs(credits, COMBINED, metric, ci)
    return {
        "configuration": name,
        "folders": [f.as_posix() for f in folders],
        "cards": [_card(f) for f in folders],
        "metric": metric,
        "ci": ci,
        "settings_that_differ": differ,
        "conditionings": result,
    }


def _interval(stat: dict) -> str:
    if stat.get("estimate") is None:
        return "n/a"
    if stat.get("ci_lo") is None:
        return f"{stat['estimate']:+.1f}"
    return f"{stat['estimate']:+.1f} [{stat['ci_lo']:+.1f}, {stat['ci_hi']:+.1f}]"


def _run_sd(parts: dict) -> str:
    sd, lo, hi = parts["run_sd"], parts["run_sd_ci_lo"], parts["run_sd_ci_hi"]
    return f"{sd:.1f} [{lo:.1f}, {hi:.1f}]" if lo is not None else f"{sd:.1f} [up to {hi:.1f}]"


def combined_lines(record: dict, command: str) -> list[str]:
    """The markdown of a ``combine_folders`` record."""
    ci = record["ci"]
    lines = [
        f"# Runs combined: {record['configuration']} over {len(record['folders'])} runs",
        "",
        f"Written by `{command}` from the runs' committed credit tables",
        f"(`credit/{record['configuration']}/*.parquet`); metric {record['metric']}; {ci:.0%} intervals.",
        "Each run's own interval covers its problems and pass draws (crossed model; a run of one pair has none);",
        "the combined one covers problems, pass draws and runs: the mean over runs of the G x K table of each",
        "run's per-problem excess (replaynoise/analysis/runs.py). Problems are the shared unit; the runs' pivots",
        "and pairs are not matched.",
        "",
        "| run | card | conditioning | pairs | problems | pivots per pair | excess pp, its own interval |",
        "|---|---|---|---:|---:|---|---:|",
    ]
    for cond, block in record["conditionings"].items():
        for folder, card, run in zip(record["folders"], record["cards"], block["runs"]):
            per_pair = ", ".join(str(v) for v in run["n_per_pair"])
            own = _interval(run["crossed"]) if run["n_pairs"] > 1 else f"{run['estimate']:+.1f} (one pair)"
            lines.append(
                f"| `{folder}` | {card} | {cond} | {run['n_pairs']} | {run['n_problems']} | {per_pair} | {own} |"
            )
    lines += [
        "",
        "| conditioning | mean over runs, excess pp [problems x draws x runs] | df | run-level SD pp | run F test p "
        "| problems (shared) | resolved |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    notes = []
    for cond, block in record["conditionings"].items():
        parts = block.get("components")
        if not parts:
            lines.append(f"| {cond} | {_interval(block)} | n/a | n/a | n/a | {block['n_problems']} | n/a |")
            continue
        test = parts["run_test"]
        lines.append(
            f"| {cond} | {_interval(block)} | {block['df']:.1f} | {_run_sd(parts)} | {test['p']:.2g} "
            f"| {block['n_problems']} ({block['shared_problems']}) | {'yes' if block['resolved'] else 'no'} |"
        )
        notes.append(
            f"- {cond}: the run-level SD rests on {test['df'][0]} degree(s) of freedom (F = {test['f']:.2f} on "
            f"{test['df'][0]} and {test['df'][1]}): its {ci:.0%} upper bound is {parts['run_sd_ci_hi']:.1f} pp, so "
            f"{len(record['folders'])} runs estimate it poorly, and the combined interval's t has {block['df']:.1f} df."
        )
    if record["settings_that_differ"]:
        notes.append(f"- The runs' configurations differ in: {', '.join(record['settings_that_differ'])}.")
    return [*lines, "", *notes]


def write_combined(record: dict, command: str, out: Path) -> tuple[Path, Path]:
    """``out``/combined-<configuration>.json and .md."""
    json_path, md_path = (out / f"combined-{record['configuration']}.{ext}" for ext in ("json", "md"))
    write_json({**record, "command": command}, json_path)
    write_text("\n".join(combined_lines(record, command)) + "\n", md_path)
    return json_path, md_path


def add_combine_parser(sub: Any) -> None:
    """``reference combine``: its arguments, beside the reference commands."""
    runs = sub.add_parser(
        "combine", help="combine runs of one campaign: the mean excess over runs with its interval and run-level SD"
    )
    runs.add_argument("folders", type=Path, nargs="+")
    runs.add_argument("--out", type=Path, default=None, help="write DIR/combined-<configuration>.{json,md}")
    runs.add_argument("--config", default=None, help="the configuration (default: the one the folders share)")


def combine_command(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``reference combine``: the record printed, or written under ``--out`` with the command that made it."""
    record = combine_folders(args.folders, args.config)
    command = " ".join(["python -m replaynoise.reference", *(argv if argv is not None else sys.argv[1:])])
    if args.out is None:
        print("\n".join(combined_lines(record, command)))
    else:
        print(*write_combined(record, command, args.out))
    return 0
