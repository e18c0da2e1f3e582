"""Which pivots a comparison keeps: the passes' credit frames joined into one row per pivot, and the
conditionings that select from it (method.md section 4; the paper's two first).

Apart from the statistics (``replaynoise.analysis.comparison``): figures and tables select pivots too, and a step that
draws a figure should not load statsmodels and scipy to do it.
"""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

from replaynoise.generation.passes import REQUIRED_PASSES

SELECTOR_PASS = "selector"
#: The paper's two conditionings first, then ours, then none.
CONDITIONINGS = ("main", "treatment_independent", "informative", "selector", "none")
#: the conditioning of the paper's Table 1 (what a reanalysis of its records prints)
PAPER_CONDITIONING = "main"

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


def pass_columns(name: str) -> dict[str, str]:
    """The wide frame's column names for one pass (``wide_frame``)."""
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
        cols = pass_columns(name)
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
    cols = pass_columns(name)
    if wide.filter(eligible & ~pl.col(cols["counts"])).height:
        return (
            f"pass {name!r} has no per-branch success counts (only Â, as in reanalysed records): "
            "informativeness (not both 0/K, not both K/K) cannot be decided"
        )
    return None


def keep_expression(
    wide: pl.DataFrame, conditioning: str, trio: tuple[str, str, str] = REQUIRED_PASSES
) -> tuple[pl.Expr | None, str | None]:
    """The row filter of a conditioning over one trio of passes (exact, a replica draw, a re-feed draw; by default
    the first draws), or (None, reason) when it cannot be formed. A replicated design forms one set per pair."""
    if conditioning not in CONDITIONINGS:
        raise ValueError(f"unknown conditioning {conditioning!r}; expected one of {CONDITIONINGS}")
    keep = pl.lit(True)
    for name in trio:
        keep = keep & pl.col(pass_columns(name)["eligible"])
    a_hat = {role: pl.col(pass_columns(name)["a_hat"]) for role, name in zip(REQUIRED_PASSES, trio)}
    if conditioning == "main":
        keep = keep & ((a_hat["exact"] != 0) | (a_hat["replica"] != 0) | (a_hat["refeed"] != 0))
    elif conditioning == "treatment_independent":
        keep = keep & (a_hat["exact"] != 0)
    elif conditioning == "informative":
        reason = _lacks_counts(wide, keep, trio[0])
        if reason:
            return None, reason
        keep = keep & pl.col(pass_columns(trio[0])["informative"])
    elif conditioning == "selector":
        cols = pass_columns(SELECTOR_PASS)
        if cols["eligible"] not in wide.columns:
            return None, f"no {SELECTOR_PASS!r} pass (an exact pass with fresh seeds) in this comparison"
        keep = keep & pl.col(cols["eligible"])
        reason = _lacks_counts(wide, keep, SELECTOR_PASS)
        if reason:
            return None, reason
        keep = keep & pl.col(cols["informative"])
    return keep, None


def select_pivots(
    wide: pl.DataFrame, conditioning: str, trio: tuple[str, str, str] = REQUIRED_PASSES
) -> tuple[pl.DataFrame | None, str | None]:
    """The pivots a conditioning keeps, or (None, reason) when it cannot be formed."""
    keep, reason = keep_expression(wide, conditioning, trio)
    return (None, reason) if keep is None else (wide.filter(keep), None)


def eligible_frame(credit: Mapping[str, pl.DataFrame], conditioning: str) -> pl.DataFrame | None:
    """The wide per-pivot frame restricted to a conditioning (None if it cannot be formed); used by figures."""
    sel, _ = select_pivots(wide_frame(credit), conditioning)
    return sel
