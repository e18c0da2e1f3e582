"""Pivots: positions where the model was nearly undecided, and the two branches compared there.

A candidate is a response position t >= 1 whose untempered top-1 minus top-2 probability is below
``max_margin``, where the sampled token is one of the top two, neither top-2 token is special, and t lies
outside the final-answer span. (t = 0 is excluded because its state comes from the prompt prefill alone, so
there is no decode step whose logits could verify it.)

With ``align_block`` = B > 0 (``pivots.align_to_block``), only positions whose prefix (prompt + response[:t])
fills whole KV blocks of B tokens are kept: a block-cache engine (vLLM) then serves the entire prefix from
decode-time blocks, with no tail recomputed by prefill (tail = (prompt_len + t) % B).
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from replaynoise.seeds import derive_seed

CHOICES = ("random", "lowest_margin")

PIVOT_SCHEMA = {
    "pivot_id": pl.Utf8, "problem_id": pl.Utf8, "t": pl.Int64, "margin": pl.Float64,
    "rollout_correct": pl.Boolean, "prefix_len": pl.Int64, "orig_token": pl.Int64, "sub_token": pl.Int64,
    "sampled_rank": pl.Int64, "n_candidates": pl.Int64,
}


def margins(topk_logprobs: list[list[float]]) -> list[float]:
    return [math.exp(lps[0]) - math.exp(lps[1]) for lps in topk_logprobs]


def candidate_positions(response_ids: list[int], topk_ids: list[list[int]], topk_logprobs: list[list[float]],
                        special_ids: set[int], answer_span: tuple[int, int] | None, max_margin: float) -> list[int]:
    """Every response position that may serve as a pivot (module docstring has the rules)."""
    found = []
    lo, hi = answer_span if answer_span else (-1, -1)
    for t, (token, ids, margin) in enumerate(zip(response_ids, topk_ids, margins(topk_logprobs))):
        if t == 0 or margin >= max_margin or lo <= t < hi:
            continue
        if token not in ids[:2] or ids[0] in special_ids or ids[1] in special_ids:
            continue
        found.append(t)
    return found


def choose_pivots(candidates: list[int], margin_of: list[float], per_rollout: int, choose: str, seed: int) -> list[int]:
    """At most ``per_rollout`` positions: seeded uniform sampling or the lowest margins."""
    if choose not in CHOICES:
        raise ValueError(f"pivots.choose must be one of {CHOICES}, got {choose!r}")
    if len(candidates) <= per_rollout:
        return list(candidates)
    if choose == "lowest_margin":
        return sorted(sorted(candidates, key=lambda t: (margin_of[t], t))[:per_rollout])
    rng = np.random.default_rng(seed)
    return sorted(int(t) for t in rng.choice(candidates, size=per_rollout, replace=False))


def aligned(candidates: list[int], prompt_len: int, block: int) -> list[int]:
    """The candidates whose prefix ends on a block boundary (all of them when ``block`` is 0)."""
    return [t for t in candidates if (prompt_len + t) % block == 0] if block else list(candidates)


def select_pivots(rollouts: pl.DataFrame, *, max_margin: float, per_rollout: int, choose: str, seed: int,
                  config_name: str, align_block: int = 0) -> pl.DataFrame:
    """One row per chosen pivot, with the pair of branch tokens and the pre-treatment features."""
    rows = []
    for r in rollouts.iter_rows(named=True):
        marg = margins(r["topk_logprobs"])
        cands = candidate_positions(r["response_ids"], r["topk_ids"], r["topk_logprobs"], set(r["special_ids"]),
                                    tuple(r["answer_span"]) if r["answer_span"] else None, max_margin)
        cands = aligned(cands, len(r["prompt_ids"]), align_block)
        chosen = choose_pivots(cands, marg, per_rollout, choose, derive_seed(seed, config_name, "pivots",
                                                                              r["problem_id"]))
        for t in chosen:
            top2 = r["topk_ids"][t][:2]
            orig = r["response_ids"][t]
            rows.append({
                "pivot_id": f"{r['problem_id']}@{t}", "problem_id": r["problem_id"], "t": t, "margin": marg[t],
                "rollout_correct": r["correct"], "prefix_len": len(r["prompt_ids"]) + t, "orig_token": orig,
                "sub_token": top2[1] if orig == top2[0] else top2[0], "sampled_rank": top2.index(orig),
                "n_candidates": len(cands),
            })
    return pl.DataFrame(rows, schema=PIVOT_SCHEMA)
