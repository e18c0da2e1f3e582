"""What the exact pass resumed: how many of its pivots resumed a verified decode-time state, and the gate that
stops a comparison where too few did (``analysis.min_verified``). Apart from the comparison's statistics, so that
a partial reference folder and a re-analysis count them as the workflow's compare step does."""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl


def verification_summary(
    exact_credit: pl.DataFrame, refeed_pass: pl.DataFrame | None = None, exact_pass: pl.DataFrame | None = None
) -> dict:
    """How many pivots resumed from a verified decode-time state (the paper reports 100%), how many of them a
    re-step of the last prefix token over the stored KV reproduces bitwise (HF engine: a measured channel of
    batch variance, not a gate), and how far the re-fed KV moved from it (max |dKV| over layers at the pivot)."""
    n = exact_credit.height
    verified = int(exact_credit["verified"].sum()) if n else 0
    summary: dict = {"pivots": n, "verified": verified, "rate": verified / n if n else None}
    if exact_pass is not None and "restep_match" in exact_pass.columns:
        per_pivot = (
            exact_pass.filter(pl.col("restep_match").is_not_null())
            .group_by("pivot_id")
            .agg(pl.col("restep_match").first())
        )
        summary["restep"] = (
            {
                "pivots": per_pivot.height,
                "reproduced": int(per_pivot["restep_match"].sum()),
                "share": float(per_pivot.select(pl.col("restep_match").mean()).item()),
            }
            if per_pivot.height
            else {"recorded": False}
        )
    if refeed_pass is not None and "kv_maxdiff" in refeed_pass.columns:
        per_pivot = (
            refeed_pass.filter(pl.col("kv_maxdiff").is_not_null())
            .group_by("pivot_id")
            .agg(pl.col("kv_maxdiff").first().list.max().alias("m"))
        )
        if per_pivot.height:
            summary["refeed_kv_maxdiff"] = {
                "median": float(per_pivot.select(pl.col("m").median()).item()),
                "max": float(per_pivot.select(pl.col("m").max()).item()),
                "share_nonzero": float(per_pivot.select((pl.col("m") > 0).mean()).item()),
            }
    return summary


def check_verified(verification: Mapping, min_verified: float) -> None:
    """Stop a comparison whose exact pass resumed a verified decode-time state for too few pivots
    (``verification_summary``'s counts). Unverified pivots are left out of every comparison; past a small share
    that would no longer be a sample of the pivots but the replay failing (a cache that kept no decode-time state,
    rollouts that regenerate otherwise), so the step fails and says by how much."""
    n, verified = verification["pivots"], verification["verified"]
    if n and verified < min_verified * n:
        raise ValueError(
            f"exact resumed a verified decode-time state for {verified} of {n} pivots ({verified / n:.2%}), below "
            f"analysis.min_verified {min_verified}: the replay did not resume what it claims to (the pass's log says "
            "which pivots and why); lower analysis.min_verified to compare the verified ones anyway"
        )
