"""The statistics of method.md section 4: disagreement, replica floor, excess, clustered t, selection overlap.

Everything here is a pure function of credit frames (``replaynoise.analysis.credit.compute_credit``) and pass frames.
Pivots of one problem share a prefix and a model state, so they are not independent: every interval is a
problem-cluster bootstrap (problems resampled with replacement) or a cluster-robust standard error with
problems as clusters. A number that cannot mean anything (too few pivots, empty sets, zero variance) is
reported as ``None`` with a reason rather than as a misleading value.

The paper's own definitions (sign metric, its two conditionings, its per-problem t, McNemar z, unclustered
mean-zero test, margin split) are the defaults; ours are kept beside them under their own names
(docs/method.md, "The paper's definitions and ours"). The paper's statistics live in
``replaynoise.analysis.paper_stats``, the
conditionings in ``replaynoise.analysis.conditionings``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import polars as pl

from replaynoise.analysis.conditionings import (
    CONDITIONING_DEFINITIONS,
    CONDITIONINGS,
    SELECTOR_PASS,
    keep_expression,
    pass_columns,
    select_pivots,
    wide_frame,
)
from replaynoise.analysis.disagreement import METRIC_DEFINITIONS, METRICS, check_metric, disagree
from replaynoise.analysis.paper_stats import (
    Clusters,
    classify_changes,
    cluster_ols_mean,
    eligibility_sources,
    lattice_thetas,
    mcnemar_z,
    mean_zero_unclustered,
    per_problem_t,
    ratio_stat,
    selection_at,
)
from replaynoise.analysis.paper_stats import (
    margin_split as margin_split_rates,
)
from replaynoise.analysis.probes import probe_summary
from replaynoise.analysis.replicated import replicated_stats
from replaynoise.generation.passes import REQUIRED_PASSES, replicate_pairs
from replaynoise.settings import AnalysisSettings

_KEEP_AT_TOP = frozenset({"n", "n_problems"})


# --------------------------------------------------------------------------------------------- the block


def _null_numbers(obj: Any, top: bool = True) -> Any:
    """Replace every number (not bool) by None, except what says why: the top-level n, n_problems and θ."""
    if isinstance(obj, dict):
        return {
            k: (v if (top and k in _KEEP_AT_TOP) or k == "theta" else _null_numbers(v, top=False))
            for k, v in obj.items()
        }
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
    return {n: sel[pass_columns(n)["a_hat"]].cast(pl.Float64).to_numpy() for n in names}


def too_few_note(n: int, min_eligible: int, n_problems_with_pivots: int) -> str:
    """Why a conditioning prints no numbers, and what would print them: at this run's yield of eligible pivots
    per problem, how many more problems (a small run hits min_eligible long before it is wrong)."""
    note = f"too few eligible pivots (n={n} < min_eligible={min_eligible})"
    if n == 0 or n_problems_with_pivots == 0:
        return (
            f"{note}; none at all here: raise dataset.n_problems, rollouts.per_problem or pivots.per_rollout "
            "(or replay.k, which makes a nonzero estimate likelier)"
        )
    per_problem = n / n_problems_with_pivots
    more = -(-(min_eligible - n) * n_problems_with_pivots // n)  # ceil, in integers (a float ratio can round up)
    return (
        f"{note}; at {per_problem:.2f} eligible pivots per problem with pivots, about {more} more such "
        f"problems would reach it (dataset.n_problems, or rollouts.per_problem / pivots.per_rollout)"
    )


def _extra_comparisons(
    sel: pl.DataFrame, extras: Sequence[str], s: AnalysisSettings, n_problems_with_pivots: int
) -> dict:
    """D(exact, p) and D(refeed, p) for every further pass p, on the block's pivots also eligible in p."""
    out = {}
    for name in extras:
        sub = sel.filter(pl.col(pass_columns(name)["eligible"]))
        clusters = Clusters.from_ids(sub["problem_id"].to_list(), s.n_boot, s.seed)
        a = _arrays(sub, ("exact", "refeed", name))
        entry: dict[str, Any] = {
            "n": sub.height,
            "n_problems": clusters.n_groups,
            "vs_exact": _disagreement(a["exact"], a[name], clusters, s.ci, s.metric),
            "vs_refeed": _disagreement(a["refeed"], a[name], clusters, s.ci, s.metric),
        }
        if sub.height < s.min_eligible:
            entry = _null_numbers(entry)
            entry["note"] = too_few_note(sub.height, s.min_eligible, n_problems_with_pivots)
        out[name] = entry
    return out


def _metric_stats(
    sel: pl.DataFrame,
    a: dict[str, np.ndarray],
    clusters: Clusters,
    extras: Sequence[str],
    s: AnalysisSettings,
    n_problems_with_pivots: int,
) -> dict:
    """The statistics of one conditioning that depend on the disagreement metric (``s.metric``): ours and the
    paper's."""
    metric, ci = s.metric, s.ci
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
        "kinds_of_change": {
            "exact_vs_refeed": classify_changes(e, ref, metric),
            "exact_vs_replica": classify_changes(e, rep, metric),
        },
        "margin_split": margin_split_rates(
            sel["margin"].cast(pl.Float64).fill_null(np.nan).to_numpy(), refeed_flips, floor_flips, s.margin_split
        ),
        "other_passes": _extra_comparisons(sel, extras, s, n_problems_with_pivots),
    }


def _block(
    sel: pl.DataFrame, extras: Sequence[str], s: AnalysisSettings, sweep: Sequence[float], n_problems_with_pivots: int
) -> dict:
    """All statistics of one conditioning over the selected pivots.

    The metric-dependent statistics appear once per metric under ``by_metric``, and those of the headline
    ``metric`` also at the top of the block, so a reader of one metric needs no lookup.
    """
    ci = s.ci
    clusters = Clusters.from_ids(sel["problem_id"].to_list(), s.n_boot, s.seed)
    a = _arrays(sel, REQUIRED_PASSES)
    e, rep, ref = a["exact"], a["replica"], a["refeed"]
    d = ref - e
    by_metric = {
        m: _metric_stats(sel, a, clusters, extras, replace(s, metric=m), n_problems_with_pivots) for m in METRICS
    }
    head = by_metric[s.metric]
    block: dict[str, Any] = {
        "available": True,
        "n": sel.height,
        "n_problems": clusters.n_groups,
        "note": None,
        **head,
        "by_metric": by_metric,
        "mean_diff": {
            "cluster": cluster_ols_mean(d, clusters.codes, ci),
            "bootstrap": ratio_stat(d, np.ones_like(d), clusters, ci),
            "unclustered": mean_zero_unclustered(d, ci),
        },
        "selection": {
            "at_theta": selection_at(a, s.theta, clusters, ci),
            "sweep": [selection_at(a, th, clusters, ci) for th in sweep],
        },
        "eligibility_sources": eligibility_sources(e, rep, ref),
        "replica_reliability": {
            "disagreement": head["disagreement"]["exact_vs_replica"],
            "k_for_target": None,
            "k_for_target_reason": "not estimated (extension skipped): under common random numbers exact "
            "equality of Â does not become more likely with larger K, so a K target "
            "needs a tolerance and fresh-seed replicas",
        },
    }
    if sel.height < s.min_eligible:
        block = _null_numbers(block)
        block["note"] = too_few_note(sel.height, s.min_eligible, n_problems_with_pivots)
    return block


def pair_sets(
    wide: pl.DataFrame, conditioning: str, pairs: Sequence[tuple[str, str]]
) -> tuple[np.ndarray | None, str | None]:
    """The R x n masks of a conditioning's set over each pair (exact, replica draw r, refeed draw r), or (None, why)
    where the conditioning cannot be formed."""
    masks = []
    for replica, refeed in pairs:
        keep, reason = keep_expression(wide, conditioning, ("exact", replica, refeed))
        if keep is None:
            return None, reason
        masks.append(wide.select(keep.fill_null(False))[:, 0].to_numpy())
    return np.array(masks), None


def pair_disagreements(
    wide: pl.DataFrame, pairs: Sequence[tuple[str, str]], metric: str
) -> tuple[np.ndarray, np.ndarray]:
    """(re-feed flips, floor flips), R x n: each pair's refeed and replica draw against the exact pass."""
    a = {
        name: wide[pass_columns(name)["a_hat"]].cast(pl.Float64).fill_null(0.0).to_numpy()
        for name in ("exact", *(p for pair in pairs for p in pair))
    }
    refeed = np.array([disagree(a["exact"], a[f], metric) for _, f in pairs])
    floor = np.array([disagree(a["exact"], a[r], metric) for r, _ in pairs])
    return refeed, floor


def replicated_block(
    wide: pl.DataFrame, conditioning: str, pairs: Sequence[tuple[str, str]], s: AnalysisSettings
) -> dict:
    """A conditioning over R pairs of draws (``replicate_pairs``): pair r's set is the conditioning over exact,
    replica draw r and refeed draw r; the excess, re-feed rate and floor are pooled over the pairs, each with the
    crossed (problems x pairs) interval and the problem-only one (``replicated.replicated_stats``), per metric."""
    masks, reason = pair_sets(wide, conditioning, pairs)
    if masks is None:
        return {"available": False, "reason": reason}
    codes = np.unique(wide["problem_id"].to_numpy(), return_inverse=True)[1]
    by_metric = {}
    for m in METRICS:
        refeed, floor = pair_disagreements(wide, pairs, m)
        by_metric[m] = replicated_stats(codes, masks, refeed, floor, ci=s.ci, n_boot=s.n_boot, seed=s.seed)
    block: dict[str, Any] = {
        "available": True,
        "draws": [list(p) for p in pairs],
        "metric": s.metric,
        "note": None,
        **by_metric[s.metric],
        "by_metric": by_metric,
    }
    smallest = min(block["n_per_pair"])
    if smallest < s.min_eligible:
        block = _null_numbers(block)
        block["note"] = f"too few eligible pivots in a pair's set (n={smallest} < min_eligible={s.min_eligible})"
    return block


def compare_passes(
    credit: Mapping[str, pl.DataFrame],
    settings: AnalysisSettings,
    *,
    probes: pl.DataFrame | None = None,
    probe_reason: str | None = None,
) -> dict:
    """The section-4 comparison of one configuration (or a pooled set) as a JSON-able dict.

    ``credit`` maps pass name -> credit frame; 'exact', 'replica' and 'refeed' are required, 'selector'
    enables our selector conditioning, every other pass is compared against exact and refeed.
    ``settings.metric`` picks the headline disagreement metric; both are always computed (``by_metric`` in every
    block).
    ``probes`` is a per-pivot probe frame (``probes.probe_deltas``, or the same from published records).
    """
    s = settings
    if not 0 < s.ci < 1:
        raise ValueError(f"ci must be in (0, 1), got {s.ci}")
    check_metric(s.metric)
    wide = wide_frame(credit)
    ks = sorted(set(wide["k"].to_list()))
    sweep = lattice_thetas(ks) if s.theta_sweep is None else [float(t) for t in s.theta_sweep]
    extras = [p for p in sorted(credit) if p not in (*REQUIRED_PASSES, SELECTOR_PASS)]
    out: dict[str, Any] = {
        "parameters": {
            "theta": float(s.theta),
            "theta_sweep": sweep,
            "n_boot": int(s.n_boot),
            "seed": int(s.seed),
            "min_eligible": int(s.min_eligible),
            "ci": float(s.ci),
            "metric": s.metric,
            "margin_split": float(s.margin_split),
        },
        "metric": s.metric,
        "metrics": dict(METRIC_DEFINITIONS),
        "passes": sorted(credit),
        "k": ks,
        "n_pivots": wide.height,
        "conditionings": {},
    }
    pairs = replicate_pairs(sorted(credit))
    if len(pairs) > 1:  # a replicated design; one draw of each pass leaves the comparison as it always was
        out["replicates"] = {"pairs": [list(p) for p in pairs], "n_pairs": len(pairs)}
    for cond in CONDITIONINGS:
        sel, reason = select_pivots(wide, cond)
        if sel is None:
            block: dict[str, Any] = {"available": False, "reason": reason}
        else:
            block = _block(sel, extras, s, sweep, wide["problem_id"].n_unique())
            if len(pairs) > 1:
                block["replicated"] = replicated_block(wide, cond, pairs, s)
        block["definition"] = CONDITIONING_DEFINITIONS[cond]
        out["conditionings"][cond] = block
    out["selection_all_pivots"] = _selection_all(wide, s)
    out["probe"] = probe_summary(probes, [p for p in sorted(credit) if p != "exact"], probe_reason)
    return out


def _selection_all(wide: pl.DataFrame, s: AnalysisSettings) -> dict:
    """The paper's Jaccard: critical sets over every recorded pivot (with an estimate in each pass), not a
    conditioning's subset; for θ > 0 it equals the one over the main set, since |Â| >= θ implies Â != 0."""
    sel, _ = select_pivots(wide, "none")
    clusters = Clusters.from_ids(sel["problem_id"].to_list(), s.n_boot, s.seed)
    return {
        "definition": "every pivot eligible in exact, replica and refeed",
        "n": sel.height,
        **selection_at(_arrays(sel, REQUIRED_PASSES), s.theta, clusters, s.ci),
    }


#: the row columns ``cache_summary`` counts a pass's cache reads from
CACHE_COLUMNS = frozenset({"prefix_source", "prefix_len", "cached_tokens", "expected_cached_tokens", "tail_tokens"})


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
            "rows": frame.height,
            "recorded": True,
            "source": rows["prefix_source"][0] if rows.height else None,
            "rows_with_expectation": expected.height,
            "rows_hit_as_expected": hit.height,
            "hit_rate": hit.height / expected.height if expected.height else None,
            "rows_with_any_hit": int((rows["cached_tokens"] > 0).sum()),
            "token_hit_rate": int(rows["cached_tokens"].sum()) / prefix_tokens if prefix_tokens else None,
            "tail_tokens": {
                "distribution": {str(t): int(n) for t, n in tails.iter_rows()},
                "share_zero": float((rows["tail_tokens"] == 0).mean()),
                "median": float(rows["tail_tokens"].median()),
                "max": int(rows["tail_tokens"].max()),
            },
        }
    return out
