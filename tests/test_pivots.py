"""Pivot candidates, the choice among them, and the pivot frame built from hand-made rollouts."""

from __future__ import annotations

import copy
import math

import polars as pl
import pytest

from replaynoise.generation.pivots import (
    PIVOT_SCHEMA,
    PivotRules,
    candidate_positions,
    choose_pivots,
    margins,
    screened_problems,
    select_pivots,
)

MAX_MARGIN = 0.2
SPECIAL = 0  # e.g. eos


def logprobs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


def position(top: list[int], probs: tuple[float, ...] = (0.45, 0.40, 0.10)) -> tuple[list[int], list[float]]:
    return top, logprobs(*probs)


def base_response(n: int = 4) -> dict:
    """n positions, every one a valid candidate except t = 0: margin 0.05, sampled token is top-1."""
    topk_ids = [[100 + t, 200 + t, 300 + t] for t in range(n)]
    return {
        "response_ids": [ids[0] for ids in topk_ids],
        "topk_ids": topk_ids,
        "topk_logprobs": [logprobs(0.45, 0.40, 0.10) for _ in range(n)],
        "special_ids": {SPECIAL},
        "answer_span": None,
        "max_margin": MAX_MARGIN,
    }


def candidates(r: dict, **rules) -> list[int]:
    return candidate_positions(
        r["response_ids"],
        r["topk_ids"],
        r["topk_logprobs"],
        r["special_ids"],
        r["answer_span"],
        PivotRules(max_margin=r["max_margin"], **rules),
        prompt_len=r.get("prompt_len", 0),
    )


# --- candidate_positions --------------------------------------------------------------------------------------


def test_margins_are_probability_differences():
    assert margins([logprobs(0.6, 0.3, 0.1), logprobs(0.5, 0.5)]) == pytest.approx([0.3, 0.0])


def test_t0_is_never_a_candidate():
    assert candidates(base_response()) == [1, 2, 3]
    assert candidates(base_response(1)) == []


def _wide_margin(r):
    r["topk_logprobs"][2] = logprobs(0.6, 0.3, 0.1)


def _sampled_third(r):
    r["response_ids"][2] = r["topk_ids"][2][2]


def _sampled_outside_topk(r):
    r["response_ids"][2] = 999


def _special_top1(r):
    r["topk_ids"][2][0] = SPECIAL
    r["response_ids"][2] = SPECIAL


def _special_top2(r):
    r["topk_ids"][2][1] = SPECIAL


def _in_answer_span(r):
    r["answer_span"] = (2, 3)


EXCLUDING = {
    "margin-too-wide": _wide_margin,
    "sampled-token-third": _sampled_third,
    "sampled-token-outside-topk": _sampled_outside_topk,
    "special-top1": _special_top1,
    "special-top2": _special_top2,
    "inside-answer-span": _in_answer_span,
}


@pytest.mark.parametrize("mutate", EXCLUDING.values(), ids=EXCLUDING.keys())
def test_each_rule_excludes_position(mutate):
    r = base_response()
    mutate(r)
    assert candidates(r) == [1, 3]


def test_sampled_top2_token_is_a_candidate():
    r = base_response()
    r["response_ids"][2] = r["topk_ids"][2][1]
    assert candidates(r) == [1, 2, 3]


def test_special_token_below_top2_does_not_exclude():
    r = base_response()
    r["topk_ids"][2][2] = SPECIAL
    assert candidates(r) == [1, 2, 3]


def test_margin_equal_to_max_margin_is_excluded():
    r = base_response()
    m = margins(r["topk_logprobs"])[2]
    r["max_margin"] = m
    assert candidates(r) == []  # every position has the same margin
    r["max_margin"] = m + 1e-9
    assert candidates(r) == [1, 2, 3]


def test_answer_span_is_half_open():
    r = base_response(6)
    r["answer_span"] = (2, 4)
    assert candidates(r) == [1, 4, 5]
    r["answer_span"] = (1, 6)
    assert candidates(r) == []


def test_rules_combine():
    r = base_response(8)
    _wide_margin(r)  # t=2 out
    r["response_ids"][3] = r["topk_ids"][3][1]  # t=3 sampled top-2: in
    r["topk_ids"][4][1] = SPECIAL  # t=4 out
    r["response_ids"][5] = 999  # t=5 out
    r["answer_span"] = (7, 8)  # t=7 out
    assert candidates(r) == [1, 3, 6]


# --- choose_pivots --------------------------------------------------------------------------------------------

CANDS = [1, 3, 4, 6, 8, 9, 11, 12, 15]


def test_few_candidates_are_all_kept():
    assert choose_pivots([2, 5], [0.1] * 6, per_rollout=4, choose="random", seed=1) == [2, 5]
    assert choose_pivots([2, 5, 7, 9], [0.1] * 10, per_rollout=4, choose="lowest_margin", seed=1) == [2, 5, 7, 9]
    assert choose_pivots([], [], per_rollout=4, choose="random", seed=1) == []


def test_random_choice_is_seeded_sorted_subset():
    margin_of = [0.1] * 16
    picks = [choose_pivots(CANDS, margin_of, per_rollout=4, choose="random", seed=s) for s in range(30)]
    for pick in picks:
        assert len(pick) == 4 == len(set(pick))
        assert pick == sorted(pick)
        assert set(pick) <= set(CANDS)
        assert all(type(t) is int for t in pick)
    assert choose_pivots(CANDS, margin_of, 4, "random", seed=7) == picks[7]
    assert len({tuple(p) for p in picks}) > 5  # the seed matters
    # Margins do not steer the random choice.
    assert choose_pivots(CANDS, [0.01 * t for t in range(16)], 4, "random", seed=7) == picks[7]


def test_lowest_margin_picks_the_smallest_margins():
    margin_of = [0.15] * 16
    for t, m in {9: 0.01, 3: 0.02, 15: 0.03, 1: 0.04, 0: 0.0, 2: 0.0}.items():  # 0, 2: not candidates
        margin_of[t] = m
    assert choose_pivots(CANDS, margin_of, per_rollout=3, choose="lowest_margin", seed=1) == [3, 9, 15]
    assert choose_pivots(CANDS, margin_of, per_rollout=3, choose="lowest_margin", seed=99) == [3, 9, 15]


def test_lowest_margin_breaks_ties_by_position():
    margin_of = [0.1] * 16
    margin_of[12] = 0.05
    assert choose_pivots(CANDS, margin_of, per_rollout=3, choose="lowest_margin", seed=1) == [1, 3, 12]


def test_unknown_choice_is_refused():
    with pytest.raises(ValueError, match="pivots.choose"):
        choose_pivots(CANDS, [0.1] * 16, 4, "highest_margin", seed=1)
    with pytest.raises(ValueError, match="pivots.choose"):
        choose_pivots([1], [0.1] * 2, 4, "highest_margin", seed=1)


# --- select_pivots --------------------------------------------------------------------------------------------

ROLLOUT_SCHEMA = {
    "problem_id": pl.Utf8,
    "prompt_ids": pl.List(pl.Int64),
    "response_ids": pl.List(pl.Int64),
    "topk_ids": pl.List(pl.List(pl.Int64)),
    "topk_logprobs": pl.List(pl.List(pl.Float64)),
    "special_ids": pl.List(pl.Int64),
    "answer_span": pl.List(pl.Int64),
    "correct": pl.Boolean,
}


def rollouts_frame() -> pl.DataFrame:
    wide = logprobs(0.7, 0.2, 0.1)
    rows = [
        {  # p1: candidates at t=1 (sampled top-1) and t=3 (sampled top-2); t=2 wide; t=4 in the answer span
            "problem_id": "p1",
            "prompt_ids": [1, 2, 3, 4, 5],
            "response_ids": [10, 11, 12, 23, 14],
            "topk_ids": [[10, 20, 30], [11, 21, 31], [12, 22, 32], [13, 23, 33], [14, 24, 34]],
            "topk_logprobs": [
                logprobs(0.5, 0.4, 0.1),
                logprobs(0.5, 0.4, 0.1),
                wide,
                logprobs(0.45, 0.35, 0.2),
                logprobs(0.5, 0.45, 0.05),
            ],
            "special_ids": [0, 2],
            "answer_span": [4, 5],
            "correct": True,
        },
        {  # p2: no candidate (top-2 at t=1 is special, t=2 wide)
            "problem_id": "p2",
            "prompt_ids": [1, 2],
            "response_ids": [10, 11, 12],
            "topk_ids": [[10, 20, 30], [11, 0, 31], [12, 22, 32]],
            "topk_logprobs": [logprobs(0.5, 0.4, 0.1), logprobs(0.5, 0.4, 0.1), wide],
            "special_ids": [0],
            "answer_span": None,
            "correct": False,
        },
        {  # p3: seven candidates (t=1..7), more than per_rollout
            "problem_id": "p3",
            "prompt_ids": [7, 7, 7],
            "response_ids": [40 + t for t in range(8)],
            "topk_ids": [[40 + t, 60 + t, 80 + t] for t in range(8)],
            "topk_logprobs": [logprobs(0.42 + 0.01 * t, 0.40, 0.1) for t in range(8)],
            "special_ids": [0],
            "answer_span": None,
            "correct": False,
        },
    ]
    return pl.DataFrame(rows, schema=ROLLOUT_SCHEMA)


def run(frame: pl.DataFrame, seed: int = 20260614, problems=None, **overrides) -> pl.DataFrame:
    rules = PivotRules(**({"max_margin": MAX_MARGIN, "per_rollout": 4, "choose": "random"} | overrides))
    return select_pivots(frame, rules, seed=seed, config_name="cfg", problems=problems)


def test_select_pivots_rows_for_hand_built_rollouts():
    out = run(rollouts_frame())
    assert out.schema == pl.Schema(PIVOT_SCHEMA)
    p1 = out.filter(pl.col("problem_id") == "p1").to_dicts()
    assert p1 == [
        {
            "pivot_id": "p1/r0@1",
            "problem_id": "p1",
            "rollout": 0,
            "t": 1,
            "margin": pytest.approx(0.1),
            "rollout_correct": True,
            "prefix_len": 6,
            "orig_token": 11,
            "sub_token": 21,
            "sampled_rank": 0,
            "n_candidates": 2,
        },
        {
            "pivot_id": "p1/r0@3",
            "problem_id": "p1",
            "rollout": 0,
            "t": 3,
            "margin": pytest.approx(0.1),
            "rollout_correct": True,
            "prefix_len": 8,
            "orig_token": 23,
            "sub_token": 13,
            "sampled_rank": 1,
            "n_candidates": 2,
        },
    ]
    assert out.filter(pl.col("problem_id") == "p2").height == 0
    p3 = out.filter(pl.col("problem_id") == "p3")
    assert p3.height == 4
    assert p3["n_candidates"].to_list() == [7] * 4
    assert p3["t"].to_list() == sorted(p3["t"].to_list())
    assert set(p3["t"].to_list()) <= set(range(1, 8))
    for row in p3.to_dicts():
        assert row["pivot_id"] == f"p3/r0@{row['t']}"
        assert row["prefix_len"] == 3 + row["t"]
        assert (row["orig_token"], row["sub_token"], row["sampled_rank"]) == (40 + row["t"], 60 + row["t"], 0)
        assert row["margin"] == pytest.approx(0.02 + 0.01 * row["t"])
    assert out["pivot_id"].n_unique() == out.height


def test_select_pivots_is_deterministic_and_seed_dependent():
    frame = rollouts_frame()
    assert run(frame).equals(run(frame))
    chosen = {tuple(run(frame, seed=s).filter(pl.col("problem_id") == "p3")["t"]) for s in range(12)}
    assert len(chosen) > 1
    # The choice for one rollout does not depend on the other rows of the frame.
    alone = run(frame.filter(pl.col("problem_id") == "p3"))
    assert alone.equals(run(frame).filter(pl.col("problem_id") == "p3"))


def test_select_pivots_lowest_margin():
    out = run(rollouts_frame(), choose="lowest_margin", per_rollout=2)
    assert out.filter(pl.col("problem_id") == "p3")["t"].to_list() == [1, 2]  # margins grow with t
    assert out.filter(pl.col("problem_id") == "p1")["t"].to_list() == [1, 3]


def test_select_pivots_empty_result_keeps_schema():
    frame = rollouts_frame().filter(pl.col("problem_id") == "p2")
    out = run(frame)
    assert out.height == 0
    assert out.schema == pl.Schema(PIVOT_SCHEMA)


def test_select_pivots_does_not_change_its_input():
    frame = rollouts_frame()
    before = copy.deepcopy(frame.to_dicts())
    run(frame)
    assert frame.to_dicts() == before


# --- the paper's rules ----------------------------------------------------------------------------------------

PAPER = dict(
    margin_metric="logprob_gap",
    substitute="best_other",
    exclude_special="substitute",
    exclude_answer_span=False,
    min_position=0,
)


def test_logprob_gap_is_in_nats_and_a_tie_is_a_candidate():
    r = base_response(3)
    r["max_margin"] = 1.0
    r["topk_logprobs"][0] = [-0.7, -0.7, -3.0]  # a tie: margin 0 < 1.0
    r["topk_logprobs"][1] = [-0.1, -1.1, -3.0]  # gap exactly 1.0 nats: not below the threshold
    r["topk_logprobs"][2] = [-0.5, -1.4, -3.0]  # 0.9 nats (p = 0.61 vs 0.25: a prob_gap of 0.36)
    assert margins(r["topk_logprobs"], "logprob_gap") == pytest.approx([0.0, 1.0, 0.9])
    assert candidates(r, **PAPER) == [0, 2]
    r["max_margin"] = 0.3
    assert candidates(r, min_position=0) == [0]  # ours, prob_gap: 0.57 at t=1 and 0.36 at t=2 are too wide


def test_best_other_allows_any_sampled_rank_and_picks_the_best_other_token():
    r = base_response(3)
    r["max_margin"] = 1.0
    _sampled_third(r)
    assert 2 not in candidates(r, margin_metric="logprob_gap")  # ours: the sampled token must be top-2
    assert 2 in candidates(r, **PAPER)
    frame = pl.DataFrame(
        [
            {
                "problem_id": "p",
                "prompt_ids": [1],
                "response_ids": r["response_ids"],
                "topk_ids": r["topk_ids"],
                "topk_logprobs": r["topk_logprobs"],
                "special_ids": [SPECIAL],
                "answer_span": None,
                "correct": True,
            }
        ],
        schema=ROLLOUT_SCHEMA,
    )
    out = (
        select_pivots(
            frame, PivotRules(max_margin=1.0, per_rollout=5, choose="earliest", **PAPER), seed=1, config_name="c"
        )
        .filter(pl.col("t") == 2)
        .row(0, named=True)
    )
    assert (out["orig_token"], out["sub_token"], out["sampled_rank"]) == (302, 102, 2)


def test_special_substitute_is_excluded_but_a_special_top2_that_is_not_the_substitute_is_not():
    r = base_response(3)
    r["max_margin"] = 1.0
    r["topk_ids"][1] = [101, SPECIAL, 301]  # sampled top-1: the substitute would be the special token
    r["topk_ids"][2] = [SPECIAL, 202, 302]
    r["response_ids"][2] = SPECIAL  # sampled the special token; the substitute 202 is fine under the paper's rule
    assert candidates(r, **PAPER) == [0, 2]


def test_block_alignment_keeps_offsets_0_to_2_past_a_boundary():
    r = base_response(40)
    r["max_margin"] = 1.0
    r["prompt_len"] = 13  # abs_pos = 13 + t; offsets {0, 1, 2} of 16 at t = 3, 4, 5, 19, 20, 21, 35, 36, 37
    got = candidates(r, block_size=16, block_offsets=(0, 1, 2), **PAPER)
    assert got == [3, 4, 5, 19, 20, 21, 35, 36, 37]
    assert all((13 + t) % 16 in (0, 1, 2) for t in got)
    assert 6 not in got  # offset 3 from a boundary
    assert candidates(r, block_size=16, **PAPER) == [3, 19, 35]  # offset 0 only


def test_short_rollouts_give_no_pivots_and_earliest_takes_the_first():
    r = base_response(15)
    r["max_margin"] = 1.0
    assert candidates(r, min_response_len=16, **PAPER) == []
    assert candidates(r, min_response_len=15, **PAPER) == list(range(15))
    assert choose_pivots([9, 2, 5, 7, 11, 3], [0.0] * 12, 5, "earliest", seed=1) == [2, 3, 5, 7, 9]


def test_answer_span_is_excluded_only_under_our_rule():
    r = base_response(5)
    r["answer_span"] = (3, 5)
    assert candidates(r) == [1, 2]
    assert candidates(r, exclude_answer_span=False) == [1, 2, 3, 4]


def test_mixed_screen_keeps_the_fixed_cohort_then_mixed_problems_up_to_keep():
    rows = [
        ("a", [True, True]),
        ("b", [False, False]),
        ("c", [True, True]),
        ("d", [True, False]),
        ("e", [False, False]),
        ("f", [False, True]),
        ("g", [True, False]),
    ]
    frame = pl.DataFrame(
        [{"problem_id": pid, "rollout": r, "correct": c} for pid, cs in rows for r, c in enumerate(cs)]
    )
    assert screened_problems(frame, "none", 0, None, 0) == list("abcdefg")
    assert screened_problems(frame, "mixed", 2, 2, 0) == ["a", "b", "d", "f"]
    assert screened_problems(frame, "mixed", 0, None, 0) == ["d", "f", "g"]
    assert screened_problems(frame, "mixed", 0, 2, 4) == ["f", "g"]  # scans from the fifth problem


def test_pivots_of_several_rollouts_per_problem_are_told_apart():
    frame = rollouts_frame().filter(pl.col("problem_id") == "p3")
    two = pl.concat([frame.with_columns(rollout=pl.lit(r, pl.Int64)) for r in (0, 1)])
    out = run(two, per_rollout=2, choose="earliest")
    assert out["pivot_id"].to_list() == ["p3/r0@1", "p3/r0@2", "p3/r1@1", "p3/r1@2"]
    assert out["rollout"].to_list() == [0, 0, 1, 1]
    assert run(two, problems=["p1"]).height == 0
