"""A design that stops when it knows: pairs of draws in rounds, looked at after each, with the coverage kept.

A run with ``replay.stop`` makes its pairs of draws (one replica and one refeed draw each) in order and, from
``min_pairs`` on, computes the crossed interval (``replicated.crossed_interval``) over the pairs made so far. It stops
once that interval excludes zero (``when: resolved``) or its half-width is at most ``half_width_pp`` (``when:
bounded``), and at ``max_pairs`` in any case.

Looking more than once and stopping on what is seen would lose the interval's coverage if every look used the
nominal level: a run with no true excess would get several chances to exclude zero. So each look spends a share of
alpha = 1 - ci and reports its interval at level 1 - alpha_k, with the shares summing to alpha. The stopped
interval misses the true excess only if the interval of some look misses it, so by the union bound it misses with
chance at most sum_k alpha_k = alpha, whatever the looks' correlation and whatever the rule stops on. That needs
only each look's own interval to hold its level (tests/test_crossed.py, the coverage simulation
benchmarks/stopping.py), not the looks' joint law, which for a t with its own Satterthwaite degrees of freedom per
look has no closed form: a Pocock or O'Brien-Fleming boundary would be narrower by using that law, but only under
normal statistics with known information fractions, which two to five pairs of draws do not give.

The shares follow the linear spending function of Lan and DeMets, alpha t with t = r / max_pairs: by the look at r
pairs alpha r / max_pairs has been spent, so the first look (min_pairs pairs of information) gets
alpha min_pairs / max_pairs and each later one alpha / max_pairs. Pure numpy and scipy, on the G x R cell sums
(``replicated.cell_sums``) of a run's pairs in their draw order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats as sps

from replaynoise.analysis.paper_stats import json_number
from replaynoise.analysis.replicated import Components, crossed_interval, satterthwaite_df

WHEN = ("resolved", "bounded")
#: the plan's simulation seed: a plan is the same on every machine and every call
PLAN_SEED = 0
#: the most pairs a rule may plan (``replay.replicates``' own bound: each draw is a whole pass)
MOST_PAIRS = 32


@dataclass(frozen=True)
class StopRule:
    """``replay.stop``: stop at the first look from ``min_pairs`` on whose spent-alpha interval is resolved or
    bounded, at ``max_pairs`` otherwise."""

    when: str
    max_pairs: int
    min_pairs: int
    half_width_pp: float

    def __post_init__(self) -> None:
        if self.when not in WHEN:
            raise ValueError(f"stop when {self.when!r}: one of {', '.join(WHEN)}")
        if not 2 <= self.min_pairs <= self.max_pairs <= MOST_PAIRS:
            raise ValueError(
                f"stop after {self.min_pairs} to {self.max_pairs} pairs: 2 <= min_pairs <= max_pairs <= {MOST_PAIRS} "
                "(a look at one pair has no pass-level variance)"
            )
        if not (math.isfinite(self.half_width_pp) and self.half_width_pp > 0):
            raise ValueError(f"stop at a half-width of {self.half_width_pp} pp: a finite number > 0")

    @classmethod
    def from_config(cls, block: Mapping[str, Any]) -> StopRule:
        """The rule of a validated ``replay.stop`` block."""
        return cls(
            when=str(block["when"]),
            max_pairs=int(block["max_pairs"]),
            min_pairs=int(block["min_pairs"]),
            half_width_pp=float(block["half_width_pp"]),
        )

    def looks(self) -> list[int]:
        """The pair counts the rule looks at."""
        return list(range(self.min_pairs, self.max_pairs + 1))


def spent(rule: StopRule, alpha: float) -> list[float]:
    """The alpha spent by each look, cumulative (``alpha r / max_pairs`` at r pairs): increasing, alpha at the last."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha {alpha}: in (0, 1)")
    return [alpha * r / rule.max_pairs for r in rule.looks()]


def look_alphas(rule: StopRule, alpha: float) -> list[float]:
    """Each look's own share of alpha (the increments of ``spent``); they sum to alpha."""
    cumulative = spent(rule, alpha)
    return [b - a for a, b in zip([0.0, *cumulative[:-1]], cumulative)]


def _prefix(s: np.ndarray, n: np.ndarray, r: int) -> tuple[np.ndarray, np.ndarray]:
    """The first r pairs' cells, without the problems that have no pivot in them (as a run of r pairs has none)."""
    s, n = np.asarray(s, dtype=np.float64)[:, :r], np.asarray(n, dtype=np.float64)[:, :r]
    used = n.sum(axis=1) > 0
    return s[used], n[used]


def verdict(stat: Mapping[str, Any]) -> str:
    """'+' or '-' where the interval excludes zero on that side, '0' where it holds zero, '?' where there is none."""
    lo, hi = stat.get("ci_lo"), stat.get("ci_hi")
    if lo is None or hi is None:
        return "?"
    return "+" if lo > 0 else "-" if hi < 0 else "0"


def replay(
    s: np.ndarray, n: np.ndarray, rule: StopRule, ci: float, *, corrected: bool = True, scale: float = 100.0
) -> dict[str, Any]:
    """What the rule does over a run's pairs in their draw order (columns of the G x R cell sums): every look's
    interval, the pair it stops at and why. ``corrected=False`` looks at the nominal level every time (the naive
    rule whose coverage the simulation measures). A run of fewer pairs than ``max_pairs`` that has not stopped by
    its last pair ends there, with reason "pairs run out"."""
    available = int(np.asarray(s).shape[1])
    if available < rule.min_pairs:
        raise ValueError(f"{available} pair(s): the rule's first look is at {rule.min_pairs}")
    alphas = look_alphas(rule, 1.0 - ci) if corrected else [1.0 - ci] * len(rule.looks())
    looks: list[dict[str, Any]] = []
    reason = "pairs run out"
    for r, alpha in zip(rule.looks(), alphas):
        if r > available:
            break
        stat = crossed_interval(*_prefix(s, n, r), 1.0 - alpha, scale)
        lo, hi = stat["ci_lo"], stat["ci_hi"]
        half = None if lo is None or hi is None else json_number((hi - lo) / 2)
        seen = verdict(stat)
        looks.append(
            {
                "pairs": r,
                "level": 1.0 - alpha,
                "estimate": stat["estimate"],
                "ci_lo": lo,
                "ci_hi": hi,
                "half_width_pp": half,
                "verdict": seen,
            }
        )
        if rule.when == "resolved" and seen in ("+", "-"):
            reason = "resolved"
        elif rule.when == "bounded" and half is not None and half <= rule.half_width_pp:
            reason = "bounded"
        elif r == rule.max_pairs:
            reason = "max_pairs"
        else:
            continue
        break
    return {"stopped_at": looks[-1]["pairs"], "reason": reason, "corrected": corrected, "looks": looks, **looks[-1]}


def _design(comp: Components, g: int, r: int) -> tuple[float, float]:
    """(SE, Satterthwaite df) of the crossed estimate at G problems and r pairs, from the components' expected
    mean squares (the pilot's own observed ones enter nowhere, so every look of a plan is on one footing)."""
    ms_e = comp.residual
    ms_p, ms_r = ms_e + r * comp.problem, ms_e + g * comp.pass_level
    return math.sqrt((ms_p + ms_r - ms_e) / (g * r)), satterthwaite_df(ms_p, ms_r, ms_e, g, r)


def plan_stop(
    comp: Components,
    excess_pp: float,
    rule: StopRule,
    *,
    problems: Sequence[int],
    ci: float,
    sims: int = 20000,
    seed: int = PLAN_SEED,
) -> list[dict[str, Any]]:
    """Per number of problems, the pairs the rule is expected to use and its chance to stop resolved, at a true
    excess of ``excess_pp`` with the pilot's components, beside the fixed design of ``max_pairs`` pairs.

    The estimate after r pairs is d + U + (A_1 + ... + A_r) / r, U the problems' part (variance s_u^2 / G, shared
    by every look) and A_j pair j's (variance s_v^2 + s_w^2 / G), so the looks' joint law is simulated exactly
    under the normal approximation ``replicated.plan`` uses; each look's critical value is the t of its spent alpha
    at its design's degrees of freedom. Seeded, so a plan is the same on every machine."""
    if not math.isfinite(excess_pp):
        raise ValueError(f"a true excess of {excess_pp} pp: not a finite number")
    rng = np.random.default_rng(seed)
    alphas = look_alphas(rule, 1.0 - ci)
    d = excess_pp / 100.0
    rows = []
    for g in problems:
        if g < 2:
            raise ValueError(f"{g} problem(s): the crossed interval needs 2 or more")
        shared = rng.normal(0.0, math.sqrt(comp.problem / g), sims)
        per_pair = rng.normal(0.0, math.sqrt(comp.pass_level + comp.residual / g), (sims, rule.max_pairs))
        means = d + shared[:, None] + np.cumsum(per_pair, axis=1) / np.arange(1, rule.max_pairs + 1)
        stop_at = np.full(sims, rule.max_pairs)
        resolved = np.zeros(sims, dtype=bool)
        open_ = np.ones(sims, dtype=bool)
        for r, alpha in zip(rule.looks(), alphas):
            se, df = _design(comp, g, r)
            half = float(sps.t.ppf(1.0 - alpha / 2, df)) * se
            hit = np.abs(means[:, r - 1]) > half
            stop = hit if rule.when == "resolved" else np.full(sims, 100 * half <= rule.half_width_pp)
            now = open_ & (stop | (r == rule.max_pairs))
            stop_at[now], resolved[now] = r, hit[now]
            open_ &= ~now
        se, df = _design(comp, g, rule.max_pairs)
        fixed = np.abs(means[:, -1]) > float(sps.t.ppf(0.5 + ci / 2, df)) * se
        rows.append(
            {
                "problems": int(g),
                "expected_pairs": float(stop_at.mean()),
                "power": float(resolved.mean()),
                "fixed_pairs": rule.max_pairs,
                "fixed_power": float(fixed.mean()),
                "stop_share": {str(r): float((stop_at == r).mean()) for r in rule.looks()},
            }
        )
    return rows
