"""The headline rows: one row per configuration and conditioning, flattened from the comparisons
(``compare_passes`` output), that every headline table (``tables``) and the run's summary are printed from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from replaynoise.analysis.conditionings import CONDITIONINGS
from replaynoise.analysis.disagreement import check_metric
from replaynoise.settings import comparison_metric

HEADLINE_SCHEMA = {
    "config": pl.String,
    "conditioning": pl.String,
    "metric": pl.String,
    "n": pl.Int64,
    "n_problems": pl.Int64,
    "floor": pl.Float64,
    "floor_ci_lo": pl.Float64,
    "floor_ci_hi": pl.Float64,
    "floor_polarity_share": pl.Float64,
    "refeed_disagreement": pl.Float64,
    "refeed_disagreement_ci_lo": pl.Float64,
    "refeed_disagreement_ci_hi": pl.Float64,
    "refeed_polarity_share": pl.Float64,
    "excess_pp": pl.Float64,
    "excess_pp_ci_lo": pl.Float64,
    "excess_pp_ci_hi": pl.Float64,
    "t_per_problem": pl.Float64,
    "df_per_problem": pl.Int64,
    "p_per_problem": pl.Float64,
    "problems_refeed_worse": pl.Int64,
    "problems_floor_worse": pl.Int64,
    "problems_equal": pl.Int64,
    "t": pl.Float64,
    "p": pl.Float64,
    "n_clusters": pl.Int64,
    "mcnemar_z": pl.Float64,
    "mcnemar_p": pl.Float64,
    "ti_excess_pp": pl.Float64,
    "ti_excess_pp_ci_lo": pl.Float64,
    "ti_excess_pp_ci_hi": pl.Float64,
    "ti_t_per_problem": pl.Float64,
    "jaccard_refeed": pl.Float64,
    "jaccard_refeed_ci_lo": pl.Float64,
    "jaccard_refeed_ci_hi": pl.Float64,
    "jaccard_replica_ceiling": pl.Float64,
    "jaccard_replica_ceiling_ci_lo": pl.Float64,
    "jaccard_replica_ceiling_ci_hi": pl.Float64,
    "share_zero_crossing": pl.Float64,
    "share_reversal": pl.Float64,
    "share_magnitude": pl.Float64,
    "mean_diff": pl.Float64,
    "mean_diff_ci_lo": pl.Float64,
    "mean_diff_ci_hi": pl.Float64,
    "note": pl.String,
    # replicated passes (replay.replicates >= 2): the rates and excess above are then pooled over the pairs of
    # draws with the crossed interval (problems and pass draws); beside them, the problem-only interval of the same
    # estimate, the pass-level component and whether the crossed interval excludes zero. One draw: pairs 1, n/a.
    "pairs": pl.Int64,
    "excess_pp_problem_ci_lo": pl.Float64,
    "excess_pp_problem_ci_hi": pl.Float64,
    "pass_sd_pp": pl.Float64,
    "pass_sd_pp_ci_lo": pl.Float64,
    "pass_sd_pp_ci_hi": pl.Float64,
    "resolved": pl.Boolean,
}


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _ti_columns(result: dict, metric: str) -> dict[str, Any]:
    """The treatment-independent excess with its interval and per-problem t: a point alone reads as resolved
    where its interval spans zero (several of our rows), so the three travel together. Over replicated pairs, the
    pooled excess and its crossed interval."""
    block = result["conditionings"].get("treatment_independent")
    replicated = _get(block, "replicated", "by_metric", metric)
    if _get(block, "replicated", "available") and replicated:
        crossed = replicated["excess_pp"]["crossed"]
        return {
            "ti_excess_pp": crossed.get("estimate"),
            "ti_excess_pp_ci_lo": crossed.get("ci_lo"),
            "ti_excess_pp_ci_hi": crossed.get("ci_hi"),
            "ti_t_per_problem": replicated["per_problem_t"].get("t"),
        }
    stats = _get(block, "by_metric", metric)
    excess, ppt = _get(stats, "excess_pp") or {}, _get(stats, "per_problem_t") or {}
    return {
        "ti_excess_pp": excess.get("estimate"),
        "ti_excess_pp_ci_lo": excess.get("ci_lo"),
        "ti_excess_pp_ci_hi": excess.get("ci_hi"),
        "ti_t_per_problem": ppt.get("t"),
    }


def _replicated_columns(block: dict, metric: str) -> dict[str, Any]:
    """A replicated block's columns: the rates and excess pooled over its pairs with their crossed intervals, the
    problem-only interval, the pass-level SD (pp) and whether the crossed interval excludes zero."""
    stats = block["replicated"]["by_metric"][metric]
    row: dict[str, Any] = {
        "pairs": stats["n_pairs"],
        "n": round(sum(stats["n_per_pair"]) / stats["n_pairs"]),
        # the first pair's polarity shares would sit beside pooled rates: left out
        "floor_polarity_share": None,
        "refeed_polarity_share": None,
        "n_problems": stats["n_problems"],
        "resolved": stats["resolved"],
        "t_per_problem": stats["per_problem_t"]["t"],
        "df_per_problem": stats["per_problem_t"]["df"],
        "p_per_problem": stats["per_problem_t"]["p"],
    }
    for prefix, key in (("floor", "floor"), ("refeed_disagreement", "refeed"), ("excess_pp", "excess_pp")):
        crossed = stats[key]["crossed"]
        row[prefix], row[f"{prefix}_ci_lo"], row[f"{prefix}_ci_hi"] = (
            crossed["estimate"],
            crossed["ci_lo"],
            crossed["ci_hi"],
        )
    row["excess_pp_problem_ci_lo"] = stats["excess_pp"]["problem_only"]["ci_lo"]
    row["excess_pp_problem_ci_hi"] = stats["excess_pp"]["problem_only"]["ci_hi"]
    components = stats["excess_pp"]["crossed"].get("components") or {}
    row["pass_sd_pp"], row["pass_sd_pp_ci_lo"], row["pass_sd_pp_ci_hi"] = (
        components.get("pass_sd"),
        components.get("pass_sd_ci_lo"),
        components.get("pass_sd_ci_hi"),
    )
    return row


def _headline_row(config: str, cond: str, block: dict, metric: str, ti: Mapping[str, Any]) -> dict:
    """One table row: ``t`` is our OLS cluster-robust t, ``t_per_problem`` the paper's; the ``ti_*`` columns are
    the configuration's treatment-independent excess (the same on each of its rows, as Table 1 sets it beside)."""
    row: dict[str, Any] = {c: None for c in HEADLINE_SCHEMA}
    row.update(config=config, conditioning=cond, metric=metric, **ti)
    if not block.get("available", False):
        row["note"] = block.get("reason")
        return row
    stats = block["by_metric"][metric]
    dis = stats["disagreement"]
    sel = block["selection"]["at_theta"]
    kinds = stats["kinds_of_change"]
    mean = block["mean_diff"]["cluster"]
    ppt, ols = stats["per_problem_t"], stats["clustered_t"]
    for prefix, stat in (
        ("floor", dis["exact_vs_replica"]),
        ("refeed_disagreement", dis["exact_vs_refeed"]),
        ("excess_pp", stats["excess_pp"]),
        ("jaccard_refeed", sel["jaccard_refeed"]),
        ("jaccard_replica_ceiling", sel["jaccard_replica_ceiling"]),
    ):
        row[prefix], row[f"{prefix}_ci_lo"], row[f"{prefix}_ci_hi"] = (stat["estimate"], stat["ci_lo"], stat["ci_hi"])
    row.update(
        n=block["n"],
        n_problems=block["n_problems"],
        floor_polarity_share=_get(kinds, "exact_vs_replica", "reversal", "share_of_n"),
        refeed_polarity_share=_get(kinds, "exact_vs_refeed", "reversal", "share_of_n"),
        t_per_problem=ppt["t"],
        df_per_problem=ppt["df"],
        p_per_problem=ppt["p"],
        problems_refeed_worse=ppt["problems_refeed_worse"],
        problems_floor_worse=ppt["problems_floor_worse"],
        problems_equal=ppt["problems_equal"],
        t=ols["t"],
        p=ols["p"],
        n_clusters=ols["n_clusters"],
        mcnemar_z=stats["mcnemar"]["z"],
        mcnemar_p=stats["mcnemar"]["p_exact"],
        share_zero_crossing=_get(kinds, "exact_vs_refeed", "zero_crossing", "share"),
        share_reversal=_get(kinds, "exact_vs_refeed", "reversal", "share"),
        share_magnitude=_get(kinds, "exact_vs_refeed", "magnitude", "share"),
        mean_diff=mean["coef"],
        mean_diff_ci_lo=mean["ci_lo"],
        mean_diff_ci_hi=mean["ci_hi"],
        note=block.get("note") or ols.get("reason"),
        pairs=1,
    )
    if _get(block, "replicated", "available"):
        replicated = block["replicated"]
        if replicated.get("note"):
            row["note"] = replicated["note"]
        elif metric in replicated.get("by_metric", {}):
            row.update(_replicated_columns(block, metric))
    return row


def headline_rows(results: Mapping[str, dict], metric: str | None = None) -> pl.DataFrame:
    """Flatten compare_passes outputs (config -> result, the pooled one under its own key, e.g. 'pooled').

    Rows show ``metric`` (default: each result's own headline metric) and say so in their ``metric`` column.
    """
    rows = []
    for cfg, res in results.items():
        m = check_metric(metric or comparison_metric(res))
        ti = _ti_columns(res, m)
        rows += [_headline_row(cfg, cond, res["conditionings"][cond], m, ti) for cond in CONDITIONINGS]
    return pl.DataFrame(rows, schema=HEADLINE_SCHEMA)
