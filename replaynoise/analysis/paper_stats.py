"""The paper's statistics (arXiv 2606.15621, its harness's ``full_report``), beside which analysis.py keeps ours.

Each function is a pure function of numpy arrays or polars frames, one number set per call, so that the
analysis (``replaynoise.analysis.comparison``) can apply it to any conditioning and either disagreement metric, to our
own runs and to the paper's published records alike. A number that cannot mean anything (no problems, zero
variance, no discordant pair) is reported as ``None`` with a reason, never as a misleading value.

This module sits below analysis.py: of the package it imports only the disagreement metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats as sps
from statsmodels.regression.linear_model import OLS
from statsmodels.stats.contingency_tables import mcnemar
from statsmodels.stats.weightstats import DescrStatsW

from replaynoise.analysis.disagreement import disagree

#: Tolerance of the |Â| >= θ test; Â and lattice thresholds are exact, a user θ like 0.5 may not be.
THETA_EPS = 1e-9
#: Below this a cluster-robust SE is treated as exactly zero (it only arises from exact cancellation).
SE_ZERO = 1e-12

#: The normal 95% quantile as the paper writes it (1.96, not 1.95996...): at the paper's rounding the two give
#: different pooled lower bounds (-0.02850017 -> -0.029 vs -0.02849985 -> -0.028), so 95% uses the paper's.
PAPER_Z_95 = 1.96


def json_number(x: Any) -> float | None:
    """A JSON-safe float: numpy scalars unwrapped, NaN and infinities mapped to None."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


# --------------------------------------------------------------------------------------- kinds of change


def classify_changes(a: np.ndarray, b: np.ndarray, metric: str) -> dict:
    """Split the disagreements of a and b into zero-boundary crossings, polarity reversals and magnitude-only.

    The estimator is quantized, so a small perturbation most often moves an estimate across 0 (a token looks
    critical in one pass and neutral in the other) rather than flipping its sign. Under the sign metric a
    magnitude-only change is not a disagreement, so its count is 0 by definition. ``share`` is of the changed
    pivots; ``share_of_n`` is of all pivots, as the paper prints its polarity rates.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    changed = disagree(a, b, metric)
    a_c, b_c = a[changed], b[changed]
    crossing = (a_c == 0) ^ (b_c == 0)
    both = (a_c != 0) & (b_c != 0)
    reversal = both & (np.sign(a_c) != np.sign(b_c))
    magnitude = both & (np.sign(a_c) == np.sign(b_c))
    n, n_changed = int(a.size), int(changed.sum())
    out: dict[str, Any] = {"metric": metric, "n": n, "n_changed": n_changed}
    for key, mask in (("zero_crossing", crossing), ("reversal", reversal), ("magnitude", magnitude)):
        count = int(mask.sum())
        out[key] = {
            "count": count,
            "share": json_number(count / n_changed) if n_changed else None,
            "share_of_n": json_number(count / n) if n else None,
        }
    if not n_changed:
        out["reason"] = "no changed estimates: shares undefined"
    return out


# ------------------------------------------------------------------------------------ the paper's tests


def per_problem_t(refeed_flips: np.ndarray, floor_flips: np.ndarray, groups: np.ndarray) -> dict:
    """The paper's problem-clustered t: a one-sample t over per-problem rate differences, each problem once.

    d_p = (re-feed flips - floor flips) / n_p for every problem with at least one pivot in the set. Weighting
    problems equally (not pivots, as our OLS on a constant does) is why it differs from ours on the same data
    (pooled: 5.51 vs 4.98). The sign count says in how many problems re-feed is worse, the floor is worse, or
    neither.
    """
    refeed_flips = np.asarray(refeed_flips, dtype=np.float64)
    floor_flips = np.asarray(floor_flips, dtype=np.float64)
    labels, codes = np.unique(np.asarray(groups), return_inverse=True)
    g = int(labels.size)
    out: dict[str, Any] = {
        "t": None,
        "df": None,
        "p": None,
        "mean": None,
        "se": None,
        "n_problems": g,
        "problems_refeed_worse": None,
        "problems_floor_worse": None,
        "problems_equal": None,
    }
    if g == 0:
        out["reason"] = "no problems"
        return out
    n_p = np.bincount(codes, minlength=g)
    d = (
        np.bincount(codes, weights=refeed_flips, minlength=g) - np.bincount(codes, weights=floor_flips, minlength=g)
    ) / n_p
    out.update(
        mean=json_number(d.mean()),
        problems_refeed_worse=int((d > 0).sum()),
        problems_floor_worse=int((d < 0).sum()),
        problems_equal=int((d == 0).sum()),
    )
    if g < 2:
        out["reason"] = "fewer than 2 problems: t undefined"
        return out
    out["df"] = g - 1
    if np.all(d == d[0]):
        out.update(se=0.0, reason="all per-problem differences equal: SE is 0, t undefined")
        return out
    desc = DescrStatsW(d)
    t, p, _ = desc.ttest_mean(0.0)
    out.update(t=json_number(t), p=json_number(p), se=json_number(desc.std_mean))
    return out


def mcnemar_z(refeed_flips: np.ndarray, floor_flips: np.ndarray) -> dict:
    """McNemar's test of the paired flips (unclustered), as the paper computes it.

    b = re-feed flips where the replica agrees, c = replica flips where the re-feed agrees; z = (b-c)/sqrt(b+c).
    The exact binomial p (statsmodels) is given beside it. Pivots of one problem are not independent, so this
    z overstates the evidence; it is reported because the paper's table has it.
    """
    r = np.asarray(refeed_flips, dtype=bool)
    f = np.asarray(floor_flips, dtype=bool)
    b, c = int((r & ~f).sum()), int((~r & f).sum())
    out: dict[str, Any] = {"b": b, "c": c, "z": None, "p_exact": None, "n": int(r.size)}
    if b + c == 0:
        out["reason"] = "no discordant pivots: z undefined"
        return out
    out["z"] = json_number((b - c) / math.sqrt(b + c))
    out["p_exact"] = json_number(mcnemar([[0, b], [c, 0]], exact=True).pvalue)
    return out


def mean_zero_unclustered(d: np.ndarray, ci: float) -> dict:
    """The paper's mean-zero test of d_i = Â^refeed - Â^exact: mean, plain SE, t, normal CI, no clustering.

    Kept beside our cluster-robust version because the two answer the same question with different
    independence assumptions (pooled: t -1.23 unclustered vs -1.43 clustered). At ci = 0.95 the interval uses
    the paper's z = 1.96 (``PAPER_Z_95``), at any other level the exact normal quantile.
    """
    d = np.asarray(d, dtype=np.float64)
    n = int(d.size)
    out: dict[str, Any] = {"mean": None, "se": None, "t": None, "p": None, "ci_lo": None, "ci_hi": None, "n": n}
    if n == 0:
        out["reason"] = "no observations"
        return out
    out["mean"] = json_number(d.mean())
    if n < 2:
        out["reason"] = "fewer than 2 observations: SE undefined"
        return out
    if np.all(d == d[0]):
        out.update(se=0.0, reason="all values equal: SE is 0, t undefined")
        return out
    desc = DescrStatsW(d)
    se = float(desc.std_mean)
    half = (PAPER_Z_95 if ci == 0.95 else sps.norm.ppf(0.5 + ci / 2)) * se
    t = d.mean() / se
    out.update(
        se=json_number(se),
        t=json_number(t),
        p=json_number(2 * sps.norm.sf(abs(t))),
        ci_lo=json_number(d.mean() - half),
        ci_hi=json_number(d.mean() + half),
    )
    return out


def margin_split(margin: np.ndarray, refeed_flips: np.ndarray, floor_flips: np.ndarray, split: float) -> dict:
    """Re-feed and floor rates below ``split`` and at or above it (the paper: a 0.3 gap, in its margin's unit)."""
    margin = np.asarray(margin, dtype=np.float64)
    r = np.asarray(refeed_flips, dtype=np.float64)
    f = np.asarray(floor_flips, dtype=np.float64)
    out: dict[str, Any] = {"split": float(split)}
    for key, mask in (("below", margin < split), ("at_or_above", margin >= split)):
        n = int(mask.sum())
        refeed = json_number(r[mask].mean()) if n else None
        floor = json_number(f[mask].mean()) if n else None
        out[key] = {
            "n": n,
            "refeed": refeed,
            "floor": floor,
            "excess_pp": json_number(100 * (r[mask].mean() - f[mask].mean())) if n else None,
        }
    return out


def eligibility_sources(exact: np.ndarray, replica: np.ndarray, refeed: np.ndarray) -> dict:
    """Pivots nonzero in exactly one pass: under the paper's main conditioning the re-feed (or the replica)
    alone can make a pivot eligible, which is why the paper adds the treatment-independent conditioning."""
    nz = {
        name: np.asarray(v, dtype=np.float64) != 0
        for name, v in (("exact", exact), ("replica", replica), ("refeed", refeed))
    }
    only = {}
    for name, mask in nz.items():
        first, second = (m for o, m in nz.items() if o != name)
        only[name] = int((mask & ~first & ~second).sum())
    return {
        "n": int(nz["exact"].size),
        "only_refeed": only["refeed"],
        "only_replica": only["replica"],
        "only_exact": only["exact"],
    }


# ------------------------------------------------------------------------------------- cluster bootstrap


@dataclass
class Clusters:
    """Problem clusters of a pivot set and the bootstrap resampling counts over them.

    Every statistic here is a ratio of sums over pivots, so a bootstrap replicate is
    (counts @ per-problem numerator sums) / (counts @ per-problem denominator sums): one count matrix serves
    all statistics of a block and keeps them on the same resamples.
    """

    codes: np.ndarray
    n_groups: int
    n_boot: int
    seed: int
    _counts: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def from_ids(cls, problem_ids: Sequence[str], n_boot: int, seed: int) -> Clusters:
        labels = sorted(set(problem_ids))
        index = {p: i for i, p in enumerate(labels)}
        codes = np.fromiter((index[p] for p in problem_ids), dtype=np.int64, count=len(problem_ids))
        return cls(codes=codes, n_groups=len(labels), n_boot=n_boot, seed=seed)

    @property
    def counts(self) -> np.ndarray:
        """(n_boot, G) multiplicities of each problem in each resample, fixed by the seed."""
        if self._counts is None:
            g, b = self.n_groups, self.n_boot
            rng = np.random.default_rng(self.seed)
            draws = rng.integers(0, g, size=(b, g)) + (np.arange(b) * g)[:, None]
            self._counts = np.bincount(draws.ravel(), minlength=b * g).reshape(b, g).astype(np.float64)
        return self._counts

    def group_sums(self, values: np.ndarray) -> np.ndarray:
        return np.bincount(self.codes, weights=np.asarray(values, dtype=np.float64), minlength=self.n_groups)

    def replicates(self, num: np.ndarray, den: np.ndarray) -> np.ndarray:
        """Bootstrap replicates of sum(num)/sum(den); NaN where a resample has a zero denominator."""
        top = self.counts @ self.group_sums(num)
        bottom = self.counts @ self.group_sums(den)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(bottom > 0, top / np.where(bottom > 0, bottom, 1.0), np.nan)


def ratio_stat(num: np.ndarray, den: np.ndarray, clusters: Clusters, ci: float, scale: float = 1.0) -> dict:
    """sum(num)/sum(den) (times ``scale``) with a percentile cluster-bootstrap CI."""
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    out: dict[str, Any] = {"estimate": None, "ci_lo": None, "ci_hi": None}
    if den.sum() <= 0:
        out["reason"] = "empty denominator"
        return out
    out["estimate"] = json_number(scale * num.sum() / den.sum())
    if clusters.n_groups < 2 or clusters.n_boot < 1:
        out["ci_reason"] = "fewer than 2 problems: no bootstrap interval"
        return out
    reps = clusters.replicates(num, den)
    valid = reps[np.isfinite(reps)]
    if valid.size < clusters.n_boot:
        out["n_boot_valid"] = int(valid.size)
    if valid.size == 0:
        out["ci_reason"] = "no bootstrap resample had a defined value"
        return out
    alpha = 1.0 - ci
    lo, hi = np.quantile(valid, [alpha / 2, 1 - alpha / 2])
    out["ci_lo"], out["ci_hi"] = json_number(scale * lo), json_number(scale * hi)
    return out


# ------------------------------------------------------------------------------- clustered OLS on a constant


def cluster_ols_mean(y: np.ndarray, groups: np.ndarray, ci: float) -> dict:
    """Mean of ``y`` by OLS on a constant with cluster-robust SE (statsmodels, t with G-1 df).

    statsmodels applies the small-sample factor G/(G-1) * (N-1)/(N-k); with a constant only (k=1) that is
    G/(G-1). A zero SE (all values equal, or exact cancellation) leaves t and p undefined: reported as None.
    """
    y = np.asarray(y, dtype=np.float64)
    groups = np.asarray(groups)
    n = int(y.size)
    n_clusters = int(np.unique(groups).size) if n else 0
    out: dict[str, Any] = {
        "coef": None,
        "se": None,
        "t": None,
        "p": None,
        "ci_lo": None,
        "ci_hi": None,
        "df": None,
        "n": n,
        "n_clusters": n_clusters,
    }
    if n == 0:
        out["reason"] = "no observations"
        return out
    out["coef"] = json_number(y.mean())
    if n_clusters < 2:
        out["reason"] = "fewer than 2 clusters: cluster-robust SE undefined"
        return out
    if np.all(y == y[0]):
        out.update(se=0.0, df=n_clusters - 1, reason="all values equal: SE is 0, t undefined")
        return out
    codes = np.unique(groups, return_inverse=True)[1]
    res = OLS(y, np.ones((n, 1))).fit(cov_type="cluster", cov_kwds={"groups": codes}, use_t=True)
    se = float(res.bse[0])
    out["df"] = n_clusters - 1
    if se < SE_ZERO:
        out.update(se=0.0, reason="cluster sums of residuals cancel exactly: SE is 0, t undefined")
        return out
    lo, hi = res.conf_int(alpha=1.0 - ci)[0]
    out.update(
        coef=json_number(res.params[0]),
        se=json_number(se),
        t=json_number(res.tvalues[0]),
        p=json_number(res.pvalues[0]),
        ci_lo=json_number(lo),
        ci_hi=json_number(hi),
    )
    return out


# -------------------------------------------------------------------------------------------- selection


def jaccard(s_a: np.ndarray, s_b: np.ndarray) -> float | None:
    """|A ∩ B| / |A ∪ B| of two membership masks; None for two empty sets (overlap undefined)."""
    s_a = np.asarray(s_a, dtype=bool)
    s_b = np.asarray(s_b, dtype=bool)
    union = int((s_a | s_b).sum())
    return None if union == 0 else int((s_a & s_b).sum()) / union


def critical_set(a_hat: np.ndarray, theta: float) -> np.ndarray:
    """S = {pivots with |Â| >= θ}: the tokens a critical-token method would select."""
    return np.abs(np.asarray(a_hat, dtype=np.float64)) >= theta - THETA_EPS


def _jaccard_stat(s_a: np.ndarray, s_b: np.ndarray, clusters: Clusters, ci: float) -> dict:
    inter = (s_a & s_b).astype(np.float64)
    union = (s_a | s_b).astype(np.float64)
    if union.sum() == 0:
        return {"estimate": None, "ci_lo": None, "ci_hi": None, "reason": "empty sets"}
    return ratio_stat(inter, union, clusters, ci)


def selection_at(a: dict[str, np.ndarray], theta: float, clusters: Clusters, ci: float) -> dict:
    """Jaccard of the re-feed selection with the exact one, against the replica ceiling, at one θ."""
    s = {name: critical_set(v, theta) for name, v in a.items()}
    return {
        "theta": float(theta),
        "size_exact": int(s["exact"].sum()),
        "size_refeed": int(s["refeed"].sum()),
        "size_replica": int(s["replica"].sum()),
        "jaccard_refeed": _jaccard_stat(s["exact"], s["refeed"], clusters, ci),
        "jaccard_replica_ceiling": _jaccard_stat(s["exact"], s["replica"], clusters, ci),
    }


def lattice_thetas(ks: Sequence[int]) -> list[float]:
    """The lattice thresholds j/K, j = 1..K, over every K present (as computed for Â, so comparisons are exact)."""
    return sorted({j / k for k in set(ks) for j in range(1, k + 1)})
