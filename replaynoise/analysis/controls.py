"""Why re-feeding moves the credit: the cache-transplant and fixed-prefix precision controls (method.md §7).

A transplant pass is its recipient pass (batch layout, first forward, noise) with its donor's prefix KV swapped
in. If the divergence follows the cache, its continuations agree with the donor's where donor and recipient
differ; if something else on the path carries it, they stay with the recipient. A precision arm asks whether
computing the re-fed prefix (or the continuation) in float32 removes the disagreement, and how far the caches
still drift.

Every share is a ratio over rows or pivots with a problem-cluster bootstrap CI, as in the analysis.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import polars as pl

from replaynoise.analysis.channels import row_identity
from replaynoise.analysis.disagreement import disagree
from replaynoise.analysis.paper_stats import Clusters, ratio_stat
from replaynoise.generation.passes import pass_spec

_KEYS = ("pivot_id", "branch", "k")
#: channels compared row by row (continuations) and pivot by pivot (the estimate)
ROW_CHANNELS = ("token_ids", "next_topk")
CHANNELS = (*ROW_CHANNELS, "a_hat")
#: The rows of the precision table before the arms: the replica floor and the measurement itself, in the model's
#: dtype (arm, pass, the pass it is compared with).
REFERENCE_ARMS = (("replica floor", "replica", "exact"), ("model dtype", "refeed", "exact"))


def _row_same(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """Per row of ``a`` present in ``b``, with its problem: each row channel bitwise equal or not."""
    return row_identity("a", a, "b", b, keep=("problem_id",))[0]


def _pivot_same(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """Per pivot with an estimate in both: Â equal (exactly: it lives on a 1/K lattice)."""
    joined = a.select("pivot_id", "problem_id", "a_hat").join(
        b.select("pivot_id", "a_hat"), on="pivot_id", how="inner", suffix="__b"
    )
    joined = joined.filter(pl.col("a_hat").is_not_null() & pl.col("a_hat__b").is_not_null())
    return joined.select("pivot_id", "problem_id", (pl.col("a_hat") == pl.col("a_hat__b")).alias("a_hat"))


def _share(
    same: np.ndarray, problems: list[str], *, n_boot: int, seed: int, ci: float, within: np.ndarray | None = None
) -> dict:
    """Share of ``same`` (over the rows where ``within``), with a problem-cluster bootstrap CI."""
    within = np.ones(len(same), dtype=bool) if within is None else within
    clusters = Clusters.from_ids(problems, n_boot, seed)
    stat = ratio_stat(same.astype(np.float64) * within, within.astype(np.float64), clusters, ci)
    return {**stat, "n": int(within.sum()), "n_same": int((same & within).sum())}


def transplant_summary(
    passes: Mapping[str, pl.DataFrame], credit: Mapping[str, pl.DataFrame], *, n_boot: int, seed: int, ci: float
) -> dict[str, Any]:
    """For every transplant pass run beside its donor and recipient: per channel, the share identical with the
    donor and with the recipient, over all rows (pivots) and over those where donor and recipient differ (the
    follow-up paper's endpoint: whom does the continuation follow)."""
    out: dict[str, Any] = {}
    for name in sorted(passes):
        spec = pass_spec(name)
        if spec.donor is None or spec.donor not in passes or spec.recipient not in passes:
            continue
        lo, hi = spec.source.layers
        drift = passes[name]["kv_maxdiff"].drop_nulls() if "kv_maxdiff" in passes[name].columns else pl.Series([])
        entry: dict[str, Any] = {
            "donor": spec.donor,
            "recipient": spec.recipient,
            "layers": [lo, hi],
            "n_layers": len(drift[0]) if len(drift) else None,
            "channels": {},
        }
        rows = {
            role: _row_same(passes[name], passes[other])
            for role, other in (("donor", spec.donor), ("recipient", spec.recipient))
        }
        between = _row_same(passes[spec.donor], passes[spec.recipient])
        rows = {
            role: frame.join(
                between.select(*_KEYS, *[pl.col(c).alias(f"{c}__dr") for c in ROW_CHANNELS]),
                on=list(_KEYS),
                how="inner",
            )
            for role, frame in rows.items()
        }
        pivots = {}
        if all(p in credit for p in (name, spec.donor, spec.recipient)):
            between_p = _pivot_same(credit[spec.donor], credit[spec.recipient]).select(
                "pivot_id", pl.col("a_hat").alias("a_hat__dr")
            )
            pivots = {
                role: _pivot_same(credit[name], credit[other]).join(between_p, on="pivot_id", how="inner")
                for role, other in (("donor", spec.donor), ("recipient", spec.recipient))
            }
        for channel in CHANNELS:
            frames = rows if channel in ROW_CHANNELS else pivots
            if not frames:
                continue
            block: dict[str, Any] = {}
            for role, frame in frames.items():
                same, problems = frame[channel].to_numpy().astype(bool), frame["problem_id"].to_list()
                differ = ~frame[f"{channel}__dr"].to_numpy().astype(bool)
                block[f"with_{role}"] = _share(same, problems, n_boot=n_boot, seed=seed, ci=ci)
                block[f"follows_{role}_where_they_differ"] = _share(
                    same, problems, n_boot=n_boot, seed=seed, ci=ci, within=differ
                )
            block["donor_and_recipient_differ"] = int(differ.sum())
            entry["channels"][channel] = block
        out[name] = entry
    return out


def _main_pair(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """The pivots eligible in both passes with a nonzero estimate in either (the paper's main-set rule, for a
    pair of passes)."""
    cols = ("pivot_id", "problem_id", "a_hat", "eligible")
    joined = a.select(cols).join(b.select(cols[0], *cols[2:]), on="pivot_id", how="inner", suffix="__b")
    return joined.filter(
        pl.col("eligible").fill_null(False)
        & pl.col("eligible__b").fill_null(False)
        & ((pl.col("a_hat") != 0) | (pl.col("a_hat__b") != 0))
    )


def _drift(frame: pl.DataFrame) -> dict[str, Any] | None:
    """max |dKV| against the stored decode-time KV: per pivot (its largest layer), and the median per layer."""
    if "kv_maxdiff" not in frame.columns:
        return None
    per_pivot = frame.filter(pl.col("kv_maxdiff").is_not_null()).group_by("pivot_id").agg(pl.col("kv_maxdiff").first())
    if per_pivot.height == 0:
        return None
    layers = np.array(per_pivot["kv_maxdiff"].to_list(), dtype=np.float64)  # [pivots, layers]
    worst = layers.max(axis=1)
    return {
        "pivots": per_pivot.height,
        "median": float(np.median(worst)),
        "max": float(worst.max()),
        "share_nonzero": float((worst > 0).mean()),
        "per_layer_median": [float(v) for v in np.median(layers, axis=0)],
    }


def precision_summary(
    passes: Mapping[str, pl.DataFrame],
    credit: Mapping[str, pl.DataFrame],
    *,
    metric: str,
    n_boot: int,
    seed: int,
    ci: float,
) -> list[dict[str, Any]]:
    """One row per arm run: the measurement itself (re-feed against exact, in the model's dtype) and each
    precision arm against the pass it is compared with. Rates of disagreement of Â (``metric``) over the pair's
    main set, continuation-token and first-step identity over rows, and the re-fed cache's drift."""
    arms = list(REFERENCE_ARMS) + [
        (spec.precision[0], name, spec.precision[1])
        for name in sorted(passes)
        for spec in [pass_spec(name)]
        if spec.precision is not None
    ]
    out = []
    for arm, test, reference in arms:
        if test not in passes or reference not in passes or test not in credit or reference not in credit:
            continue
        pair = _main_pair(credit[reference], credit[test])
        problems = pair["problem_id"].to_list()
        flips = disagree(pair["a_hat"].to_numpy(), pair["a_hat__b"].to_numpy(), metric)
        rows = _row_same(passes[test], passes[reference])
        row_problems = rows["problem_id"].to_list()
        out.append(
            {
                "arm": arm,
                "pass": test,
                "compared_with": reference,
                "metric": metric,
                "n": pair.height,
                "n_problems": len(set(problems)),
                "disagreement": _share(flips, problems, n_boot=n_boot, seed=seed, ci=ci),
                "tokens_identical": _share(
                    rows["token_ids"].to_numpy().astype(bool), row_problems, n_boot=n_boot, seed=seed, ci=ci
                ),
                "first_step_identical": _share(
                    rows["next_topk"].to_numpy().astype(bool), row_problems, n_boot=n_boot, seed=seed, ci=ci
                ),
                "kv_drift": _drift(passes[test]),
            }
        )
    return out


def control_summary(
    passes: Mapping[str, pl.DataFrame],
    credit: Mapping[str, pl.DataFrame],
    *,
    metric: str,
    n_boot: int,
    seed: int,
    ci: float,
) -> dict[str, Any]:
    """comparison.json's ``controls`` block: the transplants and the precision arms this run has."""
    return {
        "transplant": transplant_summary(passes, credit, n_boot=n_boot, seed=seed, ci=ci),
        "precision": precision_summary(passes, credit, metric=metric, n_boot=n_boot, seed=seed, ci=ci),
    }
