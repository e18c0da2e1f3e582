"""The prefix mismatch channel: how far a pass's own prefill of a pivot's prefix moves the log-probs the rollout
gave the prefix's tokens when it sampled them, in the metrics RL frameworks log for the same gap between their
rollout engine and their trainer, and whether a pivot's mismatch predicts that re-feeding flips its credit.

A re-feed is what every RL trainer does: the rollout engine decodes, the trainer feeds the sequence again and
recomputes its log-probs. verl and NeMo-RL monitor that gap under the names kept here (docs/method.md §8 gives
each definition and where each framework defines it), so a user can set our numbers beside their dashboards.
A pass that resumes the decode-time state (exact, replica, ...) computes no prefix, so it has no mismatch by
construction; only passes that build their own prefix state are scored.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl
from scipy.stats import mannwhitneyu
from statsmodels.discrete.discrete_model import Logit
from statsmodels.tools.sm_exceptions import ConvergenceWarning
from statsmodels.tools.tools import add_constant

from replaynoise.analysis.conditionings import CONDITIONINGS, select_pivots, wide_frame
from replaynoise.analysis.disagreement import disagree
from replaynoise.analysis.rl_metrics import DEFINITIONS as FRAMEWORK_DEFINITIONS
from replaynoise.analysis.rl_metrics import frameworks_by_pass
from replaynoise.settings import comparison_metric

#: The frameworks' metric names, in the order the tables show them.
METRICS = (
    "rollout_probs_diff_max",
    "rollout_probs_diff_mean",
    "rollout_probs_diff_std",
    "rollout_actor_probs_pearson_corr",
    "k3_kl",
)
DEFINITIONS = {
    "rollout_probs_diff_max": "max over tokens of |p_decode - p_refeed|, p = exp(log-prob of the token) "
    "(verl: training/rollout_probs_diff_max, verl/utils/debug/metrics.py)",
    "rollout_probs_diff_mean": "mean over tokens of |p_decode - p_refeed| (verl: training/rollout_probs_diff_mean)",
    "rollout_probs_diff_std": "standard deviation (n - 1 denominator, as torch.std) over tokens of "
    "|p_decode - p_refeed| (verl: training/rollout_probs_diff_std)",
    "rollout_actor_probs_pearson_corr": "Pearson correlation of p_decode and p_refeed over tokens (verl: "
    "training/rollout_actor_probs_pearson_corr)",
    "k3_kl": "mean over tokens of exp(r) - r - 1, r = log p_refeed - log p_decode: Schulman's k3 estimator of "
    "KL(decode || refeed) from tokens the decode sampled (verl: rollout_corr/k3_kl, "
    "verl/trainer/ppo/rollout_corr_helper.py; NeMo-RL: gen_kl_error with its default k3 KL, "
    "nemo_rl/algorithms/loss_functions.py)",
}
#: The per-pivot metrics the link to credit regresses the flip on, one at a time.
LINK_METRICS = ("k3_kl", "rollout_probs_diff_max", "rollout_probs_diff_mean")
#: Where a metric is zero (invariant kernels), its logarithm is taken at this floor instead.
LOG_FLOOR = 1e-12
#: Pivots per bin of the flip-rate-by-mismatch table at the least; at most ``MAX_BINS`` bins.
MIN_PER_BIN, MAX_BINS = 5, 4

MISMATCH_SCHEMA = {
    "pass": pl.Utf8,
    "pivot_id": pl.Utf8,
    "problem_id": pl.Utf8,
    "rollout": pl.Int64,
    "t": pl.Int64,
    "n_tokens": pl.Int64,
    "share_identical": pl.Float64,
    **{name: pl.Float64 for name in METRICS},
    "decode_logprobs": pl.List(pl.Float64),
    "refeed_logprobs": pl.List(pl.Float64),
}


def token_metrics(decode: np.ndarray, refeed: np.ndarray) -> dict[str, Any]:
    """The frameworks' metrics over one set of tokens: their log-probs at decode time and from a re-feed's
    prefill. ``None`` where a metric is undefined (no token; a deviation or correlation of one token; a
    correlation of a constant)."""
    decode, refeed = np.asarray(decode, dtype=np.float64), np.asarray(refeed, dtype=np.float64)
    if decode.shape != refeed.shape:
        raise ValueError(f"decode and re-feed log-probs differ in length: {decode.size} and {refeed.size}")
    n = int(decode.size)
    out: dict[str, Any] = {"n_tokens": n, "share_identical": None, **{name: None for name in METRICS}}
    if n == 0:
        return out
    p_decode, p_refeed = np.exp(decode), np.exp(refeed)
    diff = np.abs(p_decode - p_refeed)
    ratio = refeed - decode  # the trainer's log-prob minus the rollout engine's, as both frameworks take it
    out.update(
        share_identical=float(np.mean(decode.view(np.int64) == refeed.view(np.int64))),
        rollout_probs_diff_max=float(diff.max()),
        rollout_probs_diff_mean=float(diff.mean()),
        k3_kl=float(np.mean(np.expm1(ratio) - ratio)),
    )  # expm1: no cancellation at tiny r
    if n > 1:
        out["rollout_probs_diff_std"] = float(diff.std(ddof=1))
        if p_decode.std() > 0 and p_refeed.std() > 0:
            out["rollout_actor_probs_pearson_corr"] = float(np.corrcoef(p_decode, p_refeed)[0, 1])
    return out


def mismatch_rows(rollouts: pl.DataFrame, pivots: pl.DataFrame, passes: Mapping[str, pl.DataFrame]) -> pl.DataFrame:
    """One row per (pass, pivot) the pass scored: its prefix's response tokens' decode-time log-probs (the
    rollouts' ``response_logprobs``) against those its own prefill gave them (the pass's ``prefix_logprobs``),
    with the frameworks' metrics over them. Passes that resume the decode-time state score nothing and have no
    rows; rollouts generated before the decode-time log-probs were kept give none either."""
    if "response_logprobs" not in rollouts.columns:
        return pl.DataFrame(schema=MISMATCH_SCHEMA)
    decode = {(r["problem_id"], r.get("rollout", 0)): r["response_logprobs"] for r in rollouts.iter_rows(named=True)}
    where = {p["pivot_id"]: p for p in pivots.iter_rows(named=True)}
    rows = []
    for name in sorted(passes):
        frame = passes[name]
        if "prefix_logprobs" not in frame.columns:
            continue
        scored = frame.filter(pl.col("prefix_logprobs").is_not_null()).unique(
            "pivot_id", keep="first", maintain_order=True
        )
        for pivot_id, refeed in zip(scored["pivot_id"], scored["prefix_logprobs"]):
            p = where[pivot_id]
            rollout = p.get("rollout", 0)
            own = decode.get((p["problem_id"], rollout))
            if own is None:
                continue
            ids = own[: p["t"]]
            if len(ids) != len(refeed):
                raise ValueError(
                    f"pass {name!r}, pivot {pivot_id!r}: {len(refeed)} re-fed log-probs for a prefix "
                    f"of {len(ids)} response tokens"
                )
            rows.append(
                {
                    "pass": name,
                    "pivot_id": pivot_id,
                    "problem_id": p["problem_id"],
                    "rollout": rollout,
                    "t": p["t"],
                    **token_metrics(np.array(ids), np.array(refeed)),
                    "decode_logprobs": list(ids),
                    "refeed_logprobs": list(refeed),
                }
            )
    return pl.DataFrame(rows, schema=MISMATCH_SCHEMA).sort("pass", "pivot_id")


def pooled_metrics(rows: pl.DataFrame) -> dict[str, Any]:
    """A pass's metrics over all tokens of all its scored pivots, as a framework's batch metric pools the
    tokens of a batch; beside it the mean of the per-pivot k3_kl."""
    decode = np.concatenate([np.asarray(x, dtype=np.float64) for x in rows["decode_logprobs"]] or [np.zeros(0)])
    refeed = np.concatenate([np.asarray(x, dtype=np.float64) for x in rows["refeed_logprobs"]] or [np.zeros(0)])
    per_pivot = rows["k3_kl"].drop_nulls()
    return {
        "n_pivots": rows.height,
        **token_metrics(decode, refeed),
        "pivot_mean_k3_kl": float(per_pivot.mean()) if len(per_pivot) else None,
        "zero": bool(decode.size) and bool(np.all(decode.view(np.int64) == refeed.view(np.int64))),
    }


def auc(score: np.ndarray, label: np.ndarray) -> float | None:
    """P(score of a flipped pivot > score of an unflipped one), ties counted half (Mann-Whitney U / n1 n0)."""
    pos, neg = score[label], score[~label]
    if not pos.size or not neg.size:
        return None
    return float(mannwhitneyu(pos, neg).statistic / (pos.size * neg.size))


def logit_link(flip: np.ndarray, metric: np.ndarray, clusters: np.ndarray, ci: float) -> dict[str, Any]:
    """Logistic regression of the flip on log10(metric), standardised, with problem-clustered standard errors:
    the change in log-odds of a flip per standard deviation of the log-mismatch. ``reason`` says why not."""
    out = {
        "coef_per_sd": None,
        "se": None,
        "z": None,
        "p": None,
        "ci_lo": None,
        "ci_hi": None,
        "odds_ratio_per_sd": None,
        "n": int(flip.size),
        "n_clusters": int(np.unique(clusters).size),
        "reason": None,
    }
    x = np.log10(np.maximum(metric, LOG_FLOOR))
    if flip.all() or not flip.any():
        out["reason"] = "every pivot flips, or none does: nothing to regress"
        return out
    if not np.ptp(x) > 0:
        out["reason"] = "the mismatch is the same at every pivot"
        return out
    if out["n_clusters"] < 2:
        out["reason"] = "one problem: a clustered standard error needs two"
        return out
    z = (x - x.mean()) / x.std()
    try:
        with warnings.catch_warnings(), np.errstate(over="ignore"):  # non-convergence is reported below, by reason
            warnings.simplefilter("ignore", ConvergenceWarning)
            fit = Logit(flip.astype(np.float64), add_constant(z)).fit(
                disp=0, cov_type="cluster", cov_kwds={"groups": clusters}
            )
    except (np.linalg.LinAlgError, ValueError) as exc:  # statsmodels' perfect separation is a ValueError
        out["reason"] = f"the fit failed: {exc}"
        return out
    lo, hi = fit.conf_int(alpha=1 - ci)[1]
    coef = float(fit.params[1])
    # a slope that runs away (quasi-separation: a few pivots of extreme mismatch, all flipped) stops wherever the
    # optimiser's iterations end, so its digits move with the CPU's last bits: no number, the reason instead
    if not fit.mle_retvals.get("converged", True) or not np.isfinite(coef) or not np.isfinite(fit.bse[1]):
        out["reason"] = "the fit did not converge (separation)"
        return out
    out.update(
        coef_per_sd=coef,
        se=float(fit.bse[1]),
        z=float(fit.tvalues[1]),
        p=float(fit.pvalues[1]),
        ci_lo=float(lo),
        ci_hi=float(hi),
        odds_ratio_per_sd=float(np.exp(coef)),
    )
    return out


def flip_bins(metric: np.ndarray, flip: np.ndarray, floor: np.ndarray) -> list[dict[str, Any]]:
    """The flip rate and the floor's by bins of equal pivot counts along the mismatch (ties in sorted order)."""
    n_bins = min(MAX_BINS, metric.size // MIN_PER_BIN)
    if n_bins < 1:
        return []
    order = np.argsort(metric, kind="stable")
    bins = []
    for part in np.array_split(order, n_bins):
        refeed_rate, floor_rate = float(flip[part].mean()), float(floor[part].mean())
        bins.append(
            {
                "n": int(part.size),
                "lo": float(metric[part].min()),
                "hi": float(metric[part].max()),
                "median": float(np.median(metric[part])),
                "refeed_flip_rate": refeed_rate,
                "floor_flip_rate": floor_rate,
                "excess_pp": 100.0 * (refeed_rate - floor_rate),
            }
        )
    return bins


def credit_link(
    mismatch: pl.DataFrame,
    credit: Mapping[str, pl.DataFrame],
    *,
    conditioning: str,
    metric: str,
    min_eligible: int,
    ci: float,
) -> dict[str, Any]:
    """Does a pivot's prefix mismatch under the re-feed predict that the re-feed flips its credit? Over a
    conditioning's pivots with a scored prefix: the flip is D(exact, refeed) of the pivot under ``metric``, the
    floor's flip D(exact, replica)."""
    sel, reason = select_pivots(wide_frame(credit), conditioning)
    if sel is None:
        return {"available": False, "reason": reason}
    rows = mismatch.filter(pl.col("pass") == "refeed").select("pivot_id", *LINK_METRICS)
    sel = sel.join(rows, on="pivot_id", how="inner").filter(pl.col("k3_kl").is_not_null())
    if sel.height < min_eligible:
        return {
            "available": False,
            "n": sel.height,
            "reason": f"{sel.height} pivots with a scored re-fed prefix; statistics from {min_eligible} on",
        }
    a = {p: sel[f"a_hat__{p}"].cast(pl.Float64).to_numpy() for p in ("exact", "replica", "refeed")}
    flip, floor = disagree(a["exact"], a["refeed"], metric), disagree(a["exact"], a["replica"], metric)
    clusters = np.unique(sel["problem_id"].to_numpy(), return_inverse=True)[1]
    k3 = sel["k3_kl"].to_numpy()
    return {
        "available": True,
        "n": sel.height,
        "n_problems": int(clusters.max()) + 1,
        "metric": metric,
        "refeed_flip_rate": float(flip.mean()),
        "floor_flip_rate": float(floor.mean()),
        "mean_k3_kl": float(k3.mean()),
        "auc": {name: auc(sel[name].to_numpy(), flip) for name in LINK_METRICS},
        "logit": {name: logit_link(flip, sel[name].to_numpy(), clusters, ci) for name in LINK_METRICS},
        "bins_by": "k3_kl",
        "bins": flip_bins(k3, flip, floor),
    }


def sentence(config: str, summary: Mapping[str, Any], comparison: Mapping[str, Any]) -> str:
    """The tables' one line per configuration: its re-feed's k3_kl beside the credit flips beyond the floor (the
    headline excess of the main conditioning, as the headline table shows it)."""
    k3 = ((summary.get("passes") or {}).get("refeed") or {}).get("k3_kl")
    block = (comparison.get("conditionings") or {}).get("main") or {}
    stat = block.get("excess_pp") or {}
    excess = stat.get("estimate")
    if k3 is None:
        return f"{config}: no re-fed prefix was scored, so no k3_kl to set beside the credit flips."
    if excess is None:
        return (
            f"{config}: at this configuration's mean k3_kl of {k3:.3g}, too few eligible pivots to say how "
            "many decision-token credits re-feed flips beyond the floor."
        )
    ci = (
        f" [95% CI {stat['ci_lo']:+.1f}, {stat['ci_hi']:+.1f}]"
        if stat.get("ci_lo") is not None and stat.get("ci_hi") is not None
        else ""
    )
    return (
        f"{config}: at this configuration's mean k3_kl of {k3:.3g}, re-feed flips {excess:+.1f} pp{ci} of "
        f"decision-token credits beyond the floor (main conditioning, {comparison_metric(comparison)} "
        "metric)."
    )


def mismatch_summary(
    mismatch: pl.DataFrame,
    credit: Mapping[str, pl.DataFrame],
    comparison: Mapping[str, Any],
    *,
    config: str,
    metric: str,
    min_eligible: int,
    ci: float,
) -> dict[str, Any]:
    """``comparison.json → prefix_mismatch``: per scored pass its metrics over all its prefix tokens, NeMo-RL's and
    verl's own set with their alarms (``frameworks``, each pivot's prefix one sequence), the link to credit per
    conditioning, and the tables' sentence."""
    scored = sorted(set(mismatch["pass"].to_list()))
    out: dict[str, Any] = {
        "definitions": dict(DEFINITIONS),
        "passes": {name: pooled_metrics(mismatch.filter(pl.col("pass") == name)) for name in scored},
        "not_scored": sorted(p for p in credit if p not in scored),
        "not_scored_reason": "resumes the decode-time state (no prefix computed), is a transplant, re-tokenizes "
        "to other ids, or its rollouts kept no decode-time log-probs",
        "frameworks": {"definitions": dict(FRAMEWORK_DEFINITIONS), "passes": frameworks_by_pass(mismatch)},
        "credit_link": {
            cond: credit_link(mismatch, credit, conditioning=cond, metric=metric, min_eligible=min_eligible, ci=ci)
            for cond in CONDITIONINGS
        },
    }
    out["sentence"] = sentence(config, out, comparison)
    return out
