"""Per-pivot credit estimates from one pass's continuations.

The estimator is Â_t = (correct originals)/K - (correct substitutes)/K (method.md section 1). It lives on a
lattice of step 1/K, and the whole analysis compares estimates for *exact* equality, so Â is computed as
``(n_orig - n_sub) / K`` from integers: two passes with equal counts then give bitwise-equal floats.

Eligibility (method.md section 4) is decided here per pass; the analysis combines it across passes. Two rules:
``graded`` (the paper's): all 2K continuations present and graded, truncated ones included, and the exact state
verified; ``finished`` (ours): additionally every continuation ended with EOS, so a budget that cuts reasoning
short cannot count as a wrong answer.
"""

from __future__ import annotations

import polars as pl

from replaynoise.generation.passes import BRANCHES
from replaynoise.io import read_parquet

#: Eligibility rules, the paper's first (the default).
ELIGIBILITY = ("graded", "finished")

#: Columns of the frame ``compute_credit`` returns, in order.
CREDIT_COLUMNS = (
    "pivot_id",
    "problem_id",
    "pass_name",
    "t",
    "margin",
    "prefix_len",
    "rollout_correct",
    "k",
    "n_orig_correct",
    "n_sub_correct",
    "n_rows",
    "n_finished",
    "verified",
    "eligible",
    "a_hat",
)

_PASS_REQUIRED = ("pivot_id", "branch", "k", "correct", "finish_reason", "verified")
_PIVOT_REQUIRED = ("pivot_id", "problem_id", "t", "margin", "rollout_correct", "prefix_len")


def _require(df: pl.DataFrame, cols: tuple[str, ...], what: str) -> None:
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{what} frame lacks columns {missing}")


def validate_pass_frame(pass_df: pl.DataFrame, pivot_ids: set[str], k: int, pass_name: str) -> None:
    """Refuse a pass frame that cannot give a well-defined estimate.

    More than K rows for a branch, a duplicated continuation index or an unknown branch would silently bias
    Â (it divides by K, not by the rows present), so they are errors, not warnings.
    """
    _require(pass_df, _PASS_REQUIRED, f"pass {pass_name!r}")
    bad_branch = pass_df.filter(~pl.col("branch").is_in(list(BRANCHES)) | pl.col("branch").is_null())
    if bad_branch.height:
        values = sorted({str(v) for v in bad_branch["branch"].to_list()})
        raise ValueError(f"pass {pass_name!r}: unknown branch value(s) {values}; expected one of {BRANCHES}")
    bad_k = pass_df.filter(pl.col("k").is_null() | (pl.col("k") < 0) | (pl.col("k") >= k))
    if bad_k.height:
        raise ValueError(
            f"pass {pass_name!r}: continuation index k outside 0..{k - 1} "
            f"(e.g. pivot {bad_k['pivot_id'][0]!r}, k={bad_k['k'][0]})"
        )
    unknown = set(pass_df["pivot_id"].unique().to_list()) - pivot_ids
    if unknown:
        raise ValueError(
            f"pass {pass_name!r}: {len(unknown)} pivot id(s) not in the pivots frame, e.g. {sorted(unknown)[:3]}"
        )
    counts = pass_df.group_by("pivot_id", "branch").agg(pl.len().alias("n"), pl.col("k").n_unique().alias("nk"))
    over = counts.filter(pl.col("n") > k).sort("pivot_id", "branch")
    if over.height:
        row = over.row(0, named=True)
        raise ValueError(
            f"pass {pass_name!r}: pivot {row['pivot_id']!r} branch {row['branch']!r} has "
            f"{row['n']} rows, more than K={k} ({over.height} pivot-branch(es) affected)"
        )
    dup = counts.filter(pl.col("nk") < pl.col("n")).sort("pivot_id", "branch")
    if dup.height:
        row = dup.row(0, named=True)
        raise ValueError(
            f"pass {pass_name!r}: pivot {row['pivot_id']!r} branch {row['branch']!r} has a "
            f"duplicated continuation index k"
        )


def eligible_expr(eligibility: str, k: int) -> pl.Expr:
    """The per-pass eligibility of a pivot from ``n_rows``, ``n_finished`` and ``verified`` (see module doc).

    Also used by the reanalysis of published records (they record no finish reasons, so only ``graded``).
    """
    if eligibility not in ELIGIBILITY:
        raise ValueError(f"unknown eligibility rule {eligibility!r}; expected one of {ELIGIBILITY}")
    full = 2 * k
    rule = (pl.col("n_rows") == full) & pl.col("verified")
    if eligibility == "finished":
        rule = rule & (pl.col("n_finished") == full).fill_null(False)
    return rule


def compute_credit(
    pass_df: pl.DataFrame, pivots_df: pl.DataFrame, k: int, pass_name: str, eligibility: str
) -> pl.DataFrame:
    """One row per pivot of ``pivots_df`` with the pass's success counts, eligibility and Â.

    Pivots without any row in the pass still appear (eligible False, ``a_hat`` null) so that a pass that lost
    work shows as ineligible pivots rather than as a smaller, silently different pivot set.
    A null ``correct`` counts as not correct; ``verified`` is False for a pivot without rows.
    ``eligibility``: ``graded`` (the paper's) or ``finished`` (ours), as in the module doc.
    """
    if k < 1:
        raise ValueError(f"K must be >= 1, got {k}")
    eligible = eligible_expr(eligibility, k)
    _require(pivots_df, _PIVOT_REQUIRED, "pivots")
    if pivots_df["pivot_id"].n_unique() != pivots_df.height:
        raise ValueError("pivots frame has duplicated pivot_id values")
    validate_pass_frame(pass_df, set(pivots_df["pivot_id"].to_list()), k, pass_name)

    correct = pl.col("correct").cast(pl.Boolean).fill_null(False)
    agg = pass_df.group_by("pivot_id").agg(
        (correct & (pl.col("branch") == "orig")).sum().cast(pl.Int64).alias("n_orig_correct"),
        (correct & (pl.col("branch") == "sub")).sum().cast(pl.Int64).alias("n_sub_correct"),
        pl.len().cast(pl.Int64).alias("n_rows"),
        (pl.col("finish_reason") == "eos").fill_null(False).sum().cast(pl.Int64).alias("n_finished"),
        pl.col("verified").fill_null(False).all().alias("verified"),
    )
    pivots = pivots_df.select(
        pl.col("pivot_id").cast(pl.String),
        pl.col("problem_id").cast(pl.String),
        pl.col("t").cast(pl.Int64),
        pl.col("margin").cast(pl.Float64),
        pl.col("prefix_len").cast(pl.Int64),
        pl.col("rollout_correct").cast(pl.Boolean),
    )
    out = pivots.join(agg, on="pivot_id", how="left", maintain_order="left").with_columns(
        pl.col("n_orig_correct", "n_sub_correct", "n_rows", "n_finished").fill_null(0),
        pl.col("verified").fill_null(False),
        pl.lit(pass_name, dtype=pl.String).alias("pass_name"),
        pl.lit(k, dtype=pl.Int64).alias("k"),
    )
    out = out.with_columns(
        eligible.alias("eligible"),
        pl.when(pl.col("n_rows") > 0)
        .then((pl.col("n_orig_correct") - pl.col("n_sub_correct")).cast(pl.Float64) / k)
        .otherwise(None)
        .alias("a_hat"),
    )
    return out.select(CREDIT_COLUMNS)


def read_credit_grid(files: list[str], configs: list[str], passes: list[str]) -> dict[str, dict[str, pl.DataFrame]]:
    """Credit frames as config -> pass -> frame, from files listed config-major, pass-minor (as the rules do)."""
    if len(files) != len(configs) * len(passes):
        raise ValueError(f"expected {len(configs) * len(passes)} credit files, got {len(files)}")
    it = iter(files)
    return {c: {p: read_parquet(next(it)) for p in passes} for c in configs}
