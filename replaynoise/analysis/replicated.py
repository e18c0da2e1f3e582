"""Replicated passes: an interval for the excess that covers the pass-to-pass noise as well as the problems'.

One pass draws one batch schedule, one compile and one scheduler state, shared by every row it runs. A problem
bootstrap resamples pivots within that one draw, so it cannot see a component common to the whole pass: with
one replica and one re-feed, a pass that happened to land high or low is read as an effect. With R draws of
``replica`` and of ``refeed`` (``replay.replicates``) the excess is estimated over R pairs, (replica draw r,
re-feed draw r), and its variance has three parts (docs/method.md section 4, "Replicated passes"):

    e[p, r] = u[p] + v[r] + w[p, r]      (problems p = 1..G crossed with pairs r = 1..R)

u is the problem's own excess (which problems were drawn), v the pair's pass-level component (which schedules
were drawn), w the rest (each pivot's continuations in that draw). The estimate is the pooled ratio over every
pair's conditioning set; its linearised residuals e[p, r] form a G x R table without replication, and the
method-of-moments (ANOVA) estimators of the crossed random-effects model give

    Var(estimate) = sigma_u^2 / G + sigma_v^2 / R + sigma_w^2 / (G R),

each component from the mean squares of problems, pairs and their interaction, a negative one set to 0, and the
interval a t with Satterthwaite's degrees of freedom (between R - 1 when the pass component dominates and about
G - 1 when it is absent). tests/test_crossed.py simulates passes with a known pass-level component and no true
excess and checks that this interval covers zero at its level, where the problem bootstrap does not.

Pure numpy and scipy: the analysis (``replaynoise.analysis.comparison``) builds the pairs' sets from credit frames and
calls this, and so does the coverage simulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as sps

from replaynoise.analysis.paper_stats import Clusters, json_number, per_problem_t, ratio_stat


@dataclass(frozen=True)
class Components:
    """The crossed model's variance components (in units of the ratio estimated) and the table they came from.

    ``pivots_per_cell`` is the mean number of pivots a problem has in a pair's set (the linearisation's scale),
    so a planned design of other G and R keeps the pilot's yield of pivots per problem."""

    problem: float
    pass_level: float
    residual: float
    n_problems: int
    n_pairs: int
    mean_squares: tuple[float, float, float]

    def variance(self, n_problems: int | None = None, n_pairs: int | None = None) -> float:
        """Var(estimate) at a design of G problems and R pairs (default: the run's own). At the run's design it is
        the unrestricted ANOVA estimator (MS_problems + MS_pairs - MS_residual) / (G R), each mean square first
        raised to at least MS_residual (a component is never negative); at another design, the components'
        expectation."""
        g = self.n_problems if n_problems is None else n_problems
        r = self.n_pairs if n_pairs is None else n_pairs
        ms_p, ms_r, ms_e = self.expected_mean_squares(g, r)
        return (ms_p + ms_r - ms_e) / (g * r)

    def expected_mean_squares(self, g: int, r: int) -> tuple[float, float, float]:
        """The mean squares of problems, pairs and residual (each at least the residual's) at G x R: the observed
        ones at the run's own design, their expectation under the components at another."""
        if (g, r) == (self.n_problems, self.n_pairs):
            ms_p, ms_r, ms_e = self.mean_squares
        else:
            ms_e = self.residual
            ms_p, ms_r = ms_e + r * self.problem, ms_e + g * self.pass_level
        return max(ms_p, ms_e), max(ms_r, ms_e), ms_e

    def df(self, n_problems: int | None = None, n_pairs: int | None = None) -> float:
        """Satterthwaite's degrees of freedom of ``variance``. They are those of the unrestricted estimator, so
        a pass component estimated at zero from R - 1 degrees of freedom still widens the interval: with three
        pairs a zero cannot be told from a pass-level SD of several points (tests/test_crossed.py)."""
        g = self.n_problems if n_problems is None else n_problems
        r = self.n_pairs if n_pairs is None else n_pairs
        return satterthwaite_df(*self.expected_mean_squares(g, r), g, r)


def cell_sums(codes: np.ndarray, n_groups: int, masks: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(S, N): per problem and pair, the sum of ``values`` over the pair's set and the set's size (G x R)."""
    masks = np.asarray(masks, dtype=bool)
    values = np.asarray(values, dtype=np.float64)
    r = masks.shape[0]
    s = np.zeros((n_groups, r))
    n = np.zeros((n_groups, r))
    for j in range(r):
        s[:, j] = np.bincount(codes, weights=np.where(masks[j], values[j], 0.0), minlength=n_groups)
        n[:, j] = np.bincount(codes, weights=masks[j].astype(np.float64), minlength=n_groups)
    return s, n


def satterthwaite_df(ms_p: float, ms_r: float, ms_e: float, g: int, r: int) -> float:
    """Degrees of freedom of MS_p + MS_r - MS_e (mean squares of G - 1, R - 1 and (G - 1)(R - 1) degrees of
    freedom): Satterthwaite (1946)."""
    total = ms_p + ms_r - ms_e
    denominator = ms_p**2 / (g - 1) + ms_r**2 / (r - 1) + ms_e**2 / ((g - 1) * (r - 1))
    return float(total * total / denominator) if total > 0 and denominator > 0 else float(r - 1)


def table_mean_squares(e: np.ndarray) -> tuple[float, float, float]:
    """The mean squares of rows, columns and their interaction of a two-way table without replication (G x C)."""
    g, r = e.shape
    grand = e.mean()
    rows, cols = e.mean(axis=1), e.mean(axis=0)
    ms_p = r * float(((rows - grand) ** 2).sum()) / (g - 1)
    ms_r = g * float(((cols - grand) ** 2).sum()) / (r - 1)
    ms_e = float(((e - rows[:, None] - cols[None, :] + grand) ** 2).sum()) / ((g - 1) * (r - 1))
    return ms_p, ms_r, ms_e


def table_components(e: np.ndarray) -> Components:
    """The crossed model's components of a G x C table of linearised values (rows: problems; columns: pairs, or
    runs), each from its mean square over the interaction's, never negative."""
    g, r = e.shape
    ms_p, ms_r, ms_e = table_mean_squares(e)
    return Components(
        problem=_excess_over(ms_p, ms_e) / r,
        pass_level=_excess_over(ms_r, ms_e) / g,
        residual=ms_e,
        n_problems=g,
        n_pairs=r,
        mean_squares=(ms_p, ms_r, ms_e),
    )


def linearised(s: np.ndarray, n: np.ndarray) -> tuple[float, np.ndarray]:
    """The pooled ratio sum(S)/sum(N) and its linearised residuals per cell, scaled so that their mean over the G x R
    cells is the ratio's first-order error."""
    g, r = s.shape
    total = n.sum()
    estimate = float(s.sum() / total)
    return estimate, (s - estimate * n) / (total / (g * r))


def components(s: np.ndarray, n: np.ndarray) -> tuple[float, Components]:
    """The pooled ratio sum(S)/sum(N) and the crossed model's components of its linearised residuals."""
    estimate, e = linearised(s, n)
    return estimate, table_components(e)


def _excess_over(ms: float, ms_e: float) -> float:
    """MS - MS_residual, 0 where it is not positive or is rounding alone: two mean squares of one value summed in
    another order differ in their last bits, and a component of 1e-19 would set Satterthwaite's degrees of freedom
    to 0 and its interval to NaN (the ladder's SmolLM2 main set, where every pair's excess is nearly the same)."""
    diff = ms - ms_e
    return diff if diff > 1e-9 * max(abs(ms), abs(ms_e)) else 0.0


def level_interval(ms: float, ms_e: float, df: int, df_e: int, per_level: int, ci: float) -> dict[str, float | None]:
    """A component's F test (MS / MS_residual on df, df_e) and its interval. The upper end is the chi-square bound
    of MS / per_level, which bounds the component plus the residual's share of it (conservative, finite with few
    levels). A lower end (Satterthwaite's for (MS - MS_residual) / per_level) is given only where the F test rejects
    at the interval's level: otherwise a zero component is not excluded and only the upper bound is reported."""
    out: dict[str, float | None] = {"ci_lo": None, "ci_hi": None, "f": None, "p": None, "df": df, "df_residual": df_e}
    if df < 1 or df_e < 1 or per_level < 1:
        return out
    alpha = 1.0 - ci
    out["ci_hi"] = float(df * ms / (per_level * sps.chi2.ppf(alpha / 2, df)))
    if ms_e > 0:
        out["f"] = float(ms / ms_e)
        out["p"] = float(sps.f.sf(out["f"], df, df_e))
    elif ms > 0:
        out["p"] = 0.0
    if out["p"] is None or out["p"] >= alpha:
        return out
    diff = _excess_over(ms, ms_e)
    nu = (ms - ms_e) ** 2 / (ms**2 / df + ms_e**2 / df_e)
    quantile = float(sps.chi2.ppf(1 - alpha / 2, nu)) if diff > 0 and nu > 0 else 0.0
    out["ci_lo"] = nu * diff / (per_level * quantile) if quantile > 0 and math.isfinite(quantile) else 0.0
    return out


def pass_level_interval(comp: Components, ci: float) -> dict[str, float | None]:
    """The pass-level variance's F test and interval (``level_interval`` over MS_pairs, with R - 1 and
    (G - 1)(R - 1) degrees of freedom); all None where a design of one pair or one problem has no such test."""
    _, ms_r, ms_e = comp.mean_squares
    g, r = comp.n_problems, comp.n_pairs
    return level_interval(ms_r, ms_e, r - 1, (g - 1) * (r - 1), g, ci)


def scaled_sd(variance: float | None, scale: float) -> float | None:
    """sqrt(variance) * scale for JSON, None for a variance there is none of."""
    return None if variance is None else json_number(scale * math.sqrt(variance))


def crossed_interval(s: np.ndarray, n: np.ndarray, ci: float, scale: float = 1.0) -> dict[str, Any]:
    """The pooled ratio over pairs with its crossed (problems x pairs) interval, and the components behind it."""
    g, r = s.shape
    out: dict[str, Any] = {
        "estimate": None,
        "ci_lo": None,
        "ci_hi": None,
        "se": None,
        "df": None,
        "n_problems": g,
        "n_pairs": r,
    }
    if n.sum() <= 0:
        out["reason"] = "empty sets"
        return out
    if g < 2 or r < 2:
        out["estimate"] = json_number(scale * s.sum() / n.sum())
        out["reason"] = "fewer than 2 problems or 2 pairs: the crossed variance needs both"
        return out
    estimate, comp = components(s, n)
    se = math.sqrt(comp.variance())
    df = comp.df()
    half = float(sps.t.ppf(0.5 + ci / 2, df)) * se
    test = pass_level_interval(comp, ci)
    out.update(
        estimate=json_number(scale * estimate),
        se=json_number(scale * se),
        df=json_number(df),
        ci_lo=json_number(scale * (estimate - half)),
        ci_hi=json_number(scale * (estimate + half)),
        components={
            "problem_sd": json_number(scale * math.sqrt(comp.problem)),
            "pass_sd": json_number(scale * math.sqrt(comp.pass_level)),
            "pass_sd_ci_lo": scaled_sd(test["ci_lo"], scale),
            "pass_sd_ci_hi": scaled_sd(test["ci_hi"], scale),
            "pass_test": {"f": json_number(test["f"]), "p": json_number(test["p"]), "df": [r - 1, (g - 1) * (r - 1)]},
            "residual_sd": json_number(scale * math.sqrt(comp.residual)),
            "mean_squares": {
                "problems": comp.mean_squares[0],
                "pairs": comp.mean_squares[1],
                "residual": comp.mean_squares[2],
            },
            "share_pass": json_number((comp.pass_level / r) / comp.variance()) if comp.variance() > 0 else None,
        },
    )
    return out


def _resolved(stat: dict) -> bool | None:
    lo, hi = stat.get("ci_lo"), stat.get("ci_hi")
    return None if lo is None or hi is None else bool(lo > 0 or hi < 0)


def crossed_difference(a: dict, b: dict, ci: float) -> dict[str, Any]:
    """``a - b`` of two runs' crossed intervals (``crossed_interval``), with a Welch-Satterthwaite interval. It takes
    the runs as independent: their draws are, but runs over one problem list share their problems, and where the
    problems' excesses go together across the runs a joint model's interval would be narrower (wider where they go
    against each other). A run without a crossed interval gives the difference of the estimates alone, with why."""
    out: dict[str, Any] = {"estimate": None, "ci_lo": None, "ci_hi": None, "se": None, "df": None, "resolved": None}
    if a.get("estimate") is not None and b.get("estimate") is not None:
        out["estimate"] = json_number(a["estimate"] - b["estimate"])
    missing = [
        f"the {side} run's ({x.get('reason') or 'no standard error or degrees of freedom'})"
        for side, x in (("first", a), ("second", b))
        if x.get("se") is None or x.get("df") is None
    ]
    if missing:
        return {**out, "reason": "no crossed interval in " + " and ".join(missing)}
    for side, x in (("first", a), ("second", b)):
        if x["se"] < 0 or x["df"] <= 0:
            raise ValueError(f"the {side} run's crossed interval has se {x['se']} and df {x['df']}: se >= 0, df > 0")
    variance = a["se"] ** 2 + b["se"] ** 2
    spread = a["se"] ** 4 / a["df"] + b["se"] ** 4 / b["df"]
    df = variance**2 / spread if spread > 0 else math.inf
    half = float(sps.t.ppf(0.5 + ci / 2, df)) * math.sqrt(variance)
    out.update(
        se=json_number(math.sqrt(variance)),
        df=json_number(df),
        ci_lo=json_number(out["estimate"] - half),
        ci_hi=json_number(out["estimate"] + half),
    )
    return {**out, "resolved": _resolved(out)}


def replicated_stats(
    codes: np.ndarray,
    masks: np.ndarray,
    refeed_flips: np.ndarray,
    floor_flips: np.ndarray,
    *,
    ci: float,
    n_boot: int,
    seed: int,
) -> dict[str, Any]:
    """The excess, the re-feed rate and the floor over R pairs (rows of ``masks`` and the flip arrays: one pair
    each; columns: the pivots, of problems ``codes``): each with the crossed interval (``crossed``) and, beside it,
    the problem bootstrap of the same pooled ratio (``problem_only``: the draws held fixed, the interval a run of
    one draw per pass reports), the paper's per-problem t over the pairs' sets, and each pair's own excess.
    Problems with no pivot in any pair's set take no part (as a conditioning's clusters are its own problems)."""
    masks = np.asarray(masks, dtype=bool)
    used = masks.any(axis=0)
    masks = masks[:, used]
    f = np.asarray(refeed_flips, dtype=np.float64)[:, used]
    g_flips = np.asarray(floor_flips, dtype=np.float64)[:, used]
    labels, codes = np.unique(np.asarray(codes)[used], return_inverse=True)
    n_groups = int(labels.size)
    z = f - g_flips
    clusters = Clusters(codes=codes, n_groups=n_groups, n_boot=n_boot, seed=seed)
    out: dict[str, Any] = {
        "n_pairs": int(masks.shape[0]),
        "n_per_pair": [int(m.sum()) for m in masks],
        "n_problems": n_groups,
    }
    for key, values, scale in (("excess_pp", z, 100.0), ("refeed", f, 1.0), ("floor", g_flips, 1.0)):
        s, n = cell_sums(codes, n_groups, masks, values)
        crossed = crossed_interval(s, n, ci, scale)
        boot = ratio_stat(
            np.where(masks, values, 0.0).sum(axis=0), masks.sum(axis=0).astype(np.float64), clusters, ci, scale
        )
        out[key] = {"estimate": crossed["estimate"], "crossed": crossed, "problem_only": boot}
    out["resolved"] = _resolved(out["excess_pp"]["crossed"])
    rows = np.concatenate([np.flatnonzero(m) for m in masks]) if masks.size else np.array([], dtype=np.int64)
    pair = np.concatenate([np.full(int(m.sum()), j) for j, m in enumerate(masks)]) if masks.size else rows
    out["per_problem_t"] = per_problem_t(f[pair, rows], g_flips[pair, rows], codes[rows])
    out["pairs"] = [
        ratio_stat(np.where(m, zr, 0.0), m.astype(np.float64), clusters, ci, 100.0) for m, zr in zip(masks, z)
    ]
    return out


def power_to_resolve(excess_pp: float, se: float, t: float) -> float:
    """P(|estimate| / SE > t) at a true excess of ``excess_pp``. A pilot whose excess has no variance (every pair's
    excess equal) gives SE 0 and an undefined t, so it is refused rather than read as certain power."""
    if not math.isfinite(excess_pp):
        raise ValueError(f"a true excess of {excess_pp} pp: not a finite number")
    if not (math.isfinite(se) and se > 0 and math.isfinite(t)):
        raise ValueError(
            f"the pilot's variance components give an SE of {100 * se:.3g} pp and t {t:.3g}: a pilot whose excess "
            "has no variance cannot estimate one, so no design can be planned from it"
        )
    return float(sps.norm.cdf(abs(excess_pp / 100.0) / se - t))


def plan(
    comp: Components, excess_pp: float, *, problems: Sequence[int], pairs: Sequence[int], ci: float, power: float = 0.8
) -> list[dict[str, Any]]:
    """Power of the crossed interval to exclude zero at a true excess of ``excess_pp`` (pp), for each design of G
    problems and R pairs: the normal approximation P(|estimate| / SE > t), with the pilot's components (same
    pivots per problem, same pass-level noise) and the design's Satterthwaite df. A design of one pair cannot
    estimate the pass-level component, so none is planned."""
    rows = []
    for r in pairs:
        if r < 2:
            raise ValueError("a design of one pair per pass cannot estimate the pass-level component; plan R >= 2")
        for g in problems:
            se = math.sqrt(comp.variance(g, r))
            t = float(sps.t.ppf(0.5 + ci / 2, comp.df(g, r)))
            achieved = power_to_resolve(excess_pp, se, t)
            rows.append(
                {
                    "problems": int(g),
                    "pairs": int(r),
                    "se_pp": 100 * se,
                    "df": comp.df(g, r),
                    "half_width_pp": 100 * t * se,
                    "power": achieved,
                    "enough": achieved >= power,
                }
            )
    return rows
