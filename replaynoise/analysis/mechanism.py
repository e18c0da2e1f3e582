"""The mechanism behind the re-feed rate: where a re-fed prefix's numbers stop equalling the decode-time ones.

A resumed continuation reads the KV the rollout's decode steps wrote; a re-fed one reads KV a prefill wrote.
Wherever an engine's decode and prefill kernels compute a position alike, the two states are equal bit for bit
and re-feeding changes nothing there; where a kernel switches (an attention tile or split, another GEMM), they
part. This measures that from what a run records, by position and by prefix length: each re-fed prefix token's
log-prob against the decode-time one (``mismatch.parquet``), each pass's first step against the exact pass's
(``first_steps``), and the passes' credit (re-feed rate, floor and excess per prefix-length bin).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from replaynoise.analysis.agreement import (
    BIN_WIDTH,
    DEFINITIONS,
    REFERENCE_PASS,
    bin_label,
    bin_of,
    first_step_shares,
    gap_stats,
    length_bins,
    per_bin,
    pivot_agreement,
    regime_stats,
    token_gaps,
)
from replaynoise.analysis.comparison import pair_disagreements, pair_sets
from replaynoise.analysis.conditionings import PAPER_CONDITIONING, wide_frame
from replaynoise.analysis.replicated import replicated_stats
from replaynoise.generation.passes import replicate_pairs


def _interval(stat: dict) -> tuple[float | None, float | None, str]:
    """The interval a bin reports: the crossed one where the pairs allow it, else the problem bootstrap's."""
    crossed = stat["crossed"]
    if crossed.get("ci_lo") is not None:
        return crossed["ci_lo"], crossed["ci_hi"], "crossed"
    boot = stat["problem_only"]
    return boot.get("ci_lo"), boot.get("ci_hi"), "problem_only"


def main_flips(
    credit: Mapping[str, pl.DataFrame], *, metric: str, conditioning: str = PAPER_CONDITIONING
) -> tuple[pl.DataFrame, np.ndarray, np.ndarray, np.ndarray]:
    """The per-pivot frame (with ``prefix_len``), each pair of draws' conditioning set (rows: pairs) and each
    pair's re-feed and floor flips, as the comparison forms them over the whole run."""
    wide = wide_frame(credit).join(
        credit[REFERENCE_PASS].select("pivot_id", "prefix_len"), on="pivot_id", how="left", maintain_order="left"
    )
    pairs = replicate_pairs(sorted(credit))
    masks, reason = pair_sets(wide, conditioning, pairs)
    if masks is None:
        raise ValueError(f"conditioning {conditioning!r} cannot be formed: {reason}")
    refeed, floor = pair_disagreements(wide, pairs, metric)
    return wide, masks.astype(bool), refeed, floor


def credit_by_length(
    wide: pl.DataFrame,
    masks: np.ndarray,
    refeed: np.ndarray,
    floor: np.ndarray,
    edges: Sequence[int],
    *,
    ci: float,
    n_boot: int,
    seed: int,
) -> list[dict[str, Any]]:
    """Per prefix-length bin: the pivots of the conditioning's sets (``main_flips``, over every pair of draws), the
    re-feed rate, the floor and the excess with its interval, as the comparison computes them over the whole run."""
    codes = np.unique(wide["problem_id"].to_numpy(), return_inverse=True)[1]
    where = bin_of(wide["prefix_len"].to_numpy(), edges)
    rows = []
    for i in range(len(edges)):
        inside = masks & (where == i)[None, :]
        row: dict[str, Any] = {"bin": bin_label(edges, i), "lo": int(edges[i]), "main_pivots": int(inside.sum())}
        if inside.any():
            stats = replicated_stats(codes, inside, refeed, floor, ci=ci, n_boot=n_boot, seed=seed)
            lo, hi, kind = _interval(stats["excess_pp"])
            row.update(
                refeed=stats["refeed"]["estimate"],
                floor=stats["floor"]["estimate"],
                excess_pp=stats["excess_pp"]["estimate"],
                excess_lo=lo,
                excess_hi=hi,
                interval=kind,
                problems=stats["n_problems"],
            )
        rows.append(row)
    return rows


def length_table(
    credit: Mapping[str, pl.DataFrame],
    agreement: pl.DataFrame | None,
    gaps: pl.DataFrame | None,
    *,
    metric: str,
    ci: float,
    n_boot: int,
    seed: int,
    width: int = BIN_WIDTH,
) -> pl.DataFrame:
    """One row per prefix-length bin: the pivots, first-step agreement of the first re-feed and replica draws with
    exact (where rows are kept), the re-fed prefix's gap to the decode-time log-probs (where the mismatch is kept),
    and the main conditioning's re-feed rate, floor and excess (``credit_by_length``)."""
    lengths = credit[REFERENCE_PASS].select("pivot_id", "problem_id", "prefix_len")
    wide, masks, refeed, floor = main_flips(credit, metric=metric)
    # bins wide enough for the rates: counted in the pivots of the first pair's set
    edges = length_bins(wide["prefix_len"].filter(pl.Series(masks[0])).to_list(), width)
    rows = credit_by_length(wide, masks, refeed, floor, edges, ci=ci, n_boot=n_boot, seed=seed)
    counts = per_bin(lengths, edges, [pl.len().alias("pivots")])
    columns: dict[str, dict[int, dict]] = {}
    if agreement is not None:
        for name in ("refeed", "replica"):
            mine = agreement.filter(pl.col("pass") == name)
            columns[name] = per_bin(
                mine,
                edges,
                [pl.col("equal").mean().alias("equal"), pl.col("all_equal").mean().alias("all_equal")],
            )
    by_bin_gaps: dict[int, dict] = {}
    if gaps is not None:
        first = gaps.filter(pl.col("pass") == "refeed").join(lengths, on="pivot_id", how="inner")
        binned = first.with_columns(bin=pl.Series(bin_of(first["prefix_len"].to_numpy(), edges), dtype=pl.Int64))
        by_bin_gaps = {r.pop("bin"): r for r in gap_stats(binned, ["bin"]).iter_rows(named=True)}
    for i, row in enumerate(rows):
        row["pivots"] = counts.get(i, {}).get("pivots", 0)
        for name in ("refeed", "replica"):
            got = columns.get(name, {}).get(i, {})
            row[f"first_step_equal_{name}"] = got.get("equal")
            row[f"first_step_all_equal_{name}"] = got.get("all_equal")
        got = by_bin_gaps.get(i, {})
        for key in ("equal_share", "token_mult_prob_error", "k3_kl"):
            row[f"prefix_{key}"] = got.get(key)
    return pl.DataFrame(rows, infer_schema_length=None)


def mechanism_summary(
    credit: Mapping[str, pl.DataFrame],
    steps: pl.DataFrame | None,
    mismatch: pl.DataFrame | None,
    *,
    metric: str,
    ci: float,
    n_boot: int,
    seed: int,
) -> dict[str, Any]:
    """Everything ``mechanism.json`` holds for one configuration: the prefix-length table, the per-position
    agreement of the first re-feed draw with its change point, and the overall first-step agreement of each pass."""
    agreement = pivot_agreement(steps) if steps is not None and not steps.is_empty() else None
    gaps = token_gaps(mismatch, credit[REFERENCE_PASS]) if mismatch is not None and not mismatch.is_empty() else None
    table = length_table(credit, agreement, gaps, metric=metric, ci=ci, n_boot=n_boot, seed=seed)
    stats = regime_stats(None, gaps)  # the prefix tokens' part: the length table holds the first steps by length
    if agreement is not None:  # every draw's, not only the first ones'
        stats["first_step"] = first_step_shares(agreement)
    return {"metric": metric, "definitions": DEFINITIONS, "by_length": table.to_dicts(), **stats}
