"""Per-pivot credit counts, eligibility and the refusal of malformed pass frames."""

from __future__ import annotations

import polars as pl
import pytest
from helpers import analysis_settings

from replaynoise.analysis.credit import CREDIT_COLUMNS, ELIGIBILITY, compute_credit

K = 4


def pivots_frame(ids: list[str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "pivot_id": ids,
            "problem_id": [f"prob-{i[-1]}" for i in ids],
            "t": list(range(len(ids))),
            "margin": [0.05] * len(ids),
            "rollout_correct": [True] * len(ids),
            "prefix_len": [12] * len(ids),
        }
    )


def continuation_rows(pivot_id: str, n_orig: int, n_sub: int, k: int = K, **overrides) -> list[dict]:
    """2K rows: the first n_orig originals and n_sub substitutes are correct."""
    rows = []
    for branch, n_ok in (("orig", n_orig), ("sub", n_sub)):
        for j in range(k):
            row = {
                "pivot_id": pivot_id,
                "problem_id": "p",
                "branch": branch,
                "k": j,
                "token_ids": [1, 2, j],
                "answer": "7" if j < n_ok else "3",
                "correct": j < n_ok,
                "finish_reason": "eos",
                "n_tokens": 3,
                "verified": True,
                "next_topk_ids": [5, 6],
                "next_topk_logprobs": [-0.5, -1.0],
            }
            rows.append(row)
    for (branch, j), changes in overrides.get("changes", {}).items():
        next(r for r in rows if r["branch"] == branch and r["k"] == j).update(changes)
    return rows


def pass_frame(rows: list[dict]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema_overrides={"answer": pl.String})


def test_counts_eligibility_and_lattice_values() -> None:
    ids = ["a", "b", "c", "d", "e", "f"]
    rows = (
        continuation_rows("a", 3, 1)
        + continuation_rows("b", 4, 0, changes={("sub", 2): {"finish_reason": "length"}})
        + continuation_rows("c", 2, 2, changes={("orig", 0): {"verified": False}})
        + [r for r in continuation_rows("d", 1, 2) if not (r["branch"] == "sub" and r["k"] == 3)]
        + continuation_rows("f", 0, 3, changes={("sub", 0): {"correct": None}})
    )
    credit = compute_credit(pass_frame(rows), pivots_frame(ids), K, "exact", eligibility="finished")
    assert tuple(credit.columns) == CREDIT_COLUMNS
    by = {r["pivot_id"]: r for r in credit.iter_rows(named=True)}
    assert (by["a"]["n_orig_correct"], by["a"]["n_sub_correct"], by["a"]["a_hat"]) == (3, 1, 0.5)
    assert by["a"]["eligible"] and by["a"]["n_rows"] == 8 and by["a"]["n_finished"] == 8
    # ours (finished): a truncated continuation makes the pivot ineligible
    assert by["b"]["n_finished"] == 7 and not by["b"]["eligible"] and by["b"]["a_hat"] == 1.0
    assert not by["c"]["verified"] and not by["c"]["eligible"]
    assert by["d"]["n_rows"] == 7 and not by["d"]["eligible"]
    # a pivot without rows is present, ineligible, with no estimate
    assert by["e"]["n_rows"] == 0 and not by["e"]["eligible"] and by["e"]["a_hat"] is None
    assert not by["e"]["verified"]
    # a null correctness counts as not correct
    assert by["f"]["n_sub_correct"] == 2 and by["f"]["a_hat"] == -0.5
    assert set(credit["pass_name"].to_list()) == {"exact"} and set(credit["k"].to_list()) == {K}
    assert credit["pivot_id"].to_list() == ids


def test_a_hat_is_exactly_on_the_lattice() -> None:
    k = 3
    rows = continuation_rows("a", 2, 1, k=k) + continuation_rows("b", 3, 1, k=k)
    credit = compute_credit(pass_frame(rows), pivots_frame(["a", "b"]), k, "refeed", "graded")
    assert credit["a_hat"].to_list() == [(2 - 1) / k, (3 - 1) / k]  # bitwise, not approximately


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda rows: rows + [dict(rows[0], k=3)], "more than K=4"),
        (lambda rows: rows + [dict(rows[0], branch="other")], "unknown branch"),
        (lambda rows: [dict(r, k=0) if r["branch"] == "orig" and r["k"] == 1 else r for r in rows], "duplicated"),
        (lambda rows: rows + [dict(rows[0], k=4)], "outside 0..3"),
        (lambda rows: rows + [dict(rows[0], pivot_id="zz")], "not in the pivots frame"),
    ],
)
def test_malformed_pass_frames_are_refused(mutate, message) -> None:
    rows = continuation_rows("a", 1, 1)
    with pytest.raises(ValueError, match=message):
        compute_credit(pass_frame(mutate(rows)), pivots_frame(["a"]), K, "exact", "graded")


def test_credit_grid_reads_files_config_major(tmp_path) -> None:
    from replaynoise.analysis.credit import read_credit_grid

    files = []
    for c in ("a", "b"):
        for p in ("exact", "refeed"):
            path = tmp_path / f"{c}-{p}.parquet"
            pl.DataFrame({"tag": [f"{c}/{p}"]}).write_parquet(path)
            files.append(str(path))
    grid = read_credit_grid(files, ["a", "b"], ["exact", "refeed"])
    assert {c: {p: df["tag"][0] for p, df in passes.items()} for c, passes in grid.items()} == {
        "a": {"exact": "a/exact", "refeed": "a/refeed"},
        "b": {"exact": "b/exact", "refeed": "b/refeed"},
    }
    with pytest.raises(ValueError, match="expected 4 credit files, got 3"):
        read_credit_grid(files[:3], ["a", "b"], ["exact", "refeed"])


def test_graded_vs_finished_eligibility() -> None:
    """graded (the paper's, the default) grades truncated continuations; finished (ours) drops the pivot."""
    ids = ["a", "b", "c", "d"]
    rows = (
        continuation_rows("a", 3, 1)
        + continuation_rows("b", 4, 0, changes={("sub", 2): {"finish_reason": "length"}})
        + continuation_rows("c", 2, 2, changes={("orig", 0): {"verified": False}})
        + [r for r in continuation_rows("d", 1, 2) if not (r["branch"] == "orig" and r["k"] == 0)]
    )
    eligible = {
        rule: dict(
            zip(
                ids,
                compute_credit(pass_frame(rows), pivots_frame(ids), K, "exact", eligibility=rule)["eligible"].to_list(),
            )
        )
        for rule in ELIGIBILITY
    }
    assert eligible["graded"] == {"a": True, "b": True, "c": False, "d": False}
    assert eligible["finished"] == {"a": True, "b": False, "c": False, "d": False}
    default = compute_credit(pass_frame(rows), pivots_frame(ids), K, "exact", analysis_settings().eligibility)
    assert default["eligible"].to_list() == [True, True, False, False]  # the schema's default: the paper's rule
    with pytest.raises(ValueError, match="unknown eligibility rule 'eos'"):
        compute_credit(pass_frame(rows), pivots_frame(ids), K, "exact", eligibility="eos")
