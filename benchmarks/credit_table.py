"""The headline rows of a run, from its per-pivot credit tables alone: for runs that stopped before their tables
(an invariant run whose passes differ fails compare_passes by design). The statistics and the table are the
workflow's own (compare_passes, headline_rows, render_markdown); main conditioning, then each configuration's
verified share of pivots.

    python benchmarks/credit_table.py RUN_DIR --configfile CAMPAIGN.yaml

RUN_DIR holds credit/<config>/<pass>.parquet (a results/ folder or a copy of its credit tables).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replaynoise.analysis.comparison import compare_passes  # noqa: E402
from replaynoise.analysis.credit import read_credit_grid  # noqa: E402
from replaynoise.config import analysis_hash, validate_config  # noqa: E402
from replaynoise.generation.passes import run_passes  # noqa: E402
from replaynoise.overlays import load_campaign  # noqa: E402
from replaynoise.report.headline import headline_rows  # noqa: E402
from replaynoise.report.tables import render_markdown  # noqa: E402
from replaynoise.settings import AnalysisSettings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--configfile", required=True)
    args = ap.parse_args()
    config = validate_config(load_campaign(args.configfile))
    configs, passes = list(config["configs"]), run_passes(config["replay"])
    files = [str(args.run / "credit" / c / f"{p}.parquet") for c in configs for p in passes]
    credits = read_credit_grid(files, configs, passes)
    stats = AnalysisSettings.of(config["analysis"], config["seed"])
    rows = headline_rows({c: compare_passes(credits[c], stats) for c in configs})
    print(render_markdown(rows.filter(pl.col("conditioning") == "main"), analysis_hash(config)))
    for c in configs:
        exact = credits[c]["exact"]
        print(f"- {c}: exact state verified for {int(exact['verified'].sum())} of {exact.height} pivots")


if __name__ == "__main__":
    main()
