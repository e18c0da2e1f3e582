"""The README's first command: the embedded default (config/config.yaml: SmolLM2 on CPU), run as a new user runs it.
Its main row must have numbers (at least twice min_eligible pivots, so that a numerics change cannot push it under),
no figure may be near blank, the printed summary must say what the row means, and the run must be the same bytes at
--cores 1 and --cores 2 (a CPU kernel's sums follow its thread count; the run's compute threads do not follow the
cores: tests/test_threads.py)."""

from __future__ import annotations

import subprocess

import numpy as np
import polars as pl
import yaml
from helpers import REPO, SNAKEMAKE, seed_model
from PIL import Image

#: Below this share of non-white pixels a figure is a message on a blank canvas (an old default drew one at 1.8%).
MIN_INK = 0.03


def run_default(workdir, cores: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*SNAKEMAKE, "--directory", str(workdir), "--cores", cores], capture_output=True, text=True, timeout=1500
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def ink(png) -> float:
    return float((np.asarray(Image.open(png).convert("L")) < 250).mean())


def test_the_default_run_prints_a_main_row_with_numbers_and_is_the_same_at_any_core_count(smollm2_dir, tmp_path):
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    runs = {}
    for cores in ("2", "1"):
        work = tmp_path / f"cores-{cores}"
        seed_model(work, smollm2_dir)
        runs[cores] = (work, run_default(work, cores))
    work, proc = runs["2"]
    headline = pl.read_csv(work / "results" / "tables" / "headline.csv", comment_prefix="#", infer_schema_length=0)
    main = headline.filter(pl.col("conditioning") == "main").to_dicts()
    assert main, headline
    for row in main:
        assert int(row["n"]) >= 2 * config["analysis"]["min_eligible"], row
        for key in ("refeed_disagreement", "floor", "excess_pp", "excess_pp_ci_lo", "excess_pp_ci_hi", "t_per_problem"):
            assert row[key] not in (None, "n/a"), (key, row)
    printed = proc.stdout + proc.stderr
    assert "excludes 0 means re-feeding moved credit" in printed and "results/report.html" in printed
    summary_row = next(line for line in printed.splitlines() if line.strip().startswith(main[0]["config"]))
    assert "n/a" not in summary_row, summary_row
    figures = sorted((work / "results" / "figures").glob("*.png"))
    assert len(figures) >= 7
    blank = {f.name: round(ink(f), 3) for f in figures if ink(f) < MIN_INK}
    assert not blank, blank
    manifests = {cores: (w / "results" / "MANIFEST.sha256").read_text() for cores, (w, _) in runs.items()}
    assert manifests["1"] == manifests["2"]
