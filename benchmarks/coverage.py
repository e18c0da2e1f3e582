"""Does the replicated excess's interval cover zero when re-feeding changes nothing? A simulation of replay passes.

Each simulated run has G problems and R draws of replica and of refeed. A pivot's two branches have success
probabilities near its problem's; the exact pass samples K continuations per branch. Every other pass replays the
same requests with common random numbers: a continuation reproduces the exact pass's outcome unless it diverges,
and a diverged one is a fresh draw. A pivot's chance to diverge is its own (logit normal) shifted by its pass
draw's component (normal, SD ``pass_sd`` on the logit scale), shared by every row of that draw: one schedule, one
compile. Replica and re-feed draws come from the same distribution, so the true excess is zero, and the share of
runs whose interval holds zero is the interval's coverage. The analysis is the workflow's own
(``analysis.replicated_block`` on credit frames, the paper's main conditioning per pair, the sign metric).

    python benchmarks/coverage.py OUT.json [--sims 2000]

tests/test_crossed.py runs the same simulation in the fast tier; the committed record is
benchmarks/results/coverage-crossed.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replaynoise.analysis.comparison import replicated_block  # noqa: E402
from replaynoise.analysis.conditionings import wide_frame  # noqa: E402
from replaynoise.generation.passes import draw_name  # noqa: E402
from replaynoise.settings import AnalysisSettings  # noqa: E402

#: The simulated design: about the ladder's (40 problems, 8 trunks of 5 pivots less the ineligible, K = 4, R = 3).
DESIGN = {"problems": 40, "pivots_per_problem": 25, "k": 4, "pairs": 3, "diverge": 0.3, "pivot_sd": 1.0}


def simulate_credit(
    rng: np.random.Generator,
    *,
    problems: int,
    pivots_per_problem: int,
    k: int,
    pairs: int,
    diverge: float,
    pivot_sd: float,
    pass_sd: float,
) -> dict[str, pl.DataFrame]:
    """Credit frames of exact and R draws each of replica and refeed, with no true excess."""
    n_p = rng.poisson(pivots_per_problem, problems) + 1
    problem = np.repeat(np.arange(problems), n_p)
    n = problem.size
    base = rng.uniform(0.05, 0.95, problems)[problem]
    p = np.clip(base[:, None] + rng.normal(0.0, 0.2, (n, 2)), 0.01, 0.99)  # the two branches' success
    exact = rng.random((n, 2, k)) < p[:, :, None]
    logit = np.log(diverge / (1 - diverge)) + rng.normal(0.0, pivot_sd, n)
    frames = {"exact": exact}
    for base_pass in ("replica", "refeed"):
        for r in range(1, pairs + 1):
            chance = 1 / (1 + np.exp(-(logit + rng.normal(0.0, pass_sd))))
            moved = rng.random((n, 2, k)) < chance[:, None, None]
            fresh = rng.random((n, 2, k)) < p[:, :, None]
            frames[draw_name(base_pass, r)] = np.where(moved, fresh, exact)
    ids = [f"p{i}" for i in range(n)]
    problems_ids = [f"q{j}" for j in problem]
    credit = {}
    for name, outcome in frames.items():
        orig, sub = outcome[:, 0].sum(axis=1), outcome[:, 1].sum(axis=1)
        credit[name] = pl.DataFrame(
            {
                "pivot_id": ids,
                "problem_id": problems_ids,
                "margin": np.zeros(n),
                "t": np.zeros(n, dtype=np.int64),
                "k": np.full(n, k),
                "n_orig_correct": orig,
                "n_sub_correct": sub,
                "eligible": np.ones(n, dtype=bool),
                "a_hat": (orig - sub) / k,
            }
        )
    return credit


def coverage(sims: int, pass_sd: float, seed: int = 0, n_boot: int = 200, ci: float = 0.95, **design: float) -> dict:
    """The share of ``sims`` simulated runs whose crossed and problem-only 95% intervals of the main-set excess
    hold zero, and how wide they are, at a pass-level SD of ``pass_sd`` (logit scale)."""
    settings = {**DESIGN, **design}
    rng = np.random.default_rng(seed)
    hits = {"crossed": 0, "problem_only": 0}
    widths = {"crossed": [], "problem_only": []}
    pass_sds = []
    pairs = [(draw_name("replica", r), draw_name("refeed", r)) for r in range(1, settings["pairs"] + 1)]
    for i in range(sims):
        credit = simulate_credit(rng, pass_sd=pass_sd, **settings)
        block = replicated_block(
            wide_frame(credit),
            "main",
            pairs,
            AnalysisSettings(
                theta=0.5,
                n_boot=n_boot,
                min_eligible=1,
                ci=ci,
                metric="sign",
                margin_split=0.3,
                eligibility="graded",
                seed=i,
            ),
        )
        excess = block["excess_pp"]
        for key in hits:
            lo, hi = excess[key]["ci_lo"], excess[key]["ci_hi"]
            hits[key] += lo <= 0 <= hi
            widths[key].append(hi - lo)
        pass_sds.append(excess["crossed"]["components"]["pass_sd"])
    return {
        "sims": sims,
        "pass_sd_logit": pass_sd,
        "design": settings,
        "ci": ci,
        "n_boot": n_boot,
        "seed": seed,
        "coverage": {key: hits[key] / sims for key in hits},
        "median_width_pp": {key: float(np.median(w)) for key, w in widths.items()},
        "median_pass_sd_pp": float(np.median(pass_sds)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sims", type=int, default=2000)
    args = ap.parse_args()
    start = time.time()
    runs = [coverage(args.sims, pass_sd, seed=s) for s, pass_sd in enumerate((0.0, 0.25, 0.5, 1.0))]
    record = {
        "what": __doc__.split("\n")[0],
        "command": f"python benchmarks/coverage.py {args.out} --sims {args.sims}",
        "seconds": round(time.time() - start, 1),
        "runs": runs,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for run in runs:
        print(
            f"pass SD {run['pass_sd_logit']:.2f} (logit): coverage crossed {run['coverage']['crossed']:.3f}, "
            f"problem-only {run['coverage']['problem_only']:.3f}; median width "
            f"{run['median_width_pp']['crossed']:.1f} / {run['median_width_pp']['problem_only']:.1f} pp"
        )


if __name__ == "__main__":
    main()
