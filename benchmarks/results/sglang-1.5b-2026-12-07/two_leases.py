"""SGLang's two leases of config/campaigns/gpu-sglang/qwen-1.5b-vllm-problems.yaml, on the pivots both resumed
from the same point: the rates each lease's passes give there, and their difference, with problem-cluster
bootstrap intervals (one resample of problems serves both leases, so the difference is paired).

A pivot is shared where both leases' exact credit tables hold its id (problem, rollout, position) with the same
logit margin and prefix length, and both verified it: the rollout reached that point alike in both leases. The
rates are sign-change rates of Â over all those pivots (no conditioning; sign metric), the first pair of draws
of each lease (the earlier lease has no other).

    cd benchmarks/results/sglang-1.5b-2026-12-07 && ../../../.venv/bin/python two_leases.py > two-leases.md
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl

from replaynoise.analysis.disagreement import disagree
from replaynoise.analysis.paper_stats import Clusters

ROOT = Path(__file__).resolve().parents[3] / "reference" / "gpu-sglang"
LEASES = {"2026-12-06 (H100)": "qwen-1.5b-vllm-problems-2026-12-06", "2026-12-07 (H200)": "qwen-1.5b-vllm-problems"}
CONFIG, N_BOOT, SEED, CI = "qwen2.5-coder-1.5b-sglang", 2000, 20261207, 0.95


def credit(folder: str, pass_name: str) -> pl.DataFrame:
    path = ROOT / folder / "credit" / CONFIG / f"{pass_name}.parquet"
    return pl.read_parquet(path).select("pivot_id", "problem_id", "margin", "prefix_len", "verified", "a_hat")


def shared_pivots() -> pl.DataFrame:
    """The pivots both leases' exact passes reached alike, with each lease's Â of each pass (columns pass@lease)."""
    frames = []
    for lease, folder in LEASES.items():
        exact = credit(folder, "exact")
        frame = exact.select(
            "pivot_id", "problem_id", "margin", "prefix_len", "verified", pl.col("a_hat").alias(f"exact@{lease}")
        )
        for pass_name in ("replica", "refeed"):
            other = credit(folder, pass_name).select("pivot_id", pl.col("a_hat").alias(f"{pass_name}@{lease}"))
            frame = frame.join(other, on="pivot_id", how="inner")
        frames.append(frame.rename({c: f"{c}@{lease}" for c in ("margin", "prefix_len", "verified")}))
    a, b = (f"@{lease}" for lease in LEASES)
    both = frames[0].join(frames[1].drop("problem_id"), on="pivot_id", how="inner")
    same = (
        (pl.col("margin" + a) == pl.col("margin" + b))
        & (pl.col("prefix_len" + a) == pl.col("prefix_len" + b))
        & pl.col("verified" + a)
        & pl.col("verified" + b)
    )
    return both.filter(same).sort("pivot_id")


def interval(reps: np.ndarray, sign: str = "") -> str:
    lo, hi = np.quantile(reps[np.isfinite(reps)], [(1 - CI) / 2, 1 - (1 - CI) / 2])
    return f"[{100 * lo:{sign}.1f}, {100 * hi:{sign}.1f}]"


def flips(pivots: pl.DataFrame, lease: str, pass_name: str) -> np.ndarray:
    return disagree(pivots[f"exact@{lease}"], pivots[f"{pass_name}@{lease}"], "sign").astype(np.float64)


def main() -> int:
    pivots = shared_pivots()
    clusters = Clusters.from_ids(pivots["problem_id"].to_list(), n_boot=N_BOOT, seed=SEED)
    ones = np.ones(pivots.height)
    folders = ", ".join(f"`reference/gpu-sglang/{f}/`" for f in LEASES.values())
    print("# SGLang's 1.5B in two leases, on the pivots both reached alike\n")
    print(f"Written by `{Path(__file__).relative_to(ROOT.parents[1])}` from the two folders' committed credit tables")
    print(f"({folders}).")
    print(f"{pivots.height} pivots of {clusters.n_groups} problems: the same id, margin and prefix length in both")
    print("leases' exact passes, verified in both. Sign-change rates of Â in %, no conditioning, each lease's first")
    print(f"pair of draws; {CI:.0%} percentile intervals over {N_BOOT} problem resamples (seed {SEED}), one resample")
    print("for both leases (paired). They cover the problems only: the earlier lease's one pair leaves its pass")
    print("draw's spread unmeasured.\n")
    print("| rate | " + " | ".join(LEASES) + " | second - first, pp |")
    print("|---|---:|---:|---:|")
    rows = {
        "floor D(exact, replica), %": {lease: flips(pivots, lease, "replica") for lease in LEASES},
        "re-feed D(exact, refeed), %": {lease: flips(pivots, lease, "refeed") for lease in LEASES},
    }
    rows["excess, pp"] = {
        lease: rows["re-feed D(exact, refeed), %"][lease] - rows["floor D(exact, replica), %"][lease]
        for lease in LEASES
    }
    for label, per_lease in rows.items():
        (a, fa), (b, fb) = ((clusters.replicates(f, ones), f.mean()) for f in per_lease.values())
        sign = "+" if label.startswith("excess") else ""
        cells = [f"{100 * m:{sign}.1f} {interval(r, sign)}" for r, m in ((a, fa), (b, fb))]
        print(f"| {label} | {cells[0]} | {cells[1]} | {100 * (fb - fa):+.1f} {interval(b - a, '+')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
