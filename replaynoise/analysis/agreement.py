"""Bitwise agreement with the decode-time state: of each pass's first step with the exact pass's, and of each re-fed
prefix token's log-prob with the one the rollout's decode gave it, by the keys its step attended and by prefix length.

What a regime probe reports and what a campaign's mechanism table is built on (``analysis.mechanism``). A resumed
continuation reads the KV the rollout's decode steps wrote, a re-fed one KV a prefill wrote: where the engine's
kernels compute a position alike in both, the states are equal bit for bit; a kernel switch shows as a change point.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from replaynoise.analysis.paper_stats import json_number
from replaynoise.analysis.rl_metrics import TOKEN_MULT_PROB_ALARM

#: What a run keeps of each pass's rows for the first-step comparison: the row's ids, its prefix, how the prefix
#: state was read, the first step's digest (top-k log-probs and the sampled token) and its top-1.
FIRST_STEP_SCHEMA = {
    "pass": pl.String,
    "pivot_id": pl.String,
    "problem_id": pl.String,
    "branch": pl.String,
    "k": pl.Int64,
    "prefix_len": pl.Int64,
    "verified": pl.Boolean,
    "next_digest": pl.String,
    "top1_id": pl.Int64,
    "top1_logprob": pl.Float64,
    "cached_tokens": pl.Int64,
    "tail_tokens": pl.Int64,
}
#: The pass every other pass's first step and prefix are set against.
REFERENCE_PASS = "exact"
#: Prefix-length bins: this many tokens wide, the outermost merged inward until each holds ``MIN_BIN_PIVOTS``.
BIN_WIDTH, MIN_BIN_PIVOTS = 32, 20
#: What ``gap_stats`` gives per group, in order.
GAP_STATS = ("tokens", "equal_share", "token_mult_prob_error", "k3_kl")
#: A change point is named only where the shares either side of it differ by this much: below it there is no switch.
MIN_STEP = 0.1
DEFINITIONS = {
    "keys": "the keys a step attends: the log-prob of the token at absolute position p comes from the step whose "
    "query is position p - 1, attending positions 0..p - 1",
    "equal_share": "share of re-fed prefix tokens whose log-prob equals the decode-time one bit for bit",
    "token_mult_prob_error": "mean over tokens of exp(|log p_refeed - log p_decode|) (NeMo-RL's decode-vs-prefill "
    f"check, tools/model_diagnostics/2.long_generation_decode_vs_prefill.py; its alarm {TOKEN_MULT_PROB_ALARM})",
    "k3_kl": "mean over tokens of exp(r) - r - 1, r = log p_refeed - log p_decode (verl's rollout_corr/k3_kl)",
    "first_step_equal": "share of a pass's rows whose first step (top-k log-probs and sampled token, by digest) equals "
    "the exact pass's on the same (pivot, branch, k)",
    "first_step_all_equal": "share of pivots all of whose rows' first steps equal the exact pass's",
    "change_point": "the key count that best splits the positions into an equal-more-often part below and an "
    "equal-less-often part above (least squares over two constant shares, positions weighted by their tokens); "
    f"none where the two shares differ by less than {MIN_STEP}",
    "change_point_by_step": "the same split over the rollout's decode steps (a token's index in the response) "
    "instead of keys: a switch that follows the decode batch, which shrinks as rows finish, is sharper by step; one "
    "that follows an attention kernel's tile is sharper by keys",
    "change_point_by_rows": "the same split over how many sequences the decode step that sampled the token ran (a "
    "probe's rows only, which keep each rollout's batch and length): where a decode GEMM's rows part from a prefill's",
    "spread": "the split's binomial sum of squares per token, sum of n p (1 - p) over its two parts over all tokens: "
    "the lower, the sharper",
}


# --------------------------------------------------------------------------------------------- first steps
def first_steps(passes: Mapping[str, pl.DataFrame]) -> pl.DataFrame:
    """One row per pass and continuation row (greedy probe rows, k < 0, left out) in ``FIRST_STEP_SCHEMA``: the
    rows a first-step comparison needs, small enough to keep beside the credit tables."""
    frames = []
    for name in sorted(passes):
        rows = passes[name].filter(pl.col("k") >= 0)
        columns = []
        for column, dtype in FIRST_STEP_SCHEMA.items():
            if column == "pass":
                columns.append(pl.lit(name, dtype=dtype).alias(column))
            elif column == "top1_id" and "next_topk_ids" in rows.columns:
                columns.append(pl.col("next_topk_ids").list.first().cast(dtype).alias(column))
            elif column == "top1_logprob" and "next_topk_logprobs" in rows.columns:
                columns.append(pl.col("next_topk_logprobs").list.first().cast(dtype).alias(column))
            elif column in rows.columns:
                columns.append(pl.col(column).cast(dtype))
            else:
                columns.append(pl.lit(None, dtype=dtype).alias(column))
        frames.append(rows.select(columns))
    if not frames:
        return pl.DataFrame(schema=FIRST_STEP_SCHEMA)
    return pl.concat(frames).sort("pass", "pivot_id", "branch", "k")


def pivot_agreement(steps: pl.DataFrame, reference: str = REFERENCE_PASS) -> pl.DataFrame:
    """Per pass other than ``reference`` and pivot: the share of its rows whose first step equals the reference
    pass's bit for bit, whether all do, and the mean |delta| of the top-1 log-prob where both chose one top-1."""
    keys = ["pivot_id", "branch", "k"]
    ref = steps.filter(pl.col("pass") == reference).select(
        *keys,
        pl.col("next_digest").alias("digest_ref"),
        pl.col("top1_id").alias("top1_ref"),
        pl.col("top1_logprob").alias("logprob_ref"),
    )
    joined = steps.filter(pl.col("pass") != reference).join(ref, on=keys, how="inner").sort("pass", *keys)
    same_top1 = pl.col("top1_id") == pl.col("top1_ref")
    return (
        joined.with_columns(equal=pl.col("next_digest") == pl.col("digest_ref"))
        .group_by("pass", "pivot_id", maintain_order=True)
        .agg(
            pl.col("problem_id").first(),
            pl.col("prefix_len").first(),
            pl.len().alias("rows"),
            pl.col("equal").mean().alias("equal"),
            pl.col("equal").all().alias("all_equal"),
            (pl.col("top1_logprob") - pl.col("logprob_ref")).abs().filter(same_top1).mean().alias("top1_gap"),
        )
        .sort("pass", "pivot_id")
    )


# --------------------------------------------------------------------------------------------- positions
def token_gaps(mismatch: pl.DataFrame, lengths: pl.DataFrame) -> pl.DataFrame:
    """One row per pass, pivot and re-fed prefix token: its absolute position (the keys its step attended), the
    rollout's decode step that sampled it (its index in the response) and its decode-time and re-fed log-probs. The
    tokens of a pivot's prefix are the last ``len(decode_logprobs)`` before its ``prefix_len`` (``lengths``: one row
    per pivot, ``pivot_id`` and ``prefix_len``); pivots with no scored token are left out."""
    frame = mismatch.select("pass", "pivot_id", "t", "decode_logprobs", "refeed_logprobs").filter(
        pl.col("decode_logprobs").list.len() > 0
    )
    frame = frame.join(lengths.select("pivot_id", "prefix_len"), on="pivot_id", how="inner")
    frame = frame.with_columns(
        pl.int_ranges(pl.col("prefix_len") - pl.col("decode_logprobs").list.len(), pl.col("prefix_len")).alias("keys")
    )
    return frame.explode("keys", "decode_logprobs", "refeed_logprobs").select(
        "pass",
        "pivot_id",
        pl.col("keys").cast(pl.Int64),
        (pl.col("keys") - pl.col("prefix_len") + pl.col("t")).cast(pl.Int64).alias("step"),
        pl.col("decode_logprobs").alias("decode"),
        pl.col("refeed_logprobs").alias("refeed"),
    )


def with_decode_rows(gaps: pl.DataFrame, mismatch: pl.DataFrame, decode: pl.DataFrame) -> pl.DataFrame:
    """``gaps`` with ``rows``: how many sequences the decode step that sampled each token ran, its batch's rollouts
    whose responses reach past that step (``decode``: per rollout its batch and response length). A decode step's
    GEMMs have that many rows; a prefill's have its tokens."""
    owner = mismatch.select("pivot_id", "problem_id", "rollout").unique("pivot_id")
    frame = gaps.join(owner, on="pivot_id", how="left").join(
        decode.select("problem_id", "rollout", "batch"), on=["problem_id", "rollout"], how="left"
    )
    rows = np.zeros(frame.height, dtype=np.int64)
    batch, step = frame["batch"].to_numpy(), frame["step"].to_numpy()
    for b, lengths in decode.group_by("batch").agg(pl.col("response_len")).iter_rows():
        at = batch == b
        ends = np.sort(np.asarray(lengths, dtype=np.int64))
        rows[at] = ends.size - np.searchsorted(ends, step[at], side="right")
    return frame.drop("problem_id", "rollout", "batch").with_columns(rows=pl.Series(rows))


def gap_stats(gaps: pl.DataFrame, by: Sequence[str] = ()) -> pl.DataFrame:
    """Per group of ``by`` (one group without): tokens, equal_share, token_mult_prob_error and k3_kl
    (``DEFINITIONS``). Summed in one fixed order, the rows sorted by group, pass, pivot and keys and reduced by numpy,
    so that the bits do not depend on the thread count (a parallel sum adds in the order its threads finish)."""
    order = [*by, *(c for c in ("pass", "pivot_id", "keys") if c not in by)]
    frame = gaps.sort(order)
    decode, refeed = frame["decode"].to_numpy(), frame["refeed"].to_numpy()
    r = refeed - decode
    values = np.column_stack([(refeed == decode).astype(np.float64), np.exp(np.abs(r)), np.exp(r) - r - 1.0])
    if by:
        changed = frame.select(pl.any_horizontal([pl.col(c).ne_missing(pl.col(c).shift(1)) for c in by]))
        starts = np.flatnonzero(changed.to_series().to_numpy())
    else:
        starts = np.array([0] if frame.height else [], dtype=np.int64)
    if starts.size == 0:
        return pl.DataFrame(schema={**{c: gaps.schema[c] for c in by}, **dict.fromkeys(GAP_STATS, pl.Float64)})
    sums = np.add.reduceat(values, starts, axis=0)
    tokens = np.diff(np.append(starts, frame.height)).astype(np.float64)
    stats = pl.DataFrame(
        {"tokens": tokens, **{name: sums[:, i] / tokens for i, name in enumerate(GAP_STATS[1:])}},
    )
    return pl.concat([frame[starts].select(by), stats], how="horizontal") if by else stats


def position_agreement(gaps: pl.DataFrame) -> pl.DataFrame:
    """Per pass and key count: tokens scored there, the share equal bit for bit, NeMo-RL's token_mult_prob_error
    and k3_kl (``DEFINITIONS``)."""
    return gap_stats(gaps, ["pass", "keys"])


def change_point(keys: np.ndarray, tokens: np.ndarray, equal_share: np.ndarray, name: str = "keys") -> dict[str, Any]:
    """The key count (or, by ``name``, other ordered position) where bitwise equality changes most
    (``DEFINITIONS['change_point']``): the split of the ordered positions that minimises the two parts' binomial sums
    of squares, with each part's share and tokens, and ``spread``, that sum per token: the lower, the sharper the
    switch, which tells a switch by keys (an attention kernel's tile) from one by decode step (the batch a step
    decoded, which shrinks as rows finish)."""
    order = np.argsort(keys)
    keys, n = np.asarray(keys)[order], np.asarray(tokens, dtype=np.float64)[order]
    e = np.asarray(equal_share, dtype=np.float64)[order] * n
    out: dict[str, Any] = {name: None, "share_below": None, "share_above": None, "tokens_below": 0, "tokens_above": 0}
    if keys.size < 2:
        return out
    n_lo, e_lo = np.cumsum(n)[:-1], np.cumsum(e)[:-1]
    n_hi, e_hi = n.sum() - n_lo, e.sum() - e_lo
    sse = e_lo - e_lo**2 / n_lo + e_hi - e_hi**2 / n_hi  # sum of p(1 - p) n over each part
    best = int(np.argmin(sse))
    below, above = e_lo[best] / n_lo[best], e_hi[best] / n_hi[best]
    if abs(below - above) < MIN_STEP:  # equal (or unequal) alike everywhere: no switch to name
        share = json_number(e.sum() / n.sum())
        return {**out, "share_below": share, "share_above": share, "tokens_below": int(n.sum())}
    return {
        name: int(keys[best + 1]),
        "share_below": json_number(below),
        "share_above": json_number(above),
        "tokens_below": int(n_lo[best]),
        "tokens_above": int(n_hi[best]),
        "spread": json_number(float(sse[best] / n.sum())),
    }


# --------------------------------------------------------------------------------------------- prefix-length bins
def length_bins(lengths: Sequence[int], width: int = BIN_WIDTH, minimum: int = MIN_BIN_PIVOTS) -> list[int]:
    """Left edges of the prefix-length bins: ``width`` tokens each, from the shortest prefix's multiple of
    ``width``; the outermost bins merged inward until each holds ``minimum`` of ``lengths`` (or one bin is left).
    The last bin is open above."""
    values = np.asarray(lengths, dtype=np.int64)
    if values.size == 0:
        return []
    lo = int(values.min()) // width * width
    edges = list(range(lo, int(values.max()) + 1, width))
    counts = [int(((values >= a) & (values < a + width)).sum()) for a in edges]
    while len(edges) > 1 and counts[-1] < minimum:  # the last bin joins the one below it
        last = counts.pop()
        counts[-1] += last
        edges.pop()
    while len(edges) > 1 and counts[0] < minimum:  # the first bin takes in the one above it
        first = counts.pop(0)
        counts[0] += first
        edges.pop(1)
    return edges


def bin_of(lengths: np.ndarray, edges: Sequence[int]) -> np.ndarray:
    """The index of each length's bin (``length_bins``): the last edge at or below it."""
    return np.searchsorted(np.asarray(edges), np.asarray(lengths), side="right") - 1


def bin_label(edges: Sequence[int], i: int) -> str:
    return f"{edges[i]}-{edges[i + 1] - 1}" if i + 1 < len(edges) else f">= {edges[i]}"


def per_bin(frame: pl.DataFrame, edges: Sequence[int], aggregates: list[pl.Expr]) -> dict[int, dict]:
    if frame.is_empty():
        return {}
    binned = frame.with_columns(bin=pl.Series(bin_of(frame["prefix_len"].to_numpy(), edges)))
    return {r.pop("bin"): r for r in binned.group_by("bin").agg(aggregates).iter_rows(named=True)}


def first_step_shares(agreement: pl.DataFrame, names: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per pass of ``names`` (default: every pass of ``agreement``, ordered) that has rows: its pivots, the share of
    its rows whose first step equals exact's and the share of pivots all of whose rows do."""
    names = sorted(agreement["pass"].unique()) if names is None else names
    shares = {}
    for name in names:
        mine = agreement.filter(pl.col("pass") == name)
        if not mine.is_empty():
            shares[name] = {
                "pivots": mine.height,
                "equal": json_number(mine["equal"].mean()),
                "all_equal": json_number(mine["all_equal"].mean()),
            }
    return shares


def regime_stats(agreement: pl.DataFrame | None, gaps: pl.DataFrame | None) -> dict[str, Any]:
    """What a regime probe reports, computed alike from a probe's rows and from a committed campaign's (so that one
    can be checked against the other): the first step's agreement of refeed and replica with exact, by prefix-length
    bin too, and the re-fed prefix tokens' equality, token_mult_prob_error and k3_kl with the change point by keys."""
    out: dict[str, Any] = {}
    if agreement is not None and not agreement.is_empty():
        out["first_step"] = first_step_shares(agreement, ("refeed", "replica"))
        refeed = agreement.filter(pl.col("pass") == "refeed")
        if not refeed.is_empty():
            edges = length_bins(refeed["prefix_len"].to_list())
            binned = per_bin(
                refeed, edges, [pl.len().alias("pivots"), pl.col("all_equal").mean().alias("first_step_all_equal")]
            )
            out["first_step_by_length"] = [
                {"bin": bin_label(edges, i), "lo": edges[i], **binned.get(i, {"pivots": 0})} for i in range(len(edges))
            ]
    if gaps is not None and not gaps.is_empty():
        refeed_gaps = gaps.filter(pl.col("pass") == "refeed")
        overall = gap_stats(refeed_gaps).to_dicts()[0]
        out["prefix"] = {key: json_number(value) for key, value in overall.items()}
        out["prefix"]["alarm"] = bool(overall["token_mult_prob_error"] > TOKEN_MULT_PROB_ALARM)
        positions = position_agreement(refeed_gaps)
        out["change_point"] = change_point(
            positions["keys"].to_numpy(), positions["tokens"].to_numpy(), positions["equal_share"].to_numpy()
        )
        for column in ("step", "rows"):
            if column in refeed_gaps.columns:
                by = gap_stats(refeed_gaps, [column])
                out[f"change_point_by_{column}"] = change_point(
                    by[column].to_numpy(), by["tokens"].to_numpy(), by["equal_share"].to_numpy(), name=column
                )
        out["by_keys"] = positions.drop("pass").to_dicts()
    return out
