"""Regime probes of one campaign that differ in one setting, or in nothing but the run, each set beside a baseline
probe: how far the setting moves the re-fed first step's agreement with the decode-time one (the share the
campaign's re-feed rate follows), and whether two runs replay the same rows at all.

The probes of one campaign replay its first problems, so they share their problems; an effect's interval resamples
the problems of both probes together (one resample of their union serves both: a paired problem bootstrap where
they share them), which keeps the problems' own spread out of the difference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from replaynoise.analysis.agreement import pivot_agreement, regime_stats, token_gaps, with_decode_rows
from replaynoise.analysis.paper_stats import Clusters, json_number

#: The bootstrap behind every interval here, and its coverage.
N_BOOT, SEED, CI = 2000, 0, 0.95
#: The keys that name one replayed row in every probe of a campaign, its prefix length included (two runs whose
#: rollouts differ can share a pivot id at another prefix).
ROW_KEYS = ["pass", "pivot_id", "branch", "k", "prefix_len"]


def probe_stats(steps: pl.DataFrame, mismatch: pl.DataFrame, decode: pl.DataFrame | None = None) -> dict[str, Any]:
    """``regime_stats`` of a probe's kept rows, each pivot's prefix length read from its exact rows; with the
    rollouts' batches and lengths (``decode``), the rows of each token's decode step too."""
    exact = steps.filter(pl.col("pass") == "exact").unique("pivot_id")
    gaps = token_gaps(mismatch, exact) if mismatch.height else None
    if gaps is not None and decode is not None:
        gaps = with_decode_rows(gaps, mismatch, decode)
    return regime_stats(pivot_agreement(steps), gaps)


def _shares(agreement: pl.DataFrame, name: str, labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per problem of ``labels``: pivots of pass ``name`` whose rows all equal exact's, and its pivots."""
    mine = agreement.filter(pl.col("pass") == name)
    index = {p: i for i, p in enumerate(labels)}
    codes = np.fromiter((index[p] for p in mine["problem_id"]), dtype=np.int64, count=mine.height)
    equal = np.bincount(codes, weights=mine["all_equal"].cast(pl.Float64).to_numpy(), minlength=len(labels))
    return equal, np.bincount(codes, minlength=len(labels)).astype(np.float64)


def _interval(replicates: np.ndarray) -> tuple[float | None, float | None]:
    valid = replicates[np.isfinite(replicates)]
    if valid.size == 0:
        return None, None
    lo, hi = np.quantile(valid, [(1 - CI) / 2, 1 - (1 - CI) / 2])
    return json_number(float(lo)), json_number(float(hi))


def agreement_effect(agreement: pl.DataFrame, base: pl.DataFrame | None, name: str) -> dict[str, Any]:
    """Pass ``name``'s share of pivots whose first steps all equal exact's, with its problem-bootstrap interval, and
    (given the ``base`` probe's agreement) its difference from the base's share, the problems resampled once for
    both."""
    frames = [agreement] if base is None else [agreement, base]
    labels = sorted(set().union(*(set(f["problem_id"].to_list()) for f in frames)))
    clusters = Clusters(codes=np.arange(len(labels)), n_groups=len(labels), n_boot=N_BOOT, seed=SEED)
    ratios = []
    for frame in frames:
        equal, pivots = _shares(frame, name, labels)
        with np.errstate(divide="ignore", invalid="ignore"):
            replicates = (clusters.counts @ equal) / (clusters.counts @ pivots)
        ratios.append((equal.sum() / pivots.sum() if pivots.sum() else None, replicates))
    share, replicates = ratios[0]
    out: dict[str, Any] = {"pivots": int(agreement.filter(pl.col("pass") == name).height), "share": None}
    if share is None:
        return out
    out["share"] = json_number(float(share))
    out["ci_lo"], out["ci_hi"] = _interval(replicates)
    if base is not None and ratios[1][0] is not None:
        out["base_share"] = json_number(float(ratios[1][0]))
        out["effect"] = json_number(float(share - ratios[1][0]))
        out["effect_ci_lo"], out["effect_ci_hi"] = _interval(replicates - ratios[1][1])
    return out


def same_rows(base: pl.DataFrame, other: pl.DataFrame) -> dict[str, Any]:
    """Whether two probes replayed the same rows: the shares of the base's problems the other replayed and of its
    pivots the other replayed at the same prefix, and per pass, of the rows both replayed, the share whose first
    steps are equal bit for bit."""
    pivots = base.select("pivot_id", "prefix_len").unique()
    shared = pivots.join(other.select("pivot_id", "prefix_len").unique(), on=["pivot_id", "prefix_len"], how="inner")
    joined = base.select(*ROW_KEYS, "next_digest").join(
        other.select(*ROW_KEYS, pl.col("next_digest").alias("other_digest")), on=ROW_KEYS, how="inner"
    )
    problems = set(base["problem_id"].to_list())
    out: dict[str, Any] = {
        "problems_shared": json_number(len(problems & set(other["problem_id"].to_list())) / len(problems))
        if problems
        else None,
        "pivots_shared": json_number(shared.height / pivots.height) if pivots.height else None,
        "rows_bitwise_equal": {},
    }
    for name in sorted(joined["pass"].unique()):
        mine = joined.filter(pl.col("pass") == name)
        equal = (mine["next_digest"] == mine["other_digest"]).mean()
        out["rows_bitwise_equal"][name] = {"rows": mine.height, "share": json_number(float(equal))}  # type: ignore[arg-type]
    out["identical"] = base.sort(ROW_KEYS).equals(other.sort(ROW_KEYS))
    return out


#: A probe's kept rows: its first steps, its re-fed prefix mismatch and, where kept, its rollouts' batches and lengths.
ProbeRows = tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame | None]


def factor_rows(probes: Mapping[str, ProbeRows], base: str) -> list[dict[str, Any]]:
    """One row per probe (name: its kept rows, ``folder_probe``'s): its statistics (``probe_stats``), the
    re-feed and replica first-step agreement with intervals and effects against probe ``base``, and whether it
    replayed the base's rows."""
    base_steps = probes[base][0]
    base_agreement = pivot_agreement(base_steps)
    rows = []
    for name, kept in probes.items():
        steps = kept[0]
        agreement = pivot_agreement(steps)
        stats = probe_stats(*kept)
        other = None if name == base else base_agreement
        rows.append(
            {
                "probe": name,
                "base": name == base,
                "refeed": agreement_effect(agreement, other, "refeed"),
                "replica": agreement_effect(agreement, other, "replica"),
                "change_point": stats.get("change_point"),
                "change_point_by_step": stats.get("change_point_by_step"),
                "change_point_by_rows": stats.get("change_point_by_rows"),
                "prefix": stats.get("prefix"),
                "first_step_by_length": stats.get("first_step_by_length"),
                "against_base": None if name == base else same_rows(base_steps, steps),
            }
        )
    return rows
