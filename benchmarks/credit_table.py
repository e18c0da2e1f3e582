"""The main-conditioning row of every configuration of a run, from its per-pivot credit tables alone: for runs
that stopped before their tables (an invariant run whose passes differ fails compare_passes by design).

    python benchmarks/credit_table.py RUN_DIR --configfile CAMPAIGN.yaml

RUN_DIR holds credit/<config>/<pass>.parquet (a results/ folder or a copy of its credit tables).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replaynoise.analysis import compare_passes, comparison_settings  # noqa: E402
from replaynoise.config import validate_config  # noqa: E402
from replaynoise.provenance import read_parquet  # noqa: E402


def pct(d: dict) -> str:
    return f"{100 * d['estimate']:.1f} [{100 * d['ci_lo']:.1f}, {100 * d['ci_hi']:.1f}]"


def num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--configfile", required=True)
    args = ap.parse_args()
    config = validate_config(yaml.safe_load(Path(args.configfile).read_text()))
    print("| configuration | n (problems) | re-feed % [95% CI] | floor % [95% CI] | excess pp [95% CI] "
          "| per-problem t | OLS t | verified |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in config["configs"]:
        folder = args.run / "credit" / name
        credit = {p.stem: read_parquet(p) for p in sorted(folder.glob("*.parquet"))}
        result = compare_passes(credit, **comparison_settings(config["analysis"], config["seed"]), probes=None)
        row = result["conditionings"]["main"]["by_metric"][config["analysis"]["metric"]]
        d, e, t = row["disagreement"], row["excess_pp"], row["per_problem_t"]
        print(f"| {name} | {d['exact_vs_refeed']['n']} ({t.get('n_problems')}) | {pct(d['exact_vs_refeed'])} "
              f"| {pct(d['exact_vs_replica'])} | {e['estimate']:+.1f} [{e['ci_lo']:+.1f}, {e['ci_hi']:+.1f}] "
              f"| {num(t.get('t'))} | {num(row['clustered_t'].get('t'))} "
              f"| {int(credit['exact']['verified'].sum())} / {credit['exact'].height} |")


if __name__ == "__main__":
    main()
