"""The RL frameworks' alarms beside what credit did: for every committed run that kept its prefixes' log-probs,
whether NeMo-RL's decode-vs-prefill alarm and verl's rollout-correction health checks would have fired on the
re-feed's gap, and how often that re-feed flipped credit against the exact pass.

A user who trusts those dashboards reads a quiet one as "the recomputation is safe"; this table says whether the
gaps that flip credit are gaps the dashboards see.

    python -m replaynoise.report.alarms OUT_DIR [ROOT ...]   # ROOT: reference/ and benchmarks/results/ by default
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from replaynoise.analysis.rl_metrics import DEFINITIONS, frameworks_by_pass
from replaynoise.io import read_json, read_parquet, write_json, write_text

ROOTS = (Path("reference"), Path("benchmarks/results"))
#: The table's columns after the run and pass: (key, header, format).
COLUMNS = (
    ("n_sequences", "pivots", "d"),
    ("n_tokens", "tokens", "d"),
    ("token_mult_prob_error", "token_mult_prob_error", ".5f"),
    ("nemo_rl_alarm", "NeMo-RL alarm (> 1.05)", ""),
    ("sequences_past_alarm", "pivots past 1.05", ".1%"),
    ("gen_kl_error", "gen_kl_error = k3_kl", ".2e"),
    ("kl", "kl", ".2e"),
    ("log_ppl_diff", "log_ppl_diff", ".2e"),
    ("ppl_ratio", "ppl_ratio", ".6f"),
    ("chi2_token", "chi2_token", ".2e"),
    ("chi2_seq", "chi2_seq", ".2e"),
    ("is_mean", "IS mean", ".5f"),
    ("ess", "ESS", ".5f"),
    ("is_share_high", "weights > 2", ".2e"),
    ("verl_health", "verl warns", ""),
    ("flip_rate", "credit flips vs exact", ".1%"),
    ("floor", "floor (replica vs exact)", ".1%"),
    ("excess", "excess pp [95% CI]", ""),
)


def credit_of(comparison: Mapping[str, Any] | None, name: str) -> dict[str, Any]:
    """What re-feed pass ``name`` did to credit in the main conditioning of a run's comparison: its flip rate
    against exact (the headline metric), the floor's (replica against exact) and, for the first re-feed draw, the
    headline excess with its interval; all None for a run that compared no credit (``comparison`` None)."""
    main = ((comparison or {}).get("conditionings") or {}).get("main") or {}
    if not main.get("available"):
        return {"flip_rate": None, "floor": None, "excess": None}
    pairs = main.get("disagreement") or {}
    if name == "refeed":
        flips, excess = pairs.get("exact_vs_refeed") or {}, main.get("excess_pp")
    else:
        flips, excess = ((main.get("other_passes") or {}).get(name) or {}).get("vs_exact") or {}, None
    return {
        "flip_rate": flips.get("estimate"),
        "floor": (pairs.get("exact_vs_replica") or {}).get("estimate"),
        "excess": dict(excess) if excess else None,
    }


def run_rows(parquet: Path, root: Path) -> list[dict[str, Any]]:
    """One row per pass of one run's mismatch table: the frameworks' metrics and alarms, and, where the run compared
    credit (a ``comparison.json`` beside the table), what the pass did to it."""
    comparison_file = parquet.parent / "comparison.json"
    comparison = read_json(comparison_file) if comparison_file.is_file() else None
    rows = []
    for name, metrics in frameworks_by_pass(read_parquet(parquet)).items():
        credit = credit_of(comparison, name)
        rows.append(
            {
                "run": parquet.parent.relative_to(root).as_posix(),
                "pass": name,
                "kind": "campaign" if comparison else "probe (no credit computed)",
                **metrics,
                **credit,
            }
        )
    return rows


def unkept_rows(root: Path, kept: set[Path]) -> list[dict[str, Any]]:
    """Runs whose comparison scored the prefix mismatch but whose folder kept no per-pivot log-probs: only their
    pooled k3_kl (NeMo-RL's gen_kl_error too) is known."""
    rows = []
    for path in sorted(root.glob("**/analysis/*/comparison.json")):
        if path.parent in kept:
            continue
        comparison = read_json(path)
        block = comparison.get("prefix_mismatch") or {}
        for name, pooled in sorted((block.get("passes") or {}).items()):
            rows.append(
                {
                    "run": path.parent.relative_to(root).as_posix(),
                    "pass": name,
                    "kind": "log-probs not kept (k3_kl only)",
                    "n_sequences": pooled.get("n_pivots"),
                    "n_tokens": pooled.get("n_tokens"),
                    "gen_kl_error": pooled.get("k3_kl"),
                    "k3_kl": pooled.get("k3_kl"),
                    **credit_of(comparison, name),
                }
            )
    return rows


def alarm_rows(roots: Sequence[Path], base: Path) -> list[dict[str, Any]]:
    """Every run under ``roots`` that kept a mismatch table, then every one that scored the mismatch without
    keeping it; runs named relative to ``base`` and ordered by name."""
    rows: list[dict[str, Any]] = []
    for root in roots:
        tables = sorted((base / root).glob("**/mismatch.parquet"))
        rows += [row | {"run": f"{root.as_posix()}/{row['run']}"} for t in tables for row in run_rows(t, base / root)]
        unkept = unkept_rows(base / root, {t.parent for t in tables})
        rows += [row | {"run": f"{root.as_posix()}/{row['run']}"} for row in unkept]
    return sorted(rows, key=lambda r: (r["kind"] != "campaign", r["kind"], r["run"], r["pass"]))


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "fires" if value else "quiet"
    if isinstance(value, list):
        return ", ".join(value) or "none"
    if isinstance(value, dict):
        lo, hi = value.get("ci_lo"), value.get("ci_hi")
        bounds = "" if lo is None or hi is None else f" [{lo:+.1f}, {hi:+.1f}]"
        return f"{value['estimate']:+.1f}{bounds}"
    return format(value, fmt)


def markdown(rows: Sequence[Mapping[str, Any]], command: str) -> str:
    """The table, one section per kind of run, and the definitions."""
    lines = ["# NeMo-RL's and verl's alarms on the re-feed, beside the credit flips", "", f"Made by `{command}`.", ""]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        lines += [f"## {kind}", "", "| run | pass | " + " | ".join(h for _, h, _ in COLUMNS) + " |"]
        lines.append("|" + "---|" * (len(COLUMNS) + 2))
        for r in (r for r in rows if r["kind"] == kind):
            cells = [_cell(r.get(key), fmt) for key, _, fmt in COLUMNS]
            lines.append(f"| {r['run']} | {r['pass']} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Definitions", ""]
    lines += [f"- `{key}`: {text}" for key, text in DEFINITIONS.items()]
    lines += [
        "- credit flips: share of the main conditioning's pivots whose decision-token credit the pass gives another "
        "sign than exact does; floor: the same for replica; excess: re-feed's minus the floor's, in points "
        "(comparison.json beside the table)",
        "",
    ]
    return "\n".join(lines)


def write_alarms(out: Path, roots: Sequence[Path] = ROOTS, base: Path = Path(".")) -> tuple[Path, Path]:
    """``alarms.json`` (the rows and definitions) and ``alarms.md`` (the table) in ``out``."""
    command = "python -m replaynoise.report.alarms " + " ".join([out.as_posix(), *(r.as_posix() for r in roots)])
    rows = alarm_rows(roots, base)
    json_path, md_path = out / "alarms.json", out / "alarms.md"
    write_json({"command": command, "definitions": DEFINITIONS, "rows": rows}, json_path)
    write_text(markdown(rows, command), md_path)
    return json_path, md_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replaynoise.report.alarms", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("roots", type=Path, nargs="*", default=list(ROOTS))
    args = parser.parse_args(argv)
    for path in write_alarms(args.out, args.roots):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
