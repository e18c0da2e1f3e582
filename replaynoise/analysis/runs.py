"""Runs of one campaign combined: an interval for the excess over problems, pass draws and runs, with the run-level SD.

Within one run the crossed interval (``replicated``) covers the problems and the pass draws, but every draw of a run
shares its card, host, load and engine state, so a shift common to the whole run is read as part of the effect.
Runs of one campaign share their problems (their pivots, rollouts and pairs of draws need not match), so the run is a
factor crossed with the problems:

    m[p, k] = x + u[p] + c[k] + (uc)[p, k] + (run k's pass draws and pivots, averaged over its R_k pairs)

m[p, k] is run k's pooled excess plus problem p's mean linearised residual over the run's pairs, so that the mean of
column k is run k's own estimate. The estimate is the mean over runs, and the crossed model's estimator on this G x K
table, (MS_problems + MS_runs - MS_residual) / (G K), is unbiased for its variance whatever the runs' numbers of
pairs: the pass draws' noise enters the runs' spread. The run-level SD is sqrt((MS_runs - MS_residual) / G), the SD of
a run's true excess (its run component and its pass draws' mean), tested by F = MS_runs / MS_residual on K - 1 and
(G - 1)(K - 1) degrees of freedom; with K - 1 degrees of freedom it is poorly estimated until K is large.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
from scipy import stats as sps

from replaynoise.analysis.comparison import pair_disagreements, pair_sets
from replaynoise.analysis.conditionings import wide_frame
from replaynoise.analysis.paper_stats import json_number
from replaynoise.analysis.replicated import (
    Components,
    cell_sums,
    crossed_interval,
    level_interval,
    linearised,
    power_to_resolve,
    satterthwaite_df,
    scaled_sd,
    table_components,
)
from replaynoise.generation.passes import replicate_pairs


@dataclass(frozen=True)
class RunCells:
    """One run's excess as cell sums over its problems (rows, labelled) and its pairs of draws (columns)."""

    problems: np.ndarray
    s: np.ndarray
    n: np.ndarray
    pairs: tuple[tuple[str, str], ...]


def run_cells(credit: Mapping[str, pl.DataFrame], conditioning: str, metric: str) -> RunCells:
    """A run's excess (re-feed flips minus floor flips) per problem and pair under one conditioning, from its credit
    frames; problems with no pivot in any pair's set take no part, as in the run's own comparison."""
    pairs = replicate_pairs(sorted(credit))
    if "exact" not in credit or not pairs:
        raise ValueError(f"passes {sorted(credit)}: a run needs exact and at least one pair of replica and refeed")
    wide = wide_frame({p: credit[p] for p in ("exact", *(name for pair in pairs for name in pair))})
    masks, reason = pair_sets(wide, conditioning, pairs)
    if masks is None:
        raise ValueError(f"conditioning {conditioning!r}: {reason}")
    refeed, floor = pair_disagreements(wide, pairs, metric)
    used = masks.any(axis=0)
    labels, codes = np.unique(wide["problem_id"].to_numpy()[used], return_inverse=True)
    excess = refeed.astype(np.float64) - floor.astype(np.float64)
    s, n = cell_sums(codes, int(labels.size), masks[:, used], excess[:, used])
    return RunCells(problems=labels, s=s, n=n, pairs=tuple(pairs))


def run_table(runs: Sequence[RunCells]) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """(problem labels, the G x K table m[p, k], each run's pooled excess) over the union of the runs' problems; a
    problem a run lacks adds nothing to that run's column (its linearised residual is 0)."""
    labels = np.unique(np.concatenate([r.problems for r in runs]))
    table = np.zeros((labels.size, len(runs)))
    estimates = []
    for k, run in enumerate(runs):
        rows = np.searchsorted(labels, run.problems)
        s, n = np.zeros((labels.size, run.s.shape[1])), np.zeros((labels.size, run.s.shape[1]))
        s[rows], n[rows] = run.s, run.n
        estimate, e = linearised(s, n)
        table[:, k] = estimate + e.mean(axis=1)
        estimates.append(estimate)
    return labels, table, estimates


def combined_interval(runs: Sequence[RunCells], ci: float, scale: float = 100.0) -> dict[str, Any]:
    """The mean of the runs' excesses with its interval over problems, pass draws and runs (module docstring), each
    run's own estimate and crossed interval (where it has two pairs or more), and the run-level SD with its test."""
    if len(runs) < 2:
        raise ValueError(f"{len(runs)} run(s): combining needs two runs or more")
    labels, table, estimates = run_table(runs)
    g, k = table.shape
    per_run = [
        {
            "estimate": json_number(scale * x),
            "n_pairs": len(run.pairs),
            "pairs": [list(p) for p in run.pairs],
            "n_problems": int(run.problems.size),
            "n_per_pair": [int(v) for v in run.n.sum(axis=0)],
            "crossed": crossed_interval(run.s, run.n, ci, scale),
        }
        for run, x in zip(runs, estimates)
    ]
    out: dict[str, Any] = {"estimate": json_number(scale * float(np.mean(estimates))), "n_runs": k, "n_problems": g}
    out["shared_problems"] = int(sum(all(p in r.problems for r in runs) for p in labels))
    if g < 2:
        return {**out, "reason": "fewer than 2 problems", "runs": per_run}
    comp = table_components(table)
    se, df = math.sqrt(comp.variance()), comp.df()
    half = float(sps.t.ppf(0.5 + ci / 2, df)) * se
    ms_p, ms_k, ms_e = comp.mean_squares
    test = level_interval(ms_k, ms_e, k - 1, (g - 1) * (k - 1), g, ci)
    lo, hi = scale * (float(np.mean(estimates)) - half), scale * (float(np.mean(estimates)) + half)
    out.update(
        ci_lo=json_number(lo),
        ci_hi=json_number(hi),
        se=json_number(scale * se),
        df=json_number(df),
        resolved=bool(lo > 0 or hi < 0),
        components={
            "problem_sd": scaled_sd(comp.problem, scale),
            "run_sd": scaled_sd(comp.pass_level, scale),
            "run_sd_ci_lo": scaled_sd(test["ci_lo"], scale),
            "run_sd_ci_hi": scaled_sd(test["ci_hi"], scale),
            "run_test": {"f": json_number(test["f"]), "p": json_number(test["p"]), "df": [k - 1, (g - 1) * (k - 1)]},
            "residual_sd": scaled_sd(comp.residual, scale),
            "mean_squares": {"problems": ms_p, "runs": ms_k, "residual": ms_e},
        },
        runs=per_run,
    )
    return out


def combine_runs(
    credits: Sequence[Mapping[str, pl.DataFrame]], conditionings: Sequence[str], metric: str, ci: float
) -> dict[str, Any]:
    """``combined_interval`` of several runs' credit frames (pass name -> frame, one configuration) per conditioning."""
    return {c: combined_interval([run_cells(credit, c, metric) for credit in credits], ci) for c in conditionings}


def plan_runs(
    comp: Components,
    excess_pp: float,
    *,
    problems: Sequence[int],
    runs: Sequence[int],
    run_sd_pp: float,
    ci: float,
    power: float = 0.8,
) -> list[dict[str, Any]]:
    """Power of the combined interval (mean over K runs of G problems and the pilot's R pairs each) to exclude zero at
    a true excess of ``excess_pp``, with the pilot's components and a run-level SD of ``run_sd_pp``. The expected mean
    squares of the G x K table are MS_problems = K s_u^2 + s_w^2 / R, MS_runs = G (s_c^2 + s_v^2 / R) + s_w^2 / R and
    MS_residual = s_w^2 / R; the df are Satterthwaite's, so a plan of two runs pays for the one df of MS_runs."""
    r = comp.n_pairs
    rows = []
    for k in runs:
        if k < 2:
            raise ValueError("one run cannot estimate the run-level component; plan K >= 2 runs")
        for g in problems:
            ms_e = comp.residual / r
            ms_p = k * comp.problem + ms_e
            ms_k = g * ((run_sd_pp / 100) ** 2 + comp.pass_level / r) + ms_e
            se = math.sqrt((ms_p + ms_k - ms_e) / (g * k))
            df = satterthwaite_df(ms_p, ms_k, ms_e, g, k)
            t = float(sps.t.ppf(0.5 + ci / 2, df))
            achieved = power_to_resolve(excess_pp, se, t)
            rows.append(
                {
                    "problems": int(g),
                    "runs": int(k),
                    "pairs": r,
                    "se_pp": 100 * se,
                    "df": df,
                    "power": achieved,
                    "enough": achieved >= power,
                }
            )
    return rows
