"""The statistics of method.md section 4: disagreement, replica floor, excess, clustered t, selection overlap.

Everything here is a pure function of credit frames (``replaynoise.credit.compute_credit``) and pass frames.
Pivots of one problem share a prefix and a model state, so they are not independent: every interval is a
problem-cluster bootstrap (problems resampled with replacement) or a cluster-robust standard error with
problems as clusters. A number that cannot mean anything (too few pivots, empty sets, zero variance) is
reported as ``None`` with a reason rather than as a misleading value.

The paper's own definitions (sign metric, its two conditionings, its per-problem t, McNemar z, unclustered
mean-zero test, margin split) are the defaults; ours are kept beside them under their own names
(docs/method.md, "The paper's definitions and ours"). The paper's statistics live in ``replaynoise.stats``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
import statsmodels.api as sm

from replaynoise.passes import PASSES
from replaynoise.stats import (
    METRIC_DEFINITIONS, METRICS, check_metric, classify_changes, disagree, eligibility_sources, json_number,
    margin_split as margin_split_rates, mcnemar_z, mean_zero_unclustered, per_problem_t, probe_summary,
)

REQUIRED_PASSES = ("exact", "replica", "refeed")
SELECTOR_PASS = "selector"
#: The paper's two conditionings first (main is the default everywhere), then ours, then none.
CONDITIONINGS = ("main", "treatment_independent", "informative", "selector", "none")
#: Tolerance of the |Â| >= θ test; Â and lattice thresholds are exact, a user θ like 0.5 may not be.
THETA_EPS = 1e-9
#: Below this a cluster-robust SE is treated as exactly zero (it only arises from exact cancellation).
SE_ZERO = 1e-12
_KEEP_AT_TOP = frozenset({"n", "n_problems"})

CONDITIONING_DEFINITIONS = {
    "main": "the paper's: eligible in exact, replica and refeed; estimate nonzero in at least one of the three "
            "(one denominator for both comparisons)",
    "treatment_independent": "the paper's: eligible in exact, replica and refeed; exact-pass estimate nonzero "
                             "(decided on the reference pass alone)",
    "informative": "ours: eligible in exact, replica and refeed; exact-pass estimate informative "
                   "(not both branches 0/K, not both K/K)",
    "selector": "ours: eligible in exact, replica, refeed and selector; selector-pass estimate informative",
    "none": "eligible in exact, replica and refeed",
}


# ----------------------------------------------------------------------------------------------- helpers

_num = json_number


def _pass_cols(name: str) -> dict[str, str]:
    return {c: f"{c}__{name}" for c in ("a_hat", "eligible", "informative", "counts", "k")}


def informative_expr() -> pl.Expr:
    """True unless both branches succeeded 0/K or both K/K: then Â = 0 by construction, not by evidence."""
    n_o, n_s, k = pl.col("n_orig_correct"), pl.col("n_sub_correct"), pl.col("k")
    return ~(((n_o == 0) & (n_s == 0)) | ((n_o == k) & (n_s == k)))


def wide_frame(credit: Mapping[str, pl.DataFrame]) -> pl.DataFrame:
    """One row per pivot with ``a_hat__<pass>``, ``eligible__<pass>``, ``informative__<pass>`` for each pass.

    All passes must cover the same pivots with the same K: comparing estimates on different lattices or
    pivot sets would make "disagreement" measure bookkeeping, not numerics.
    """
    missing = [p for p in REQUIRED_PASSES if p not in credit]
    if missing:
        raise ValueError(f"credit frames lack required pass(es) {missing}; have {sorted(credit)}")
    exact = credit["exact"]
    ids = set(exact["pivot_id"].to_list())
    wide = exact.select("pivot_id", "problem_id", "margin", "t", "k")
    for name in sorted(credit):
        df = credit[name]
        if set(df["pivot_id"].to_list()) != ids or df.height != exact.height:
            raise ValueError(f"pass {name!r} does not cover the same pivots as 'exact'")
        cols = _pass_cols(name)
        part = df.select(
            "pivot_id",
            pl.col("a_hat").alias(cols["a_hat"]),
            pl.col("eligible").fill_null(False).alias(cols["eligible"]),
            informative_expr().fill_null(False).alias(cols["informative"]),
            (pl.col("n_orig_correct").is_not_null() & pl.col("n_sub_correct").is_not_null()).alias(cols["counts"]),
            pl.col("k").alias(cols["k"]),
        )
        wide = wide.join(part, on="pivot_id", how="left", maintain_order="left")
        bad = wide.filter(pl.col(cols["k"]) != pl.col("k"))
        if bad.height:
            raise ValueError(f"pass {name!r} uses a different K than 'exact' (pivot {bad['pivot_id'][0]!r})")
        wide = wide.drop(cols["k"])
    return wide


def _lacks_counts(wide: pl.DataFrame, eligible: pl.Expr, name: str) -> str | None:
    """Why informativeness of pass ``name`` cannot be decided (per-branch counts unknown), or None."""
    cols = _pass_cols(name)
    if wide.filter(eligible & ~pl.col(cols["counts"])).height:
        return (f"pass {name!r} has no per-branch success counts (only Â, as in reanalysed records): "
                "informativeness (not both 0/K, not both K/K) cannot be decided")
    return None


def select_pivots(wide: pl.DataFrame, conditioning: str) -> tuple[pl.DataFrame | None, str | None]:
    """The pivots a conditioning keeps, or (None, reason) when it cannot be formed."""
    if conditioning not in CONDITIONINGS:
        raise ValueError(f"unknown conditioning {conditioning!r}; expected one of {CONDITIONINGS}")
    keep = pl.lit(True)
    for name in REQUIRED_PASSES:
        keep = keep & pl.col(_pass_cols(name)["eligible"])
    a_hat = {name: pl.col(_pass_cols(name)["a_hat"]) for name in REQUIRED_PASSES}
    if conditioning == "main":
        keep = keep & ((a_hat["exact"] != 0) | (a_hat["replica"] != 0) | (a_hat["refeed"] != 0))
    elif conditioning == "treatment_independent":
        keep = keep & (a_hat["exact"] != 0)
    elif conditioning == "informative":
        reason = _lacks_counts(wide, keep, "exact")
        if reason:
            return None, reason
        keep = keep & pl.col(_pass_cols("exact")["informative"])
    elif conditioning == "selector":
        cols = _pass_cols(SELECTOR_PASS)
        if cols["eligible"] not in wide.columns:
            return None, f"no {SELECTOR_PASS!r} pass (an exact pass with fresh seeds) in this comparison"
        keep = keep & pl.col(cols["eligible"])
        reason = _lacks_counts(wide, keep, SELECTOR_PASS)
        if reason:
            return None, reason
        keep = keep & pl.col(cols["informative"])
    return wide.filter(keep), None


def eligible_frame(credit: Mapping[str, pl.DataFrame], conditioning: str = "main") -> pl.DataFrame | None:
    """The wide per-pivot frame restricted to a conditioning (None if it cannot be formed); used by figures."""
    sel, _ = select_pivots(wide_frame(credit), conditioning)
    return sel


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
    out["estimate"] = _num(scale * num.sum() / den.sum())
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
    out["ci_lo"], out["ci_hi"] = _num(scale * lo), _num(scale * hi)
    return out


# ------------------------------------------------------------------------------- clustered OLS on a constant

def cluster_ols_mean(y: np.ndarray, groups: np.ndarray, ci: float = 0.95) -> dict:
    """Mean of ``y`` by OLS on a constant with cluster-robust SE (statsmodels, t with G-1 df).

    statsmodels applies the small-sample factor G/(G-1) * (N-1)/(N-k); with a constant only (k=1) that is
    G/(G-1). A zero SE (all values equal, or exact cancellation) leaves t and p undefined: reported as None.
    """
    y = np.asarray(y, dtype=np.float64)
    groups = np.asarray(groups)
    n = int(y.size)
    n_clusters = int(np.unique(groups).size) if n else 0
    out: dict[str, Any] = {"coef": None, "se": None, "t": None, "p": None, "ci_lo": None, "ci_hi": None,
                           "df": None, "n": n, "n_clusters": n_clusters}
    if n == 0:
        out["reason"] = "no observations"
        return out
    out["coef"] = _num(y.mean())
    if n_clusters < 2:
        out["reason"] = "fewer than 2 clusters: cluster-robust SE undefined"
        return out
    if np.all(y == y[0]):
        out.update(se=0.0, df=n_clusters - 1, reason="all values equal: SE is 0, t undefined")
        return out
    codes = np.unique(groups, return_inverse=True)[1]
    res = sm.OLS(y, np.ones((n, 1))).fit(cov_type="cluster", cov_kwds={"groups": codes}, use_t=True)
    se = float(res.bse[0])
    out["df"] = n_clusters - 1
    if se < SE_ZERO:
        out.update(se=0.0, reason="cluster sums of residuals cancel exactly: SE is 0, t undefined")
        return out
    lo, hi = res.conf_int(alpha=1.0 - ci)[0]
    out.update(coef=_num(res.params[0]), se=_num(se), t=_num(res.tvalues[0]), p=_num(res.pvalues[0]),
               ci_lo=_num(lo), ci_hi=_num(hi))
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


# --------------------------------------------------------------------------------------------- the block

def _null_numbers(obj: Any, top: bool = True) -> Any:
    """Replace every number (not bool) by None, except what says why: the top-level n, n_problems and θ."""
    if isinstance(obj, dict):
        return {k: (v if (top and k in _KEEP_AT_TOP) or k == "theta" else _null_numbers(v, top=False))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_null_numbers(v, top=False) for v in obj]
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return None
    return obj


def _disagreement(a: np.ndarray, b: np.ndarray, clusters: Clusters, ci: float, metric: str) -> dict:
    diff = disagree(a, b, metric).astype(np.float64)
    stat = ratio_stat(diff, np.ones_like(diff), clusters, ci)
    return {**stat, "n": int(a.size), "n_disagree": int(diff.sum())}


def _arrays(sel: pl.DataFrame, names: Sequence[str]) -> dict[str, np.ndarray]:
    return {n: sel[_pass_cols(n)["a_hat"]].cast(pl.Float64).to_numpy() for n in names}


def too_few_note(n: int, min_eligible: int, n_problems_with_pivots: int) -> str:
    """Why a conditioning prints no numbers, and what would print them: at this run's yield of eligible pivots
    per problem, how many more problems (a small run hits min_eligible long before it is wrong)."""
    note = f"too few eligible pivots (n={n} < min_eligible={min_eligible})"
    if n == 0 or n_problems_with_pivots == 0:
        return (f"{note}; none at all here: raise dataset.n_problems, rollouts.per_problem or pivots.per_rollout "
                "(or replay.k, which makes a nonzero estimate likelier)")
    per_problem = n / n_problems_with_pivots
    more = -(-(min_eligible - n) * n_problems_with_pivots // n)  # ceil, in integers (a float ratio can round up)
    return (f"{note}; at {per_problem:.2f} eligible pivots per problem with pivots, about {more} more such "
            f"problems would reach it (dataset.n_problems, or rollouts.per_problem / pivots.per_rollout)")


def _extra_comparisons(sel: pl.DataFrame, extras: Sequence[str], *, metric: str, n_boot: int, seed: int,
                       min_eligible: int, ci: float, n_problems_with_pivots: int) -> dict:
    """D(exact, p) and D(refeed, p) for every further pass p, on the block's pivots also eligible in p."""
    out = {}
    for name in extras:
        sub = sel.filter(pl.col(_pass_cols(name)["eligible"]))
        clusters = Clusters.from_ids(sub["problem_id"].to_list(), n_boot, seed)
        a = _arrays(sub, ("exact", "refeed", name))
        entry: dict[str, Any] = {
            "n": sub.height, "n_problems": clusters.n_groups,
            "vs_exact": _disagreement(a["exact"], a[name], clusters, ci, metric),
            "vs_refeed": _disagreement(a["refeed"], a[name], clusters, ci, metric),
        }
        if sub.height < min_eligible:
            entry = _null_numbers(entry)
            entry["note"] = too_few_note(sub.height, min_eligible, n_problems_with_pivots)
        out[name] = entry
    return out


def _metric_stats(sel: pl.DataFrame, a: dict[str, np.ndarray], clusters: Clusters, extras: Sequence[str], *,
                  metric: str, margin_split: float, n_boot: int, seed: int, min_eligible: int, ci: float,
                  n_problems_with_pivots: int) -> dict:
    """The statistics of one conditioning that depend on the disagreement metric: ours and the paper's."""
    e, rep, ref = a["exact"], a["replica"], a["refeed"]
    refeed_flips, floor_flips = disagree(e, ref, metric), disagree(e, rep, metric)
    z = refeed_flips.astype(np.float64) - floor_flips.astype(np.float64)
    return {
        "metric": metric,
        "metric_definition": METRIC_DEFINITIONS[metric],
        "disagreement": {
            "exact_vs_replica": _disagreement(e, rep, clusters, ci, metric),
            "exact_vs_refeed": _disagreement(e, ref, clusters, ci, metric),
            "replica_vs_refeed": _disagreement(rep, ref, clusters, ci, metric),
        },
        "excess_pp": ratio_stat(z, np.ones_like(z), clusters, ci, scale=100.0),
        "clustered_t": cluster_ols_mean(z, clusters.codes, ci),
        "per_problem_t": per_problem_t(refeed_flips, floor_flips, clusters.codes),
        "mcnemar": mcnemar_z(refeed_flips, floor_flips),
        "kinds_of_change": {"exact_vs_refeed": classify_changes(e, ref, metric),
                            "exact_vs_replica": classify_changes(e, rep, metric)},
        "margin_split": margin_split_rates(sel["margin"].cast(pl.Float64).fill_null(np.nan).to_numpy(),
                                           refeed_flips, floor_flips, margin_split),
        "other_passes": _extra_comparisons(sel, extras, metric=metric, n_boot=n_boot, seed=seed,
                                           min_eligible=min_eligible, ci=ci,
                                           n_problems_with_pivots=n_problems_with_pivots),
    }


def _block(sel: pl.DataFrame, extras: Sequence[str], *, metric: str, theta: float, sweep: Sequence[float],
           margin_split: float, n_boot: int, seed: int, min_eligible: int, ci: float,
           n_problems_with_pivots: int) -> dict:
    """All statistics of one conditioning over the selected pivots.

    The metric-dependent statistics appear once per metric under ``by_metric``, and those of the headline
    ``metric`` also at the top of the block, so a reader of one metric needs no lookup.
    """
    clusters = Clusters.from_ids(sel["problem_id"].to_list(), n_boot, seed)
    a = _arrays(sel, REQUIRED_PASSES)
    e, rep, ref = a["exact"], a["replica"], a["refeed"]
    d = ref - e
    by_metric = {m: _metric_stats(sel, a, clusters, extras, metric=m, margin_split=margin_split, n_boot=n_boot,
                                  seed=seed, min_eligible=min_eligible, ci=ci,
                                  n_problems_with_pivots=n_problems_with_pivots) for m in METRICS}
    head = by_metric[metric]
    block: dict[str, Any] = {
        "available": True,
        "n": sel.height,
        "n_problems": clusters.n_groups,
        "note": None,
        **head,
        "by_metric": by_metric,
        "mean_diff": {"cluster": cluster_ols_mean(d, clusters.codes, ci),
                      "bootstrap": ratio_stat(d, np.ones_like(d), clusters, ci),
                      "unclustered": mean_zero_unclustered(d, ci)},
        "selection": {"at_theta": selection_at(a, theta, clusters, ci),
                      "sweep": [selection_at(a, th, clusters, ci) for th in sweep]},
        "eligibility_sources": eligibility_sources(e, rep, ref),
        "replica_reliability": {
            "disagreement": head["disagreement"]["exact_vs_replica"],
            "k_for_target": None,
            "k_for_target_reason": "not estimated (extension skipped): under common random numbers exact "
                                   "equality of Â does not become more likely with larger K, so a K target "
                                   "needs a tolerance and fresh-seed replicas",
        },
    }
    if sel.height < min_eligible:
        block = _null_numbers(block)
        block["note"] = too_few_note(sel.height, min_eligible, n_problems_with_pivots)
    return block


#: The pooled comparison's probe note: the probe needs each configuration's pass rows.
POOLED_PROBE_REASON = "not pooled: the probe channel is in each configuration's comparison.json"


def comparison_settings(analysis: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """``compare_passes``'s settings from a configuration's ``analysis`` block, for the workflow's rules and a
    rebuild of a reference alike: one reading of the block, so a rebuild cannot analyse otherwise than the run."""
    return dict(theta=analysis["theta"], theta_sweep=None, n_boot=analysis["n_boot"], seed=seed,
                min_eligible=analysis["min_eligible"], ci=analysis["ci"], metric=analysis["metric"],
                margin_split=analysis["margin_split"])


def compare_passes(credit: Mapping[str, pl.DataFrame], *, theta: float, theta_sweep: list[float] | None,
                   n_boot: int, seed: int, min_eligible: int, ci: float = 0.95, metric: str = "sign",
                   margin_split: float = 0.3, probes: pl.DataFrame | None = None,
                   probe_reason: str | None = None) -> dict:
    """The section-4 comparison of one configuration (or a pooled set) as a JSON-able dict.

    ``credit`` maps pass name -> credit frame; 'exact', 'replica' and 'refeed' are required, 'selector'
    enables our selector conditioning, every other pass is compared against exact and refeed. ``metric``
    picks the headline disagreement metric; both are always computed (``by_metric`` in every block).
    ``probes`` is a per-pivot probe frame (``stats.probe_deltas``, or the same from published records).
    """
    if not 0 < ci < 1:
        raise ValueError(f"ci must be in (0, 1), got {ci}")
    check_metric(metric)
    wide = wide_frame(credit)
    ks = sorted(set(wide["k"].to_list()))
    sweep = lattice_thetas(ks) if theta_sweep is None else [float(t) for t in theta_sweep]
    extras = [p for p in sorted(credit) if p not in (*REQUIRED_PASSES, SELECTOR_PASS)]
    out: dict[str, Any] = {
        "parameters": {"theta": float(theta), "theta_sweep": sweep, "n_boot": int(n_boot), "seed": int(seed),
                       "min_eligible": int(min_eligible), "ci": float(ci), "metric": metric,
                       "margin_split": float(margin_split)},
        "metric": metric,
        "metrics": dict(METRIC_DEFINITIONS),
        "passes": sorted(credit),
        "k": ks,
        "n_pivots": wide.height,
        "conditionings": {},
    }
    for cond in CONDITIONINGS:
        sel, reason = select_pivots(wide, cond)
        if sel is None:
            block: dict[str, Any] = {"available": False, "reason": reason}
        else:
            block = _block(sel, extras, metric=metric, theta=theta, sweep=sweep, margin_split=margin_split,
                           n_boot=n_boot, seed=seed, min_eligible=min_eligible, ci=ci,
                           n_problems_with_pivots=wide["problem_id"].n_unique())
        block["definition"] = CONDITIONING_DEFINITIONS[cond]
        out["conditionings"][cond] = block
    out["selection_all_pivots"] = _selection_all(wide, theta, n_boot=n_boot, seed=seed, ci=ci)
    out["probe"] = probe_summary(probes, [p for p in sorted(credit) if p != "exact"], probe_reason)
    return out


def _selection_all(wide: pl.DataFrame, theta: float, *, n_boot: int, seed: int, ci: float) -> dict:
    """The paper's Jaccard: critical sets over every recorded pivot (with an estimate in each pass), not a
    conditioning's subset; for θ > 0 it equals the one over the main set, since |Â| >= θ implies Â != 0."""
    sel, _ = select_pivots(wide, "none")
    clusters = Clusters.from_ids(sel["problem_id"].to_list(), n_boot, seed)
    return {"definition": "every pivot eligible in exact, replica and refeed", "n": sel.height,
            **selection_at(_arrays(sel, REQUIRED_PASSES), theta, clusters, ci)}


# ------------------------------------------------------------------------------------------------ pooling

def pool_credit(credits: Mapping[str, Mapping[str, pl.DataFrame]], sep: str = "::") -> dict[str, pl.DataFrame]:
    """Concatenate configurations' credit frames per pass, with pivots and problems made config-qualified.

    Problem clusters of the pooled analysis are (config, problem): the same problem under two configurations
    is two clusters. Only passes present in every configuration are pooled, so each pooled pass covers the
    same pivots.
    """
    if not credits:
        raise ValueError("no configurations to pool")
    common = set.intersection(*(set(c) for c in credits.values()))
    pooled = {}
    for name in sorted(common):
        parts = [
            df.with_columns(
                (pl.lit(f"{cfg}{sep}") + pl.col("pivot_id").cast(pl.String)).alias("pivot_id"),
                (pl.lit(f"{cfg}{sep}") + pl.col("problem_id").cast(pl.String)).alias("problem_id"),
                pl.lit(cfg, dtype=pl.String).alias("config"),
            )
            for cfg, passes in credits.items()
            for df in [passes[name]]
        ]
        pooled[name] = pl.concat(parts, how="vertical_relaxed")
    return pooled


# ---------------------------------------------------------------------------------------- channel checks

_ROW_KEYS = ("pivot_id", "branch", "k")
_ROW_CHANNELS = ("token_ids", "answer", "correct", "next_topk_ids", "next_topk_logprobs")


def lists_bitwise_equal(a: pl.Series, b: pl.Series) -> np.ndarray:
    """Row-wise equality of two list columns, bit for bit (-0.0 != 0.0, NaN == NaN of equal payload).

    polars' own list equality treats -0.0 and 0.0 as equal, which would hide a numerics difference in the
    invariant-mode check.
    """
    if len(a) != len(b):
        raise ValueError("list columns of different lengths")
    null_a, null_b = a.is_null().to_numpy(), b.is_null().to_numpy()
    len_a = a.list.len().fill_null(-1).to_numpy()
    len_b = b.list.len().fill_null(-1).to_numpy()
    equal = (null_a & null_b) | (~null_a & ~null_b & (len_a == len_b))
    check = equal & (len_a > 0)
    if not check.any():
        return equal
    idx = np.flatnonzero(check)
    mask = pl.Series(check)
    flat_a, flat_b = a.filter(mask).explode(), b.filter(mask).explode()
    lengths = len_a[idx]
    if len(flat_a) != lengths.sum() or len(flat_b) != lengths.sum():
        raise RuntimeError("unexpected explode length")
    inner_null = flat_a.is_null().to_numpy() != flat_b.is_null().to_numpy()
    va = _bits(flat_a)
    vb = _bits(flat_b)
    mismatch = (va != vb) | inner_null
    row = np.repeat(np.arange(idx.size), lengths)
    bad_rows = np.bincount(row, weights=mismatch.astype(np.float64), minlength=idx.size) > 0
    equal[idx[bad_rows]] = False
    return equal


def _bits(s: pl.Series) -> np.ndarray:
    """Values as integers carrying their exact bit pattern (nulls as 0; null masks are compared apart)."""
    if s.dtype.is_float():
        arr = s.cast(pl.Float64).fill_null(0.0).to_numpy()
        return np.ascontiguousarray(arr).view(np.int64)
    if s.dtype.is_integer() or s.dtype == pl.Boolean:
        return s.cast(pl.Int64).fill_null(0).to_numpy()
    return np.asarray([hash(v) for v in s.to_list()], dtype=np.int64)


def _share_row(pass_a: str, pass_b: str, channel: str, same: np.ndarray) -> dict:
    n = int(same.size)
    return {"pass_a": pass_a, "pass_b": pass_b, "channel": channel, "n": n,
            "share_identical": float(same.mean()) if n else None}


def _row_frame(name: str, df: pl.DataFrame) -> pl.DataFrame:
    """Key columns with one dtype in every pass, and a refusal of duplicated rows (a join would multiply them)."""
    out = df.select(pl.col("pivot_id").cast(pl.String), pl.col("branch").cast(pl.String),
                    pl.col("k").cast(pl.Int64), *_ROW_CHANNELS)
    if out.select(_ROW_KEYS).is_duplicated().any():
        raise ValueError(f"pass frame {name!r} has duplicated (pivot_id, branch, k) rows")
    return out


def _row_channels(name_a: str, df_a: pl.DataFrame, name_b: str, df_b: pl.DataFrame) -> list[dict]:
    for name, df in ((name_a, df_a), (name_b, df_b)):
        missing = [c for c in (*_ROW_KEYS, *_ROW_CHANNELS) if c not in df.columns]
        if missing:
            raise ValueError(f"pass frame {name!r} lacks columns {missing}")
    left, right = _row_frame(name_a, df_a), _row_frame(name_b, df_b)
    joined = left.join(right, on=list(_ROW_KEYS), how="inner", suffix="__b")
    n_union = left.select(_ROW_KEYS).vstack(right.select(_ROW_KEYS)).unique().height
    rows = [{"pass_a": name_a, "pass_b": name_b, "channel": "rows_present", "n": n_union,
             "share_identical": joined.height / n_union if n_union else None}]
    col = joined.get_column
    rows.append(_share_row(name_a, name_b, "token_ids",
                           lists_bitwise_equal(col("token_ids"), col("token_ids__b"))))
    for ch in ("answer", "correct"):
        same = joined.select(pl.col(ch).eq_missing(pl.col(f"{ch}__b")))[ch].to_numpy().astype(bool)
        rows.append(_share_row(name_a, name_b, ch, same))
    topk = (lists_bitwise_equal(col("next_topk_ids"), col("next_topk_ids__b"))
            & lists_bitwise_equal(col("next_topk_logprobs"), col("next_topk_logprobs__b")))
    rows.append(_share_row(name_a, name_b, "next_topk", topk))
    return rows


def _pivot_channels(name_a: str, cr_a: pl.DataFrame, name_b: str, cr_b: pl.DataFrame) -> list[dict]:
    cols = ("pivot_id", "n_orig_correct", "n_sub_correct", "a_hat", "n_rows")
    joined = cr_a.select(cols).join(cr_b.select(cols), on="pivot_id", how="inner", suffix="__b").filter(
        (pl.col("n_rows") > 0) & (pl.col("n_rows__b") > 0))
    counts = joined.select(
        (pl.col("n_orig_correct") == pl.col("n_orig_correct__b"))
        & (pl.col("n_sub_correct") == pl.col("n_sub_correct__b"))).to_series().to_numpy().astype(bool)
    a_hat = lists_bitwise_equal(_as_singleton_lists(joined["a_hat"]), _as_singleton_lists(joined["a_hat__b"]))
    return [_share_row(name_a, name_b, "success_counts", counts), _share_row(name_a, name_b, "a_hat", a_hat)]


def _as_singleton_lists(s: pl.Series) -> pl.Series:
    """Wrap scalars in one-element lists so the bitwise list comparison covers scalar floats too."""
    return s.to_frame("v").select(pl.concat_list(pl.col("v").cast(pl.Float64))).to_series()


def channel_agreement(passes: Mapping[str, pl.DataFrame], credit: Mapping[str, pl.DataFrame]) -> pl.DataFrame:
    """Share of bitwise-identical values per channel, for every unordered pair of passes.

    Row channels join continuations on (pivot_id, branch, k); pivot channels join credit frames on pivot_id
    over pivots with rows in both passes. 'rows_present' is the share of the union of rows present in both,
    so a pass that lost rows cannot look identical on the others.
    """
    rows: list[dict] = []
    for name_a, name_b in itertools.combinations(sorted(passes), 2):
        rows += _row_channels(name_a, passes[name_a], name_b, passes[name_b])
        if name_a in credit and name_b in credit:
            rows += _pivot_channels(name_a, credit[name_a], name_b, credit[name_b])
    schema = {"pass_a": pl.String, "pass_b": pl.String, "channel": pl.String, "n": pl.Int64,
              "share_identical": pl.Float64}
    return pl.DataFrame(rows, schema=schema)


def same_noise(agreement_df: pl.DataFrame) -> pl.DataFrame:
    """The pairs of passes that draw the same sampling noise (exact, replica, refeed: common random numbers).

    selector and replica_fresh use other seeds by design, so even batch-invariant kernels give other tokens there.
    """
    noise = {name: spec.noise for name, spec in PASSES.items()}
    keep = [noise.get(a) == noise.get(b) for a, b in zip(agreement_df["pass_a"], agreement_df["pass_b"])]
    return agreement_df.filter(pl.Series(keep, dtype=pl.Boolean))


def assert_all_identical(agreement_df: pl.DataFrame) -> None:
    """Invariant mode: every channel of every pair of passes that share their noise must be identical; anything
    else is a bug (method.md §2). Pairs with a fresh-seed pass are left out (``same_noise``)."""
    agreement_df = same_noise(agreement_df)
    if agreement_df.height == 0:
        raise AssertionError("no pass pairs were compared: invariant check has nothing to assert")
    bad = agreement_df.filter(pl.col("share_identical").is_null() | (pl.col("share_identical") != 1.0))
    if bad.height:
        lines = [f"  {r['pass_a']} vs {r['pass_b']} / {r['channel']}: share_identical="
                 f"{'n/a (nothing compared)' if r['share_identical'] is None else repr(r['share_identical'])}"
                 f" over n={r['n']}"
                 for r in bad.iter_rows(named=True)]
        raise AssertionError("passes are not identical under invariant mode:\n" + "\n".join(lines))


# ---------------------------------------------------------------------------------------------- headline

HEADLINE_SCHEMA = {
    "config": pl.String, "conditioning": pl.String, "metric": pl.String, "n": pl.Int64, "n_problems": pl.Int64,
    "floor": pl.Float64, "floor_ci_lo": pl.Float64, "floor_ci_hi": pl.Float64, "floor_polarity_share": pl.Float64,
    "refeed_disagreement": pl.Float64, "refeed_disagreement_ci_lo": pl.Float64,
    "refeed_disagreement_ci_hi": pl.Float64, "refeed_polarity_share": pl.Float64,
    "excess_pp": pl.Float64, "excess_pp_ci_lo": pl.Float64, "excess_pp_ci_hi": pl.Float64,
    "t_per_problem": pl.Float64, "df_per_problem": pl.Int64, "p_per_problem": pl.Float64,
    "problems_refeed_worse": pl.Int64, "problems_floor_worse": pl.Int64, "problems_equal": pl.Int64,
    "t": pl.Float64, "p": pl.Float64, "n_clusters": pl.Int64,
    "mcnemar_z": pl.Float64, "mcnemar_p": pl.Float64,
    "ti_excess_pp": pl.Float64,
    "jaccard_refeed": pl.Float64, "jaccard_refeed_ci_lo": pl.Float64, "jaccard_refeed_ci_hi": pl.Float64,
    "jaccard_replica_ceiling": pl.Float64, "jaccard_replica_ceiling_ci_lo": pl.Float64,
    "jaccard_replica_ceiling_ci_hi": pl.Float64,
    "share_zero_crossing": pl.Float64, "share_reversal": pl.Float64, "share_magnitude": pl.Float64,
    "mean_diff": pl.Float64, "mean_diff_ci_lo": pl.Float64, "mean_diff_ci_hi": pl.Float64,
    "note": pl.String,
}


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _headline_row(config: str, cond: str, block: dict, metric: str, ti_excess: float | None) -> dict:
    """One table row: ``t`` is our OLS cluster-robust t, ``t_per_problem`` the paper's; ``ti_excess_pp`` is the
    configuration's treatment-independent excess (the same on each of its rows, as Table 1 sets it beside)."""
    row: dict[str, Any] = {c: None for c in HEADLINE_SCHEMA}
    row.update(config=config, conditioning=cond, metric=metric, ti_excess_pp=ti_excess)
    if not block.get("available", False):
        row["note"] = block.get("reason")
        return row
    stats = block["by_metric"][metric]
    dis = stats["disagreement"]
    sel = block["selection"]["at_theta"]
    kinds = stats["kinds_of_change"]
    mean = block["mean_diff"]["cluster"]
    ppt, ols = stats["per_problem_t"], stats["clustered_t"]
    for prefix, stat in (("floor", dis["exact_vs_replica"]), ("refeed_disagreement", dis["exact_vs_refeed"]),
                         ("excess_pp", stats["excess_pp"]), ("jaccard_refeed", sel["jaccard_refeed"]),
                         ("jaccard_replica_ceiling", sel["jaccard_replica_ceiling"])):
        row[prefix], row[f"{prefix}_ci_lo"], row[f"{prefix}_ci_hi"] = (
            stat["estimate"], stat["ci_lo"], stat["ci_hi"])
    row.update(
        n=block["n"], n_problems=block["n_problems"],
        floor_polarity_share=_get(kinds, "exact_vs_replica", "reversal", "share_of_n"),
        refeed_polarity_share=_get(kinds, "exact_vs_refeed", "reversal", "share_of_n"),
        t_per_problem=ppt["t"], df_per_problem=ppt["df"], p_per_problem=ppt["p"],
        problems_refeed_worse=ppt["problems_refeed_worse"], problems_floor_worse=ppt["problems_floor_worse"],
        problems_equal=ppt["problems_equal"],
        t=ols["t"], p=ols["p"], n_clusters=ols["n_clusters"],
        mcnemar_z=stats["mcnemar"]["z"], mcnemar_p=stats["mcnemar"]["p_exact"],
        share_zero_crossing=_get(kinds, "exact_vs_refeed", "zero_crossing", "share"),
        share_reversal=_get(kinds, "exact_vs_refeed", "reversal", "share"),
        share_magnitude=_get(kinds, "exact_vs_refeed", "magnitude", "share"),
        mean_diff=mean["coef"], mean_diff_ci_lo=mean["ci_lo"], mean_diff_ci_hi=mean["ci_hi"],
        note=block.get("note") or ols.get("reason"),
    )
    return row


def headline_rows(results: Mapping[str, dict], metric: str | None = None) -> pl.DataFrame:
    """Flatten compare_passes outputs (config -> result, the pooled one under its own key, e.g. 'pooled').

    Rows show ``metric`` (default: each result's own headline metric) and say so in their ``metric`` column.
    """
    rows = []
    for cfg, res in results.items():
        m = check_metric(metric or res.get("metric", "sign"))
        ti = _get(res["conditionings"].get("treatment_independent"), "by_metric", m, "excess_pp", "estimate")
        rows += [_headline_row(cfg, cond, res["conditionings"][cond], m, ti) for cond in CONDITIONINGS]
    return pl.DataFrame(rows, schema=HEADLINE_SCHEMA)


def verification_summary(exact_credit: pl.DataFrame, refeed_pass: pl.DataFrame | None = None,
                         exact_pass: pl.DataFrame | None = None) -> dict:
    """How many pivots resumed from a verified decode-time state (the paper reports 100%), how many of them a
    re-step of the last prefix token over the stored KV reproduces bitwise (HF engine: a measured channel of
    batch variance, not a gate), and how far the re-fed KV moved from it (max |dKV| over layers at the pivot)."""
    n = exact_credit.height
    verified = int(exact_credit["verified"].sum()) if n else 0
    summary: dict = {"pivots": n, "verified": verified, "rate": verified / n if n else None}
    if exact_pass is not None and "restep_match" in exact_pass.columns:
        per_pivot = (exact_pass.filter(pl.col("restep_match").is_not_null())
                     .group_by("pivot_id").agg(pl.col("restep_match").first()))
        summary["restep"] = ({"pivots": per_pivot.height, "reproduced": int(per_pivot["restep_match"].sum()),
                              "share": float(per_pivot["restep_match"].mean())} if per_pivot.height
                             else {"recorded": False})
    if refeed_pass is not None and "kv_maxdiff" in refeed_pass.columns:
        per_pivot = (refeed_pass.filter(pl.col("kv_maxdiff").is_not_null())
                     .group_by("pivot_id").agg(pl.col("kv_maxdiff").first().list.max().alias("m")))
        if per_pivot.height:
            summary["refeed_kv_maxdiff"] = {"median": float(per_pivot["m"].median()),
                                            "max": float(per_pivot["m"].max()),
                                            "share_nonzero": float((per_pivot["m"] > 0).mean())}
    return summary


def cache_summary(passes: Mapping[str, pl.DataFrame]) -> dict:
    """Per pass, how much of each prefix came from stored/cached KV and how much was recomputed (the tail).

    ``hit_rate`` is the share of rows with an expectation (decode_kv resumes) whose cached count equals it; the
    tail distribution maps tail length to row count. vLLM exact rows must show hit_rate 1 on verified pivots;
    re-feed rows read no decode-time block (their hits, if any, are their own pass's earlier prefills).
    """
    out: dict = {}
    for name, frame in passes.items():
        if "cached_tokens" not in frame.columns or frame["cached_tokens"].null_count() == frame.height:
            out[name] = {"rows": frame.height, "recorded": False}
            continue
        rows = frame.filter(pl.col("cached_tokens").is_not_null())
        expected = rows.filter(pl.col("expected_cached_tokens").is_not_null())
        hit = expected.filter(pl.col("cached_tokens") == pl.col("expected_cached_tokens"))
        tails = rows.group_by("tail_tokens").len().sort("tail_tokens")
        prefix_tokens = int(rows["prefix_len"].sum())
        out[name] = {
            "rows": frame.height, "recorded": True, "source": rows["prefix_source"][0] if rows.height else None,
            "rows_with_expectation": expected.height, "rows_hit_as_expected": hit.height,
            "hit_rate": hit.height / expected.height if expected.height else None,
            "rows_with_any_hit": int((rows["cached_tokens"] > 0).sum()),
            "token_hit_rate": int(rows["cached_tokens"].sum()) / prefix_tokens if prefix_tokens else None,
            "tail_tokens": {"distribution": {str(t): int(n) for t, n in tails.iter_rows()},
                            "share_zero": float((rows["tail_tokens"] == 0).mean()),
                            "median": float(rows["tail_tokens"].median()), "max": int(rows["tail_tokens"].max())},
        }
    return out
