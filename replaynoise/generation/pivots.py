"""Pivots: positions where the model was nearly undecided, and the two branches compared there.

The rules are configuration (``pivots:``, ``PivotRules``); the paper's and ours differ (docs/method.md says
which is which and why):

- margin: ``logprob_gap`` (the paper: top-1 minus top-2 untempered log-prob, in nats) or ``prob_gap`` (ours:
  p1 - p2); a candidate's margin is strictly below ``max_margin`` (a tie, margin 0, is a candidate);
- branch pair: ``best_other`` (the paper: any sampled rank; the substitute is the best other token of the
  recorded top-k) or ``top2_other`` (ours: the sampled token is one of the top two, the substitute the other);
- exclusions: ``exclude_special: substitute`` (the paper: the substitute is not a special token) or ``top2``
  (ours: neither top-2 token is special); ``exclude_answer_span`` (ours: not inside the final number);
  ``min_position`` (ours 1: t = 0 follows the prompt prefill, not a decode step); ``min_response_len`` (the
  paper: rollouts of fewer than 16 tokens give none);
- block alignment (``align_to_block``, grid ``configs.*.block_size``): the prefix length (prompt + t, the
  pivot token's absolute position) modulo the block size is one of ``block_offsets`` (the paper: {0, 1, 2} of
  16, so a block-cache engine recomputes at most 2 prefix tokens; ours: {0}, none);
- choice, at most ``per_rollout`` per rollout: ``earliest`` (the paper), seeded ``random`` or
  ``lowest_margin``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl

from replaynoise.seeds import derive_seed

CHOICES = ("random", "lowest_margin", "earliest")
MARGIN_METRICS = ("prob_gap", "logprob_gap")
SUBSTITUTES = ("top2_other", "best_other")
SPECIAL_EXCLUSIONS = ("top2", "substitute")

PIVOT_SCHEMA = {
    "pivot_id": pl.Utf8,
    "problem_id": pl.Utf8,
    "rollout": pl.Int64,
    "t": pl.Int64,
    "margin": pl.Float64,
    "rollout_correct": pl.Boolean,
    "prefix_len": pl.Int64,
    "orig_token": pl.Int64,
    "sub_token": pl.Int64,
    "sampled_rank": pl.Int64,
    "n_candidates": pl.Int64,
}


@dataclass(frozen=True)
class PivotRules:
    margin_metric: str = "prob_gap"
    max_margin: float = 0.2
    per_rollout: int = 4
    choose: str = "random"
    substitute: str = "top2_other"
    exclude_special: str = "top2"
    exclude_answer_span: bool = True
    min_position: int = 1
    min_response_len: int = 0
    #: 0: no alignment
    block_size: int = 0
    block_offsets: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        for name, allowed in (
            ("margin_metric", MARGIN_METRICS),
            ("choose", CHOICES),
            ("substitute", SUBSTITUTES),
            ("exclude_special", SPECIAL_EXCLUSIONS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"pivots.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    @classmethod
    def from_config(cls, cfg: dict, block_size: int = 0) -> PivotRules:
        """The rules of a validated ``pivots:`` config section (its defaults filled in once, from the schema);
        ``block_size`` is the configuration's block grid, used when ``align_to_block`` is on."""
        return cls(
            margin_metric=cfg["margin_metric"],
            max_margin=cfg["max_margin"],
            per_rollout=cfg["per_rollout"],
            choose=cfg["choose"],
            substitute=cfg["substitute"],
            exclude_special=cfg["exclude_special"],
            exclude_answer_span=cfg["exclude_answer_span"],
            min_position=cfg["min_position"],
            min_response_len=cfg["min_response_len"],
            block_size=block_size if cfg["align_to_block"] else 0,
            block_offsets=tuple(cfg["block_offsets"]),
        )


def margins(topk_logprobs: list[list[float]], metric: str = "prob_gap") -> list[float]:
    if metric == "logprob_gap":
        return [lps[0] - lps[1] for lps in topk_logprobs]
    return [math.exp(lps[0]) - math.exp(lps[1]) for lps in topk_logprobs]


def substitute_of(token: int, ids: list[int], rule: str) -> int | None:
    """The token put in the sampled token's place, or None where the rule gives none."""
    if rule == "top2_other":
        return (ids[1] if token == ids[0] else ids[0]) if token in ids[:2] else None
    return next((i for i in ids if i != token), None)


def candidate_positions(
    response_ids: list[int],
    topk_ids: list[list[int]],
    topk_logprobs: list[list[float]],
    special_ids: set[int],
    answer_span: tuple[int, int] | None,
    rules: PivotRules,
    prompt_len: int = 0,
) -> list[int]:
    """Every response position that may serve as a pivot (the module docstring has the rules)."""
    if len(response_ids) < rules.min_response_len:
        return []
    found = []
    lo, hi = answer_span if answer_span and rules.exclude_answer_span else (-1, -1)
    for t, (token, ids, margin) in enumerate(zip(response_ids, topk_ids, margins(topk_logprobs, rules.margin_metric))):
        if t < rules.min_position or margin >= rules.max_margin or lo <= t < hi:
            continue
        sub = substitute_of(token, ids, rules.substitute)
        if sub is None:
            continue
        if rules.exclude_special == "top2" and (ids[0] in special_ids or ids[1] in special_ids):
            continue
        if rules.exclude_special == "substitute" and sub in special_ids:
            continue
        if rules.block_size and (prompt_len + t) % rules.block_size not in rules.block_offsets:
            continue
        found.append(t)
    return found


def choose_pivots(candidates: list[int], margin_of: list[float], per_rollout: int, choose: str, seed: int) -> list[int]:
    """At most ``per_rollout`` positions: the earliest, seeded uniform sampling or the lowest margins."""
    if choose not in CHOICES:
        raise ValueError(f"pivots.choose must be one of {CHOICES}, got {choose!r}")
    if len(candidates) <= per_rollout:
        return list(candidates)
    if choose == "earliest":
        return sorted(candidates)[:per_rollout]
    if choose == "lowest_margin":
        return sorted(sorted(candidates, key=lambda t: (margin_of[t], t))[:per_rollout])
    rng = np.random.default_rng(seed)
    return sorted(int(t) for t in rng.choice(candidates, size=per_rollout, replace=False))


def rollout_pivots(r: dict, rules: PivotRules, seed: int, config_name: str) -> tuple[list[int], list[int]]:
    """(candidates, chosen) of one rollout record; the rollout step calls it too, to know how much KV to keep."""
    cands = candidate_positions(
        r["response_ids"],
        r["topk_ids"],
        r["topk_logprobs"],
        set(r["special_ids"]),
        tuple(r["answer_span"]) if r["answer_span"] else None,
        rules,
        prompt_len=len(r["prompt_ids"]),
    )
    marg = margins(r["topk_logprobs"], rules.margin_metric)
    chosen = choose_pivots(
        cands,
        marg,
        rules.per_rollout,
        rules.choose,
        derive_seed(seed, config_name, "pivots", r["problem_id"], r.get("rollout", 0)),
    )
    return cands, chosen


def screened_problems(rollouts: pl.DataFrame, screen: str, fixed: int, keep: int | None, skip: int) -> list[str]:
    """The problems whose rollouts give pivots, in problem order.

    ``mixed`` (the paper's screen, Amendment 1): the first ``fixed`` problems are kept whatever their rollouts
    (the unscreened cohort); the next ``skip`` give none (the paper's K = 8 row scans from index 20 without the
    fixed cohort); after them a problem is kept only if its rollouts have mixed accuracy (neither all wrong nor
    all right), until ``keep`` are kept (None: all that pass). ``none`` keeps every problem."""
    order = rollouts.select("problem_id").unique(maintain_order=True)["problem_id"].to_list()
    if screen == "none":
        return order
    if screen != "mixed":
        raise ValueError(f"rollouts.screen must be 'none' or 'mixed', got {screen!r}")
    accuracy = dict(rollouts.group_by("problem_id").agg(pl.col("correct").cast(pl.Float64).mean()).iter_rows())
    kept, screened = order[:fixed], []
    for pid in order[fixed + skip :]:
        if keep is not None and len(screened) >= keep:
            break
        if 0.0 < accuracy[pid] < 1.0:
            screened.append(pid)
    return kept + screened


def pivot_id(problem_id: str, rollout: int, t: int) -> str:
    return f"{problem_id}/r{rollout}@{t}"


def select_pivots(
    rollouts: pl.DataFrame, rules: PivotRules, *, seed: int, config_name: str, problems: list[str] | None = None
) -> pl.DataFrame:
    """One row per chosen pivot, with the pair of branch tokens and the pre-treatment features; only rollouts
    of ``problems`` (default: all) give pivots."""
    allowed = None if problems is None else set(problems)
    rows = []
    for r in rollouts.iter_rows(named=True):
        if allowed is not None and r["problem_id"] not in allowed:
            continue
        cands, chosen = rollout_pivots(r, rules, seed, config_name)
        marg = margins(r["topk_logprobs"], rules.margin_metric)
        rollout = r.get("rollout", 0)
        for t in chosen:
            ids = r["topk_ids"][t]
            orig = r["response_ids"][t]
            rows.append(
                {
                    "pivot_id": pivot_id(r["problem_id"], rollout, t),
                    "problem_id": r["problem_id"],
                    "rollout": rollout,
                    "t": t,
                    "margin": marg[t],
                    "rollout_correct": r["correct"],
                    "prefix_len": len(r["prompt_ids"]) + t,
                    "orig_token": orig,
                    "sub_token": substitute_of(orig, ids, rules.substitute),
                    "sampled_rank": ids.index(orig) if orig in ids else -1,
                    "n_candidates": len(cands),
                }
            )
    return pl.DataFrame(rows, schema=PIVOT_SCHEMA)
