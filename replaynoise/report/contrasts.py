"""One run's excess against another's (two engines over one problem list, say), as a number with its own interval.

Each run's headline table gives its excess with an interval; whether two runs differ is a third statistic, and
reading it off two intervals by eye is the error this module exists to prevent. It takes the crossed (problems x
pass draws) excess of each folder's one configuration and writes their difference with a Welch-Satterthwaite
interval (``analysis.replicated.crossed_difference``), which takes the runs as independent.
"""

from __future__ import annotations

from pathlib import Path

from replaynoise.analysis.replicated import crossed_difference
from replaynoise.io import json_field, read_json

#: the conditionings a contrast reports: the paper's main one, and the one whose sets do not depend on the treatment
CONTRASTED = ("main", "treatment_independent")


def folder_comparison(folder: Path) -> tuple[str, dict]:
    """The one configuration's comparison of a reference folder (pooled comparisons aside)."""
    found = sorted(p for p in (folder / "analysis").glob("*/comparison.json") if p.parent.name != "pooled")
    if len(found) != 1:
        names = ", ".join(p.parent.name for p in found) or "none"
        raise ValueError(f"{folder}: a contrast takes a folder of one configuration; its analysis/ has {names}")
    record = read_json(found[0])
    for keys in (("metric",), ("parameters", "ci"), ("conditionings",)):
        json_field(record, found[0], *keys)
    if not isinstance(record["conditionings"], dict):
        raise ValueError(f"{found[0]}: field conditionings is not an object")
    return found[0].parent.name, record | {"source": found[0].as_posix()}


def replicated_excess(comparison: dict, conditioning: str, where: str) -> dict:
    """The excess block (crossed and problem-only) of a comparison's replicated pairs under one conditioning, with
    the pairs' count and the note that says why a block's numbers are empty (too few eligible pivots)."""
    if conditioning not in comparison["conditionings"]:
        raise ValueError(f"{where}: no conditioning {conditioning!r} in the comparison")
    source = f"{comparison.get('source', where)}: conditionings.{conditioning}"
    replicated = json_field(comparison["conditionings"], source, conditioning).get("replicated")
    if not replicated:
        raise ValueError(
            f"{where}: one draw per pass, so no interval over pass draws to contrast (run replay.replicates >= 2)"
        )
    if not replicated.get("available"):
        raise ValueError(f"{where}: no replicated comparison ({replicated.get('reason')})")
    excess = json_field(replicated, f"{source}.replicated", "by_metric", comparison["metric"], "excess_pp")
    draws = json_field(replicated, f"{source}.replicated", "draws")
    return excess | {"n_pairs": len(draws), "note": replicated.get("note")}


def _interval(stat: dict) -> str:
    if stat.get("ci_lo") is None:
        return f"{stat['estimate']:+.1f}" if stat.get("estimate") is not None else "n/a"
    return f"{stat['estimate']:+.1f} [{stat['ci_lo']:+.1f}, {stat['ci_hi']:+.1f}]"


def _row(conditioning: str, excesses: tuple[dict, dict], diff: dict) -> str:
    cells = [f"{_interval(e['crossed'])} ({e['n_pairs']}, {e['crossed']['n_problems']})" for e in excesses]
    df = f"{diff['df']:.1f}" if diff.get("df") is not None else "n/a"
    resolved = {True: "yes", False: "no", None: "n/a"}[diff.get("resolved")]
    return f"| {conditioning} | {cells[0]} | {cells[1]} | {_interval(diff)} | {df} | {resolved} |"


def contrast_lines(first: Path, second: Path) -> list[str]:
    """A markdown table of the two folders' excesses and their difference (first - second), per conditioning, and
    a note for each cell that has no interval."""
    (name_a, a), (name_b, b) = folder_comparison(first), folder_comparison(second)
    ci = a["parameters"]["ci"]
    if a["metric"] != b["metric"]:
        raise ValueError(f"{first} and {second}: metric {a['metric']!r} against {b['metric']!r}: not like with like")
    if b["parameters"]["ci"] != ci:
        raise ValueError(f"{first} and {second}: intervals of {ci} against {b['parameters']['ci']}")
    lines = [
        f"# Contrast: `{first.name}` ({name_a}) - `{second.name}` ({name_b})",
        "",
        f"Written by `python -m replaynoise.reference contrast OUT {first} {second}` from the two folders'",
        f"`analysis/*/comparison.json`; metric {a['metric']}; {ci:.0%} intervals over problems and pass draws",
        "(crossed model, docs/method.md section 4). The difference's interval is Welch-Satterthwaite: it takes the two",
        "runs as independent, although runs over one problem list share their problems (a joint model would let the",
        "problems' excesses correlate across the runs). Each side is a single run: its interval covers its problems",
        "and pass draws, not a shift shared by every draw of the run (card, host, load), so the difference is one run",
        "against one run (`python -m replaynoise.reference combine` gives the interval over several runs).",
        "",
        "| conditioning | first: excess pp (pairs, problems) | second: excess pp (pairs, problems) "
        "| difference pp | df | resolved |",
        "|---|---:|---:|---:|---:|---|",
    ]
    notes = []
    for conditioning in CONTRASTED:
        ea = replicated_excess(a, conditioning, f"{first}, {conditioning}")
        eb = replicated_excess(b, conditioning, f"{second}, {conditioning}")
        diff = crossed_difference(ea["crossed"], eb["crossed"], ci)
        lines.append(_row(conditioning, (ea, eb), diff))
        notes += [f"- {conditioning}: {text}" for text in (ea["note"], eb["note"], diff.get("reason")) if text]
    return lines + (["", *notes] if notes else [])
