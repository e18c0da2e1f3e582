"""Does the stopped interval keep its coverage? A simulation of the stopping rule (``analysis.stopping``).

Two studies, both run through the workflow's own functions (``stopping.replay`` over ``replicated.crossed_interval``):

* ``cells``: runs simulated at the level the rule reads, the G x R cell sums of the excess, with the true excess
  known exactly. Problem p has a floor flip rate b_p (uniform 0.08 to 0.18) and a re-feed flip rate
  b_p + d + u_p, u_p the problem's own excess (uniform, mean 0, SD ``problem_sd``); each replica and each re-feed
  draw r shifts every pivot's rate by its own pass-level component (uniform, mean 0, SD ``pass_sd`` pp per draw, so a
  pair's excess moves with SD sqrt(2) ``pass_sd``). A cell of n pivots (1 + Poisson) has binomial flip counts. No
  rate leaves [0, 1] at the studied settings, so the pooled excess's target is exactly d. The design is about the
  ladder's 1.5B rung (44 problems, about 12 main-set pivots per problem and pair).
* ``credit``: the pass study's simulation (benchmarks/coverage.py, ``simulate_credit``: pivots, continuations and
  pass draws sharing a divergence shift, no true excess) with five pairs, read by ``runs.run_cells`` as a reference
  is. Slower, so fewer runs.

For each setting the rule (min_pairs 2, max_pairs 5; ``resolved``, and ``bounded`` at 4 pp) is replayed with the
spent-alpha correction and naively (every look at 95%), beside the fixed design of five pairs. The record gives each
one's coverage of the true excess, its share resolved, its mean pairs used and its median half-width at the stop.

    python benchmarks/stopping.py OUT.json [--sims 2000] [--credit-sims 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from coverage import DESIGN, simulate_credit  # noqa: E402

from replaynoise.analysis.replicated import crossed_interval  # noqa: E402
from replaynoise.analysis.runs import run_cells  # noqa: E402
from replaynoise.analysis.stopping import StopRule, replay  # noqa: E402

CELLS = {"problems": 44, "pivots_per_cell": 11, "problem_sd_pp": 2.0, "floor_rate": (0.08, 0.18)}
RULES = {
    "resolved": StopRule("resolved", max_pairs=5, min_pairs=2, half_width_pp=4.0),
    "bounded": StopRule("bounded", max_pairs=5, min_pairs=2, half_width_pp=4.0),
}
CI = 0.95


def simulate_cells(rng: np.random.Generator, excess_pp: float, pass_sd_pp: float, pairs: int) -> tuple:
    """(S, N), G x R, of one simulated run (module docstring): uniform components keep every rate inside [0, 1]."""
    g = CELLS["problems"]
    half = np.sqrt(3.0) / 100.0  # a uniform of SD s (pp) spans +- sqrt(3) s
    base = rng.uniform(*CELLS["floor_rate"], g)
    own = rng.uniform(-1, 1, g) * half * CELLS["problem_sd_pp"]
    floor_shift, refeed_shift = rng.uniform(-1, 1, (2, pairs)) * half * pass_sd_pp
    n = 1 + rng.poisson(CELLS["pivots_per_cell"] - 1, (g, pairs))
    floor = rng.binomial(n, base[:, None] + floor_shift[None, :])
    refeed = rng.binomial(n, base[:, None] + excess_pp / 100.0 + own[:, None] + refeed_shift[None, :])
    return (refeed - floor).astype(np.float64), n.astype(np.float64)


def _tally(stopped: list[dict], truth_pp: float) -> dict:
    """Coverage of the truth, share resolved, mean pairs and median half-width over runs' stops (or fixed ends)."""
    covered = [x["ci_lo"] <= truth_pp <= x["ci_hi"] for x in stopped]
    return {
        "coverage": float(np.mean(covered)),
        "resolved": float(np.mean([x["verdict"] in ("+", "-") for x in stopped])),
        "mean_pairs": float(np.mean([x.get("stopped_at", RULES["resolved"].max_pairs) for x in stopped])),
        "median_half_width_pp": float(np.median([(x["ci_hi"] - x["ci_lo"]) / 2 for x in stopped])),
    }


def study(runs: list[tuple[np.ndarray, np.ndarray]], truth_pp: float) -> dict:
    """The rules (corrected and naive) and the fixed design over simulated runs' cells."""
    out: dict = {}
    for name, rule in RULES.items():
        for corrected in (True, False):
            stops = [replay(s, n, rule, CI, corrected=corrected) for s, n in runs]
            out[f"{name}_{'corrected' if corrected else 'naive'}"] = _tally(stops, truth_pp)
    fixed = []
    for s, n in runs:
        x = crossed_interval(s, n, CI, 100.0)
        lo, hi = x["ci_lo"], x["ci_hi"]
        fixed.append({**x, "verdict": "+" if lo > 0 else "-" if hi < 0 else "0"})
    out["fixed_5_pairs"] = _tally(fixed, truth_pp)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sims", type=int, default=2000, help="runs per setting of the cell study")
    ap.add_argument("--credit-sims", type=int, default=200, help="runs per pass SD of the credit study")
    args = ap.parse_args()
    start = time.time()
    cells = []
    for i, (excess, pass_sd) in enumerate((d, sd) for d in (0.0, 2.0, 5.0, 13.0) for sd in (0.0, 1.0, 2.0)):
        rng = np.random.default_rng(1000 + i)
        runs = [simulate_cells(rng, excess, pass_sd, 5) for _ in range(args.sims)]
        cells.append({"excess_pp": excess, "pass_sd_pp": pass_sd, "seed": 1000 + i, **study(runs, excess)})
        print(f"cells: excess {excess} pp, pass SD {pass_sd} pp: {json.dumps(cells[-1])}", flush=True)
    credit = []
    for i, pass_sd in enumerate((0.0, 0.5, 1.0)):
        rng = np.random.default_rng(2000 + i)
        runs = []
        for _ in range(args.credit_sims):
            frames = simulate_credit(rng, pass_sd=pass_sd, **{**DESIGN, "pairs": 5})
            got = run_cells(frames, "main", "sign")
            runs.append((got.s, got.n))
        credit.append({"excess_pp": 0.0, "pass_sd_logit": pass_sd, "seed": 2000 + i, **study(runs, 0.0)})
        print(f"credit: pass SD {pass_sd} (logit): {json.dumps(credit[-1])}", flush=True)
    record = {
        "what": __doc__.split("\n")[0],
        "command": f"python benchmarks/stopping.py {args.out} --sims {args.sims} --credit-sims {args.credit_sims}",
        "ci": CI,
        "rules": {name: vars(rule) for name, rule in RULES.items()},
        "cells_design": CELLS,
        "credit_design": {**DESIGN, "pairs": 5},
        "seconds": round(time.time() - start, 1),
        "cells": cells,
        "credit": credit,
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
