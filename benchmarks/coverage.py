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
    python benchmarks/coverage.py OUT.json --run-sd 0 2.8 5.4 9.7 --sims 400   # a run-level shift too

With ``--run-sd`` each simulated campaign is run three times over the same problems (new pivots, new draws), and
each run's refeed draws (or, for a shift below zero, its replica draws: the two are exchangeable, so the mean over
runs of the true excess is zero) have their branches swapped with a chance shared by the run, set so that the run's
true excess has the given SD in pp. The record gives the coverage of zero by each run's own crossed interval and by
the interval over runs (``analysis.runs``) of the first two and of all three runs.

tests/test_crossed.py runs the same simulation in the fast tier; the committed record is
benchmarks/results/coverage-crossed.json, that of the run study benchmarks/results/coverage-runs.json.
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
from replaynoise.analysis.replicated import crossed_interval  # noqa: E402
from replaynoise.analysis.runs import combined_interval, run_cells  # noqa: E402
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
    swap: float = 0.0,
    swap_rng: np.random.Generator | None = None,
    problem_base: np.ndarray | None = None,
) -> dict[str, pl.DataFrame]:
    """Credit frames of exact and R draws each of replica and refeed, with no true excess unless ``swap``: each
    refeed draw's pivot (replica's where ``swap`` < 0) has its two branches swapped with chance |swap|, drawn from
    ``swap_rng`` (absent: no swap, and ``rng``'s stream is the pass study's own)."""
    n_p = rng.poisson(pivots_per_problem, problems) + 1
    problem = np.repeat(np.arange(problems), n_p)
    n = problem.size
    base = (rng.uniform(0.05, 0.95, problems) if problem_base is None else problem_base)[problem]
    p = np.clip(base[:, None] + rng.normal(0.0, 0.2, (n, 2)), 0.01, 0.99)  # the two branches' success
    exact = rng.random((n, 2, k)) < p[:, :, None]
    logit = np.log(diverge / (1 - diverge)) + rng.normal(0.0, pivot_sd, n)
    frames = {"exact": exact}
    for base_pass in ("replica", "refeed"):
        for r in range(1, pairs + 1):
            chance = 1 / (1 + np.exp(-(logit + rng.normal(0.0, pass_sd))))
            moved = rng.random((n, 2, k)) < chance[:, None, None]
            fresh = rng.random((n, 2, k)) < p[:, :, None]
            outcome = np.where(moved, fresh, exact)
            if swap_rng is not None:
                chance = abs(swap) if (swap > 0) == (base_pass == "refeed") else 0.0
                outcome = np.where((swap_rng.random(n) < chance)[:, None, None], outcome[:, ::-1], outcome)
            frames[draw_name(base_pass, r)] = outcome
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


def swap_effect(seed: int = 99, problems: int = 2000) -> float:
    """The true excess (pp, main set, sign metric) of swapping every refeed pivot: the same draws with and without
    the swap (one stream of random numbers), over many problems; a run's excess is this times its swap chance."""
    design = {**DESIGN, "problems": problems, "pairs": 1}
    excess = []
    for swap in (0.0, 1.0):
        credit = simulate_credit(
            np.random.default_rng(seed), pass_sd=0.0, swap=swap, swap_rng=np.random.default_rng(seed + 1), **design
        )
        cells = run_cells(credit, "main", "sign")
        excess.append(100 * cells.s.sum() / cells.n.sum())
    return excess[1] - excess[0]


def run_coverage(sims: int, run_sd_pp: float, effect_pp: float, seed: int = 0, ci: float = 0.95) -> dict:
    """Coverage of zero (the mean over runs of the true excess) at a run-level SD of ``run_sd_pp``: by each of three
    runs' own crossed interval, and by the interval over runs of two and of three runs."""
    rng = np.random.default_rng(seed)
    hits = {"single_run": 0, "two_runs": 0, "three_runs": 0}
    widths: dict[str, list[float]] = {key: [] for key in hits}
    for _ in range(sims):
        base = rng.uniform(0.05, 0.95, DESIGN["problems"])
        runs = []
        for _ in range(3):
            swap = float(np.clip(rng.normal(0.0, run_sd_pp) / effect_pp, -1.0, 1.0))
            credit = simulate_credit(rng, pass_sd=0.0, swap=swap, swap_rng=rng, problem_base=base, **DESIGN)
            runs.append(run_cells(credit, "main", "sign"))
        for run in runs:
            own = crossed_interval(run.s, run.n, ci, 100.0)
            hits["single_run"] += own["ci_lo"] <= 0 <= own["ci_hi"]
            widths["single_run"].append(own["ci_hi"] - own["ci_lo"])
        for key, chosen in (("two_runs", runs[:2]), ("three_runs", runs)):
            both = combined_interval(chosen, ci)
            hits[key] += both["ci_lo"] <= 0 <= both["ci_hi"]
            widths[key].append(both["ci_hi"] - both["ci_lo"])
    return {
        "sims": sims,
        "run_sd_pp": run_sd_pp,
        "seed": seed,
        "coverage": {
            "single_run": hits["single_run"] / (3 * sims),
            **{k: hits[k] / sims for k in hits if k != "single_run"},
        },
        "median_width_pp": {key: float(np.median(w)) for key, w in widths.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--sims", type=int, default=2000)
    ap.add_argument("--run-sd", type=float, nargs="+", help="run-level SDs of the true excess, pp")
    args = ap.parse_args()
    start = time.time()
    if args.run_sd:
        effect = swap_effect()
        studied = [run_coverage(args.sims, sd, effect, seed=s) for s, sd in enumerate(args.run_sd)]
        record = {
            "what": "Coverage of the mean over runs by one run's crossed interval and by the interval over runs",
            "command": f"python benchmarks/coverage.py {args.out} --run-sd {' '.join(map(str, args.run_sd))} "
            f"--sims {args.sims}",
            "design": {**DESIGN, "runs": 3, "pass_sd_logit": 0.0, "swap_effect_pp": effect},
            "ci": 0.95,
            "seconds": round(time.time() - start, 1),
            "runs": studied,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        for run in studied:
            print(f"run SD {run['run_sd_pp']:.1f} pp: coverage {run['coverage']}, widths {run['median_width_pp']}")
        return
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
