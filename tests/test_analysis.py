"""Section-4 statistics against small cases computed by hand."""

from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest
from helpers import analysis_settings
from scipy import stats

from replaynoise.analysis.channels import assert_all_identical, channel_agreement, lists_bitwise_equal
from replaynoise.analysis.comparison import compare_passes, too_few_note
from replaynoise.analysis.conditionings import CONDITIONINGS, wide_frame
from replaynoise.analysis.credit import CREDIT_COLUMNS, compute_credit
from replaynoise.analysis.disagreement import disagree
from replaynoise.analysis.paper_stats import (
    Clusters,
    classify_changes,
    cluster_ols_mean,
    eligibility_sources,
    jaccard,
    lattice_thetas,
    margin_split,
    mcnemar_z,
    mean_zero_unclustered,
    per_problem_t,
    selection_at,
)
from replaynoise.analysis.pooling import POOLED_PROBE_REASON, pool_credit, pooled_comparison
from replaynoise.analysis.probes import probe_deltas, probe_summary
from replaynoise.analysis.verification import check_verified
from replaynoise.config import validate_config
from replaynoise.report.headline import headline_rows
from replaynoise.settings import AnalysisSettings

K = 4


def credit_frame(pass_name: str, entries: list[tuple], k: int = K) -> pl.DataFrame:
    """entries: (pivot_id, problem_id, n_orig_correct, n_sub_correct[, eligible]) -> a credit frame."""
    rows = []
    for e in entries:
        pid, prob, n_o, n_s = e[:4]
        eligible = e[4] if len(e) > 4 else True
        rows.append(
            {
                "pivot_id": pid,
                "problem_id": prob,
                "pass_name": pass_name,
                "t": 1,
                "margin": 0.1,
                "prefix_len": 10,
                "rollout_correct": True,
                "k": k,
                "n_orig_correct": n_o,
                "n_sub_correct": n_s,
                "n_rows": 2 * k,
                "n_finished": 2 * k if eligible else 2 * k - 1,
                "verified": True,
                "eligible": eligible,
                "a_hat": (n_o - n_s) / k,
            }
        )
    return pl.DataFrame(rows).select(CREDIT_COLUMNS)


#: pivot, problem, exact, replica, refeed, selector (success counts per branch, K=4). See the comments in
#: the tests for the hand-computed consequences. Under the sign metric only p2, p4, p6, p8 change under
#: re-feed and nothing under the replica; under the value metric also p1 (re-feed) and p3 (replica).
CASE = [
    ("p1", "A", (3, 1), (3, 1), (2, 1), (3, 1)),  # refeed magnitude change 0.5 -> 0.25 (same sign)
    ("p2", "A", (2, 2), (2, 2), (3, 2), (2, 1)),  # refeed zero crossing 0 -> 0.25
    ("p3", "B", (4, 0), (3, 0), (4, 0), (4, 0)),  # replica magnitude change 1 -> 0.75
    ("p4", "B", (1, 3), (1, 3), (3, 1), (1, 3)),  # refeed reversal -0.5 -> 0.5
    ("p5", "C", (2, 1), (2, 1), (2, 1), (4, 4)),  # unchanged; selector uninformative
    ("p6", "C", (1, 2), (1, 2), (2, 2), (1, 2)),  # refeed zero crossing -0.25 -> 0
    ("p7", "D", (3, 3), (3, 3), (3, 3), (3, 3)),  # unchanged, informative (3/4 both)
    ("p8", "D", (0, 0), (0, 0), (1, 0), (2, 1)),  # exact uninformative; refeed crossing 0 -> 0.25
]
PASS_INDEX = {"exact": 2, "replica": 3, "refeed": 4, "selector": 5}


def case_credit(passes=("exact", "replica", "refeed", "selector"), ineligible=None) -> dict[str, pl.DataFrame]:
    ineligible = ineligible or {}
    return {
        p: credit_frame(p, [(row[0], row[1], *row[PASS_INDEX[p]], row[0] not in ineligible.get(p, ())) for row in CASE])
        for p in passes
    }


def run(credit, probes=None, probe_reason=None, **kw) -> dict:
    settings = analysis_settings(**({"n_boot": 200, "seed": 7, "min_eligible": 1} | kw))
    return compare_passes(credit, settings, probes=probes, probe_reason=probe_reason)


# ---------------------------------------------------------------------------------------------- estimates


def test_disagreement_excess_kinds_and_selection_by_hand() -> None:
    """Our definitions: value metric, informative conditioning (exact-pass counts not both 0/K or K/K)."""
    res = run(case_credit(), metric="value")
    assert res["metric"] == "value" and set(res["metrics"]) == {"sign", "value"}
    none, main = res["conditionings"]["none"], res["conditionings"]["informative"]
    assert (none["n"], none["n_problems"]) == (8, 4)
    assert none["disagreement"]["exact_vs_refeed"]["estimate"] == 5 / 8
    assert none["disagreement"]["exact_vs_replica"]["estimate"] == 1 / 8
    assert none["disagreement"]["replica_vs_refeed"]["estimate"] == 6 / 8
    assert none["excess_pp"]["estimate"] == pytest.approx(50.0)

    # informative drops p8 (exact 0/4 and 0/4)
    assert (main["n"], main["n_problems"]) == (7, 4)
    assert main["disagreement"]["exact_vs_refeed"]["n_disagree"] == 4
    assert main["disagreement"]["exact_vs_replica"]["estimate"] == pytest.approx(1 / 7)
    assert main["excess_pp"]["estimate"] == pytest.approx(300 / 7)
    assert main["clustered_t"]["coef"] == pytest.approx(3 / 7)
    assert main["clustered_t"]["n_clusters"] == 4
    assert main["by_metric"]["value"]["excess_pp"] == main["excess_pp"] and main["metric"] == "value"
    kinds = main["kinds_of_change"]["exact_vs_refeed"]
    assert kinds["n_changed"] == 4
    assert [kinds[k]["count"] for k in ("zero_crossing", "reversal", "magnitude")] == [2, 1, 1]
    assert kinds["zero_crossing"]["share"] == 0.5
    rep_kinds = main["kinds_of_change"]["exact_vs_replica"]
    assert (rep_kinds["n_changed"], rep_kinds["magnitude"]["count"]) == (1, 1)
    # d = refeed - exact: -0.25, +0.25, 0, +1, 0, +0.25, 0
    assert main["mean_diff"]["cluster"]["coef"] == pytest.approx(1.25 / 7)
    assert main["mean_diff"]["bootstrap"]["estimate"] == pytest.approx(1.25 / 7)
    # theta = 0.5: S_exact = {p1, p3, p4}, S_refeed = {p3, p4}, S_replica = {p1, p3, p4}
    sel = main["selection"]["at_theta"]
    assert (sel["size_exact"], sel["size_refeed"], sel["size_replica"]) == (3, 2, 3)
    assert sel["jaccard_refeed"]["estimate"] == pytest.approx(2 / 3)
    assert sel["jaccard_replica_ceiling"]["estimate"] == 1.0
    # intervals bracket their estimates
    for stat in (main["excess_pp"], main["disagreement"]["exact_vs_refeed"], sel["jaccard_refeed"]):
        assert stat["ci_lo"] <= stat["estimate"] <= stat["ci_hi"]
    json.dumps(res)  # JSON-able


def test_conditioning_subsets_and_eligibility() -> None:
    res = run(case_credit(), metric="value")
    sel = res["conditionings"]["selector"]
    # the selector, not exact, decides: p5 (selector 4/4 both) out, p8 (exact 0/0, selector informative) in
    assert sel["n"] == 7
    assert sel["disagreement"]["exact_vs_refeed"]["estimate"] == pytest.approx(5 / 7)

    # a pivot ineligible in any compared pass leaves every conditioning; selector eligibility only 'selector'
    res = run(case_credit(ineligible={"refeed": ["p1"], "selector": ["p2"]}))
    assert res["conditionings"]["none"]["n"] == 7
    assert res["conditionings"]["informative"]["n"] == 6
    assert res["conditionings"]["selector"]["n"] == 5
    assert res["conditionings"]["main"]["n"] == 6  # p7 (zero everywhere) and p1 (ineligible) out
    assert res["conditionings"]["treatment_independent"]["n"] == 4  # exact nonzero: p3, p4, p5, p6


def test_paper_conditionings_main_and_treatment_independent() -> None:
    """main: Â nonzero in any of exact, replica, refeed (one denominator); TI: Â^exact nonzero."""
    res = run(case_credit())
    assert res["metric"] == "sign" and list(res["conditionings"]) == list(CONDITIONINGS)
    main, ti = res["conditionings"]["main"], res["conditionings"]["treatment_independent"]
    # p7 is 0 in every pass: out of main; p8 (exact 0, refeed 0.25) is in, although exact is uninformative
    assert main["n"] == 7 and main["n_problems"] == 4
    assert main["disagreement"]["exact_vs_refeed"]["n_disagree"] == 4  # p2, p4, p6, p8
    assert main["disagreement"]["exact_vs_replica"]["estimate"] == 0.0
    assert main["excess_pp"]["estimate"] == pytest.approx(400 / 7)
    # the re-feed alone made p2 and p8 eligible: the reason for the treatment-independent set
    assert main["eligibility_sources"] == {"n": 7, "only_refeed": 2, "only_replica": 0, "only_exact": 0}
    # TI keeps p1, p3, p4, p5, p6 (exact nonzero); of these only p4 and p6 change sign under re-feed
    assert ti["n"] == 5
    assert ti["disagreement"]["exact_vs_refeed"]["estimate"] == pytest.approx(2 / 5)
    assert ti["excess_pp"]["estimate"] == pytest.approx(40.0)
    row = headline_rows({"c": res}).filter(pl.col("conditioning") == "main").row(0, named=True)
    assert row["metric"] == "sign" and row["ti_excess_pp"] == pytest.approx(40.0)
    # the TI excess travels with its interval and per-problem t, on every row of the configuration
    ti_sign = ti["by_metric"]["sign"]
    assert (row["ti_excess_pp_ci_lo"], row["ti_excess_pp_ci_hi"]) == (
        ti_sign["excess_pp"]["ci_lo"],
        ti_sign["excess_pp"]["ci_hi"],
    )
    assert row["ti_excess_pp_ci_lo"] < 40.0 < row["ti_excess_pp_ci_hi"]
    assert row["ti_t_per_problem"] == ti_sign["per_problem_t"]["t"] is not None
    assert row["refeed_polarity_share"] == pytest.approx(1 / 7) and row["floor_polarity_share"] == 0.0


def test_sign_and_value_metrics() -> None:
    a = np.array([0.5, 0.5, 0.0, -0.5, 0.25])
    b = np.array([0.25, -0.5, 0.25, -0.5, 0.0])
    # a same-sign change of value (0.5 -> 0.25) counts under value only
    assert disagree(a, b, "value").tolist() == [True, True, True, False, True]
    assert disagree(a, b, "sign").tolist() == [False, True, True, False, True]
    with pytest.raises(ValueError, match="'magnitude'"):
        disagree(a, b, "magnitude")
    # both metrics are in every block; the flat keys are the headline metric's
    res = run(case_credit())
    main = res["conditionings"]["main"]
    assert main["by_metric"]["sign"]["disagreement"] == main["disagreement"]
    assert main["by_metric"]["value"]["disagreement"]["exact_vs_refeed"]["n_disagree"] == 5  # + p1
    assert main["by_metric"]["value"]["disagreement"]["exact_vs_replica"]["n_disagree"] == 1  # p3
    assert main["by_metric"]["sign"]["kinds_of_change"]["exact_vs_refeed"]["magnitude"]["count"] == 0
    assert main["by_metric"]["value"]["kinds_of_change"]["exact_vs_refeed"]["magnitude"]["count"] == 1
    value_rows = headline_rows({"c": res}, metric="value")
    assert set(value_rows["metric"].to_list()) == {"value"}
    assert value_rows.filter(pl.col("conditioning") == "main")["refeed_disagreement"][0] == pytest.approx(5 / 7)
    with pytest.raises(ValueError, match="metric"):
        run(case_credit(), metric="values")


def test_per_problem_t_weights_problems_equally() -> None:
    res = run(case_credit())
    ppt = res["conditionings"]["main"]["per_problem_t"]
    # main, sign: d_p = 1/2 (A: p2 of p1,p2), 1/2 (B), 1/2 (C), 1/1 (D: p8): mean 0.625, sd 0.25, se 0.125
    assert ppt["mean"] == pytest.approx(0.625)  # not the pivot-weighted 4/7
    assert ppt["t"] == pytest.approx(5.0) and ppt["df"] == 3
    assert ppt["p"] == pytest.approx(2 * stats.t.sf(5.0, 3))
    assert (ppt["problems_refeed_worse"], ppt["problems_floor_worse"], ppt["problems_equal"]) == (4, 0, 0)
    # one problem with many pivots counts once: 9 pivots all flipping in P, 1 of 1 in Q and R, none in S
    groups = np.array(["P"] * 9 + ["Q", "R", "S"])
    flips = np.array([1] * 9 + [1, 1, 0], dtype=bool)
    out = per_problem_t(flips, np.zeros(12, bool), groups)
    assert out["mean"] == pytest.approx(0.75) and out["problems_equal"] == 1
    flat = per_problem_t(np.zeros(4, bool), np.zeros(4, bool), np.array(["a", "a", "b", "c"]))
    assert flat["t"] is None and "SE is 0" in flat["reason"] and flat["problems_equal"] == 3
    assert per_problem_t(np.ones(2, bool), np.zeros(2, bool), np.array(["a", "a"]))["t"] is None


def test_mcnemar_on_a_known_case() -> None:
    # b = 9 pivots where only the re-feed flips, c = 1 where only the replica flips, 5 concordant
    refeed = np.array([1] * 9 + [0] + [1] * 2 + [0] * 3, dtype=bool)
    floor = np.array([0] * 9 + [1] + [1] * 2 + [0] * 3, dtype=bool)
    out = mcnemar_z(refeed, floor)
    assert (out["b"], out["c"], out["n"]) == (9, 1, 15)
    assert out["z"] == pytest.approx(8 / np.sqrt(10))
    assert out["p_exact"] == pytest.approx(2 * stats.binom.cdf(1, 10, 0.5))
    none = mcnemar_z(np.zeros(3, bool), np.zeros(3, bool))
    assert none["z"] is None and "no discordant" in none["reason"]
    main = run(case_credit())["conditionings"]["main"]
    assert (main["mcnemar"]["b"], main["mcnemar"]["c"], main["mcnemar"]["z"]) == (4, 0, 2.0)


def test_mean_zero_unclustered_margin_split_and_sources() -> None:
    d = np.array([-0.25, 0.25, 0.0, 1.0, 0.0, 0.25, 0.25])
    out = mean_zero_unclustered(d, 0.95)
    se = d.std(ddof=1) / np.sqrt(d.size)
    assert out["mean"] == pytest.approx(d.mean()) and out["se"] == pytest.approx(se)
    assert out["t"] == pytest.approx(d.mean() / se)
    assert (out["ci_lo"], out["ci_hi"]) == (pytest.approx(d.mean() - 1.96 * se), pytest.approx(d.mean() + 1.96 * se))
    assert mean_zero_unclustered(d, ci=0.9)["ci_hi"] == pytest.approx(d.mean() + stats.norm.ppf(0.95) * se)
    assert mean_zero_unclustered(np.zeros(3), 0.95)["t"] is None
    main = run(case_credit())["conditionings"]["main"]
    assert main["mean_diff"]["unclustered"]["mean"] == pytest.approx(d.mean())

    split = margin_split(
        np.array([0.1, 0.2, 0.3, 0.5]), np.array([1, 0, 1, 1], bool), np.array([0, 0, 1, 0], bool), 0.3
    )
    assert split["below"] == {"n": 2, "refeed": 0.5, "floor": 0.0, "excess_pp": 50.0}
    assert split["at_or_above"]["n"] == 2 and split["at_or_above"]["floor"] == 0.5
    assert main["margin_split"]["below"]["n"] == 7 and main["margin_split"]["at_or_above"]["n"] == 0
    src = eligibility_sources(np.array([0, 0, 0.5, 0]), np.array([0, 0.25, 0.5, 0]), np.array([0.25, 0, 0, 0]))
    assert src == {"n": 4, "only_refeed": 1, "only_replica": 1, "only_exact": 0}


def test_selector_without_selector_pass_says_why() -> None:
    res = run(case_credit(passes=("exact", "replica", "refeed")))
    sel = res["conditionings"]["selector"]
    assert sel["available"] is False and "selector" in sel["reason"]
    assert "n" not in sel and "disagreement" not in sel
    assert res["conditionings"]["treatment_independent"]["available"] is True  # the paper's needs no selector
    row = headline_rows({"c": res}).filter(pl.col("conditioning") == "selector").row(0, named=True)
    assert row["n"] is None and row["floor"] is None and "selector" in row["note"]


def test_informative_without_counts_is_unavailable_not_a_crash() -> None:
    credit = {
        p: df.with_columns(
            pl.lit(None, dtype=pl.Int64).alias("n_orig_correct"), pl.lit(None, dtype=pl.Int64).alias("n_sub_correct")
        )
        for p, df in case_credit().items()
    }
    res = run(credit)
    for cond in ("informative", "selector"):
        block = res["conditionings"][cond]
        assert block["available"] is False and "per-branch success counts" in block["reason"], cond
    assert res["conditionings"]["main"]["n"] == 7
    json.dumps(res)


def test_too_few_note_counts_the_problems_needed_in_integers() -> None:
    # 3 eligible pivots from 47 problems, 6 needed: 3 more pivots at 3/47 a problem is exactly 47 problems
    assert "about 47 more such problems" in too_few_note(3, 6, 47)
    assert "about 2 more such problems" in too_few_note(7, 10, 4)


def test_too_few_eligible_pivots_nulls_every_number() -> None:
    res = run(case_credit(), min_eligible=10)
    main = res["conditionings"]["main"]
    # 7 eligible pivots from 4 problems: 1.75 a problem, so 2 more problems reach 10 (a small run says so)
    assert main["note"] == (
        "too few eligible pivots (n=7 < min_eligible=10); at 1.75 eligible pivots per problem "
        "with pivots, about 2 more such problems would reach it (dataset.n_problems, or "
        "rollouts.per_problem / pivots.per_rollout)"
    )
    assert main["n"] == 7 and main["n_problems"] == 4
    assert main["disagreement"]["exact_vs_refeed"]["estimate"] is None
    assert main["disagreement"]["exact_vs_refeed"]["n_disagree"] is None
    assert main["excess_pp"] == {"estimate": None, "ci_lo": None, "ci_hi": None}
    assert main["clustered_t"]["t"] is None and main["clustered_t"]["se"] is None
    assert main["kinds_of_change"]["exact_vs_refeed"]["zero_crossing"] == {
        "count": None,
        "share": None,
        "share_of_n": None,
    }
    assert main["selection"]["at_theta"]["theta"] == 0.5
    assert main["selection"]["at_theta"]["jaccard_refeed"]["estimate"] is None

    def numbers(obj, path=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from numbers(v, f"{path}.{k}")
        elif isinstance(obj, list):
            for v in obj:
                yield from numbers(v, path)
        elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
            yield path

    assert sorted(set(numbers(main))) == [".n", ".n_problems", ".selection.at_theta.theta", ".selection.sweep.theta"]


def test_other_passes_are_compared_against_exact_and_refeed() -> None:
    credit = case_credit()
    # refeed_text equals refeed except on p1 (where it equals exact); ineligible on p7
    credit["refeed_text"] = credit["refeed"].with_columns(
        pl.when(pl.col("pivot_id") == "p1").then(0.5).otherwise(pl.col("a_hat")).alias("a_hat"),
        (pl.col("pivot_id") != "p7").alias("eligible"),
    )
    other = run(credit, metric="value")["conditionings"]["informative"]["other_passes"]["refeed_text"]
    assert other["n"] == 6
    assert other["vs_exact"]["estimate"] == pytest.approx(3 / 6)
    assert other["vs_refeed"]["estimate"] == pytest.approx(1 / 6)


def test_theta_sweep_defaults_to_the_lattice() -> None:
    res = run(case_credit())
    assert res["parameters"]["theta_sweep"] == [0.25, 0.5, 0.75, 1.0]
    sweep = res["conditionings"]["main"]["selection"]["sweep"]
    assert sweep[1] == res["conditionings"]["main"]["selection"]["at_theta"]
    assert lattice_thetas([4, 2]) == [0.25, 0.5, 0.75, 1.0]
    assert run(case_credit(), theta_sweep=[])["conditionings"]["main"]["selection"]["sweep"] == []


def test_inconsistent_inputs_are_refused() -> None:
    credit = case_credit()
    with pytest.raises(ValueError, match="required pass"):
        wide_frame({"exact": credit["exact"], "replica": credit["replica"]})
    bad = dict(credit, refeed=credit["refeed"].with_columns(pl.lit(8, dtype=pl.Int64).alias("k")))
    with pytest.raises(ValueError, match="different K"):
        wide_frame(bad)
    with pytest.raises(ValueError, match="same pivots"):
        wide_frame(dict(credit, refeed=credit["refeed"].head(5)))


# --------------------------------------------------------------------------------------------- primitives


def test_cluster_robust_se_matches_the_sandwich_formula() -> None:
    rng = np.random.default_rng(3)
    groups = np.repeat(np.arange(9), rng.integers(1, 6, size=9))
    y = rng.choice([-1.0, 0.0, 1.0], size=groups.size)
    n, g = y.size, 9
    resid = y - y.mean()
    meat = sum(resid[groups == j].sum() ** 2 for j in range(g))
    # (X'X)^-1 meat (X'X)^-1 with X = 1, times statsmodels' G/(G-1) * (N-1)/(N-k), k = 1
    se = np.sqrt(meat / n**2 * g / (g - 1) * (n - 1) / (n - 1))
    out = cluster_ols_mean(y, groups.astype(str), ci=0.9)
    assert out["coef"] == pytest.approx(y.mean(), rel=1e-12)
    assert out["se"] == pytest.approx(se, rel=1e-10)
    assert out["t"] == pytest.approx(y.mean() / se, rel=1e-10)
    assert out["df"] == g - 1 and out["n_clusters"] == g and out["n"] == n
    assert out["p"] == pytest.approx(2 * stats.t.sf(abs(y.mean() / se), g - 1), rel=1e-8)
    half = stats.t.ppf(0.95, g - 1) * se
    assert (out["ci_lo"], out["ci_hi"]) == (pytest.approx(y.mean() - half), pytest.approx(y.mean() + half))


def test_cluster_ols_degenerate_cases_say_why() -> None:
    flat = cluster_ols_mean(np.zeros(6), np.array([0, 0, 1, 1, 2, 2]), 0.95)
    assert flat["coef"] == 0.0 and flat["se"] == 0.0 and flat["t"] is None and flat["p"] is None
    assert "SE is 0" in flat["reason"]
    one = cluster_ols_mean(np.array([0.0, 1.0]), np.array(["a", "a"]), 0.95)
    assert one["coef"] == 0.5 and one["se"] is None and "fewer than 2 clusters" in one["reason"]
    empty = cluster_ols_mean(np.array([]), np.array([]), 0.95)
    assert empty["coef"] is None and empty["reason"] == "no observations"


def test_jaccard_and_empty_sets() -> None:
    a = np.array([1, 1, 1, 0, 0], dtype=bool)
    b = np.array([0, 1, 1, 1, 0], dtype=bool)
    assert jaccard(a, b) == 0.5
    assert jaccard(a, a) == 1.0
    assert jaccard(np.zeros(3, bool), np.zeros(3, bool)) is None
    clusters = Clusters.from_ids(["x", "y", "z"], n_boot=50, seed=0)
    zero = np.zeros(3)
    sel = selection_at({"exact": zero, "refeed": zero, "replica": np.array([0.0, 0.25, 0.0])}, 0.5, clusters, 0.95)
    assert sel["jaccard_refeed"]["estimate"] is None and sel["jaccard_refeed"]["reason"] == "empty sets"


def test_classification_of_changes() -> None:
    a = np.array([0.0, 0.5, 0.5, -0.25, 0.25, 0.0, 0.75])
    b = np.array([0.25, 0.0, -0.5, -0.75, 0.25, 0.0, 0.5])
    out = classify_changes(a, b, "value")
    assert out["n"] == 7 and out["n_changed"] == 5
    assert (out["zero_crossing"]["count"], out["reversal"]["count"], out["magnitude"]["count"]) == (2, 1, 2)
    assert out["reversal"]["share"] == 0.2 and out["reversal"]["share_of_n"] == pytest.approx(1 / 7)
    # under the sign metric the two same-sign magnitude changes are agreements
    sign = classify_changes(a, b, "sign")
    assert sign["metric"] == "sign" and sign["n_changed"] == 3
    assert (sign["zero_crossing"]["count"], sign["reversal"]["count"], sign["magnitude"]["count"]) == (2, 1, 0)
    assert sign["zero_crossing"]["share_of_n"] == pytest.approx(2 / 7)
    same = classify_changes(a, a, "sign")
    assert same["n_changed"] == 0 and same["zero_crossing"]["share"] is None and "reason" in same


def test_bootstrap_replicates_equal_explicit_resamples_and_are_seeded() -> None:
    ids = ["a", "a", "b", "c", "c", "c", "d"]
    x = np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    cl = Clusters.from_ids(ids, n_boot=30, seed=11)
    reps = cl.replicates(x, np.ones_like(x))
    labels = sorted(set(ids))
    for b in range(30):
        drawn = [p for p, c in zip(labels, cl.counts[b]) for _ in range(int(c))]
        assert cl.counts[b].sum() == len(labels)
        values = [x[i] for p in drawn for i in range(len(ids)) if ids[i] == p]
        assert reps[b] == pytest.approx(np.mean(values))
    again = Clusters.from_ids(ids, n_boot=30, seed=11)
    assert np.array_equal(again.counts, cl.counts)
    assert not np.array_equal(Clusters.from_ids(ids, n_boot=30, seed=12).counts, cl.counts)


def test_compare_passes_is_deterministic_given_the_seed() -> None:
    rng = np.random.default_rng(5)
    entries = {p: [] for p in ("exact", "replica", "refeed")}
    for i in range(120):
        base = rng.integers(0, K + 1, size=2)
        for p in entries:
            jitter = rng.integers(-1, 2, size=2) if p != "exact" and rng.random() < 0.3 else (0, 0)
            n_o, n_s = np.clip(base + jitter, 0, K)
            entries[p].append((f"v{i}", f"q{i // 3}", int(n_o), int(n_s)))
    credit = {p: credit_frame(p, e) for p, e in entries.items()}
    first, second = run(credit, n_boot=300, seed=1), run(credit, n_boot=300, seed=1)
    assert first == second
    other = run(credit, n_boot=300, seed=2)
    assert (
        other["conditionings"]["main"]["excess_pp"]["estimate"]
        == first["conditionings"]["main"]["excess_pp"]["estimate"]
    )
    assert other["conditionings"]["main"]["excess_pp"] != first["conditionings"]["main"]["excess_pp"]


# ------------------------------------------------------------------------------------------------ pooling


def test_pooled_clusters_are_config_qualified_problems() -> None:
    per_config = {"cfgA": case_credit(), "cfgB": case_credit(passes=("exact", "replica", "refeed"))}
    pooled = pool_credit(per_config)
    assert sorted(pooled) == ["exact", "refeed", "replica"]  # selector is not in every config
    assert pooled["exact"]["pivot_id"].to_list()[:2] == ["cfgA::p1", "cfgA::p2"]
    res = run(pooled)
    main = res["conditionings"]["main"]
    assert (main["n"], main["n_problems"], main["clustered_t"]["n_clusters"]) == (14, 8, 8)
    assert main["disagreement"]["exact_vs_refeed"]["estimate"] == pytest.approx(8 / 14)
    table = headline_rows({"cfgA": run(per_config["cfgA"]), "pooled": res})
    assert table.height == 2 * len(CONDITIONINGS)
    row = table.filter((pl.col("config") == "pooled") & (pl.col("conditioning") == "main")).row(0, named=True)
    assert row["n"] == 14 and row["excess_pp"] == pytest.approx(main["excess_pp"]["estimate"])
    assert row["jaccard_refeed"] == pytest.approx(main["selection"]["at_theta"]["jaccard_refeed"]["estimate"])
    assert row["share_zero_crossing"] == 0.75 and row["share_reversal"] == 0.25  # sign metric: p2, p6, p8 / p4
    assert row["t_per_problem"] == main["per_problem_t"]["t"] and row["mcnemar_z"] == main["mcnemar"]["z"]
    assert row["t"] == main["clustered_t"]["t"] and row["mean_diff"] == main["mean_diff"]["cluster"]["coef"]


ANALYSIS = analysis_settings(n_boot=200, min_eligible=1, seed=7)


def test_pooling_keeps_one_engine_kernels_and_model_and_pools_none_across_them() -> None:
    """Pooled rows never mix engines, kernel modes, models, dtypes or a trained model with its base: a floor or a
    re-feed rate belongs to one of each, and a problem of two models would be counted as two clusters."""
    per_config = {"cfgA": case_credit(), "cfgB": case_credit(passes=("exact", "replica", "refeed"))}
    one = {"engine": "hf", "kernels": "stock", "model": "smollm2-135m", "dtype": "bfloat16", "train": "untrained"}
    alike = {"cfgA": one, "cfgB": {**one, "temperature": 1.0}}
    pooled = pooled_comparison(per_config, alike, ANALYSIS, "h")
    expected = run(pool_credit(per_config), n_boot=200, seed=7, probe_reason=POOLED_PROBE_REASON)
    assert pooled == {**expected, "config": "pooled", "configs": ["cfgA", "cfgB"], "analysis_hash": "h"}
    assert pooled["conditionings"]["main"]["n"] == 14
    for key, other in (
        ("kernels", "invariant"),
        ("engine", "vllm"),
        ("model", "qwen2.5-coder-0.5b"),
        ("dtype", "float16"),
        ("train", "grpo-1234abcd"),
    ):
        mixed = {**alike, "cfgB": {**alike["cfgB"], key: other}}
        result = pooled_comparison(per_config, mixed, ANALYSIS, "h")
        assert result["configs"] == ["cfgA", "cfgB"] and result["analysis_hash"] == "h"
        groups = result["not_pooled"]["groups"]
        assert sorted((g["configs"], g[key]) for g in groups) == [(["cfgA"], alike["cfgA"][key]), (["cfgB"], other)]
        for cond in CONDITIONINGS:
            block = result["conditionings"][cond]
            assert block["available"] is False and "not pooled" in block["reason"] and "cfgB" in block["reason"]
        rows = headline_rows({"cfgA": run(per_config["cfgA"]), "pooled": result}).filter(pl.col("config") == "pooled")
        assert rows["n"].null_count() == rows.height and rows["excess_pp"].null_count() == rows.height
        assert all("not pooled" in note for note in rows["note"].to_list())
    with pytest.raises(ValueError, match="settings for"):
        pooled_comparison(per_config, {"cfgA": alike["cfgA"]}, ANALYSIS, "h")


# --------------------------------------------------------------------------------------- channel agreement


def _rows(pivot: str, n_o: int, n_s: int) -> list[dict]:
    return [
        {
            "pivot_id": pivot,
            "problem_id": "P",
            "branch": br,
            "k": j,
            "token_ids": [7, j],
            "answer": str(j),
            "correct": j < n,
            "finish_reason": "eos",
            "n_tokens": 2,
            "verified": True,
            "next_topk_ids": [3, 4],
            "next_topk_logprobs": [-0.5, -1.0],
        }
        for br, n in (("orig", n_o), ("sub", n_s))
        for j in range(K)
    ]


def _edit(rows: list[dict], pivot: str, branch: str, k: int, **changes) -> None:
    next(r for r in rows if (r["pivot_id"], r["branch"], r["k"]) == (pivot, branch, k)).update(changes)


def test_channel_agreement_shares_and_invariant_assertion() -> None:
    pivots = pl.DataFrame(
        {
            "pivot_id": ["a", "b"],
            "problem_id": ["P", "P"],
            "t": [1, 2],
            "margin": [0.1, 0.1],
            "rollout_correct": [True, True],
            "prefix_len": [5, 6],
        }
    )
    base = _rows("a", 2, 1) + _rows("b", 2, 2)
    _edit(base, "a", "orig", 1, next_topk_logprobs=[0.0, -1.0])
    _edit(base, "a", "sub", 2, answer=None)
    other = [dict(r) for r in base]
    _edit(other, "a", "orig", 0, token_ids=[7, 9])
    _edit(other, "a", "orig", 1, next_topk_logprobs=[-0.0, -1.0])  # equal as numbers, not as bits
    _edit(other, "b", "orig", 0, answer="8")
    other = [r for r in other if (r["pivot_id"], r["branch"], r["k"]) != ("b", "sub", 3)]
    frames = {
        name: pl.DataFrame(rows, schema_overrides={"answer": pl.String})
        for name, rows in (("exact", base), ("replica", base), ("refeed", other))
    }
    credit = {n: compute_credit(f, pivots, K, n, "graded") for n, f in frames.items()}
    agreement = channel_agreement(frames, credit)
    assert agreement.columns == ["pass_a", "pass_b", "channel", "n", "share_identical"]
    got = {
        (r["pass_a"], r["pass_b"], r["channel"]): (r["n"], r["share_identical"])
        for r in agreement.iter_rows(named=True)
    }
    assert got[("exact", "refeed", "rows_present")] == (16, 15 / 16)
    assert got[("exact", "refeed", "token_ids")] == (15, 14 / 15)
    assert got[("exact", "refeed", "answer")] == (15, 14 / 15)  # the shared null answer counts as identical
    assert got[("exact", "refeed", "correct")] == (15, 1.0)
    assert got[("exact", "refeed", "next_topk")] == (15, 14 / 15)
    assert got[("exact", "refeed", "success_counts")] == (2, 1.0)
    assert got[("exact", "refeed", "a_hat")] == (2, 1.0)
    assert {v for k, v in got.items() if k[:2] == ("exact", "replica")} <= {(16, 1.0), (2, 1.0)}
    assert len({k[:2] for k in got}) == 3

    assert_all_identical(agreement.filter((pl.col("pass_a") == "exact") & (pl.col("pass_b") == "replica")))
    with pytest.raises(AssertionError) as err:
        assert_all_identical(agreement)
    message = str(err.value)
    assert "exact vs refeed / token_ids" in message and "refeed vs replica / next_topk" in message
    assert "exact vs replica" not in message
    with pytest.raises(AssertionError, match="nothing"):
        assert_all_identical(agreement.head(0))
    # a fresh-seed pass (selector) draws other noise by design: its differences are not an invariance failure
    fresh = pl.DataFrame(
        {
            "pass_a": ["exact", "exact"],
            "pass_b": ["replica", "selector"],
            "channel": ["token_ids", "token_ids"],
            "n": [8, 8],
            "share_identical": [1.0, 0.25],
        }
    )
    assert_all_identical(fresh)
    with pytest.raises(AssertionError, match="nothing"):
        assert_all_identical(fresh.tail(1))


def test_lists_bitwise_equal() -> None:
    a = pl.Series([[0.0], [float("nan")], None, [], [], [1.0, 2.0], [1.0, None]])
    b = pl.Series([[-0.0], [float("nan")], None, [], None, [1.0], [1.0, None]])
    assert lists_bitwise_equal(a, b).tolist() == [False, True, True, True, False, False, True]
    ints = pl.Series([[1, 2], [3]])
    assert lists_bitwise_equal(ints, pl.Series([[1, 2], [4]])).tolist() == [True, False]


def test_identical_passes_give_exact_zeros_and_no_fake_t() -> None:
    exact = case_credit()["exact"]
    credit = {p: exact.with_columns(pl.lit(p).alias("pass_name")) for p in ("exact", "replica", "refeed")}
    main = run(credit)["conditionings"]["main"]
    assert main["disagreement"]["exact_vs_refeed"]["estimate"] == 0.0
    assert main["disagreement"]["exact_vs_replica"]["estimate"] == 0.0
    assert main["excess_pp"] == {"estimate": 0.0, "ci_lo": 0.0, "ci_hi": 0.0}
    assert main["clustered_t"]["t"] is None and "SE is 0" in main["clustered_t"]["reason"]
    assert main["per_problem_t"]["t"] is None and main["mcnemar"]["z"] is None
    assert main["by_metric"]["value"]["excess_pp"]["estimate"] == 0.0
    assert main["kinds_of_change"]["exact_vs_refeed"]["n_changed"] == 0
    assert main["selection"]["at_theta"]["jaccard_refeed"]["estimate"] == 1.0
    row = headline_rows({"inv": run(credit)}).filter(pl.col("conditioning") == "main").row(0, named=True)
    assert row["t"] is None and "SE is 0" in row["note"] and row["excess_pp"] == 0.0


def test_no_eligible_pivots_at_all() -> None:
    credit = case_credit(ineligible={"replica": [r[0] for r in CASE]})
    for min_eligible in (0, 5):
        res = run(credit, min_eligible=min_eligible)
        for cond in CONDITIONINGS:
            block = res["conditionings"][cond]
            assert block["n"] == 0 and block["disagreement"]["exact_vs_refeed"]["estimate"] is None
            assert block["clustered_t"]["coef"] is None
        json.dumps(res)
    assert res["conditionings"]["main"]["note"].startswith(
        "too few eligible pivots (n=0 < min_eligible=5); none at all here: raise dataset.n_problems"
    )


def test_channel_agreement_refuses_duplicated_rows() -> None:
    rows = _rows("a", 1, 1)
    frame = pl.DataFrame(rows + rows[:1], schema_overrides={"answer": pl.String})
    with pytest.raises(ValueError, match="duplicated"):
        channel_agreement({"exact": frame, "refeed": pl.DataFrame(rows, schema_overrides={"answer": pl.String})}, {})


# ------------------------------------------------------------------------------------------- probe channel


def _probe_pass(
    rows: list[dict], logprob: dict | None = None, ids: dict | None = None, drop: bool = False, null: bool = False
) -> pl.DataFrame:
    """A pass frame with probe columns on the k == 0 rows (overrides by (pivot, branch)), null elsewhere."""
    out = []
    for r in rows:
        r = dict(r)
        key = (r["pivot_id"], r["branch"])
        first = r["k"] == 0 and not null
        r["probe_ids"] = (ids or {}).get(key, [5, 6, 7]) if first else None
        r["probe_logprob"] = (logprob or {}).get(key, -0.5) if first else None
        out.append(r)
    frame = pl.DataFrame(
        out, schema_overrides={"answer": pl.String, "probe_ids": pl.List(pl.Int64), "probe_logprob": pl.Float64}
    )
    return frame.drop("probe_ids", "probe_logprob") if drop else frame


def test_probe_channel_bit_exact_p90_and_divergence() -> None:
    base = [r for p in ("a", "b", "c", "d") for r in _rows(p, 2, 1)]
    passes = {
        "exact": _probe_pass(base),
        "replica": _probe_pass(base, logprob={("b", "sub"): -0.5 + 2**-10}),
        "refeed": _probe_pass(
            base, logprob={("a", "orig"): -0.75, ("c", "sub"): -0.625}, ids={("a", "sub"): [5, 6, 8]}
        ),
        "selector": _probe_pass(base, drop=True),
        "replica_fresh": _probe_pass(base, null=True),
    }
    deltas = probe_deltas(passes)
    summary = probe_summary(deltas, ["refeed", "replica", "selector", "replica_fresh"])
    assert summary["replica"]["n"] == 4 and summary["replica"]["bit_exact_share"] == 0.75
    assert summary["replica"]["divergence_share"] == 0.0
    # refeed: per-pivot max |delta| = 0.25 (a), 0 (b), 0.125 (c), 0 (d); a's alt-branch probe diverged
    assert summary["refeed"]["bit_exact_share"] == 0.5 and summary["refeed"]["divergence_share"] == 0.25
    assert summary["refeed"]["p90_abs_delta"] == 0.25  # an order statistic, not interpolated
    for name in ("selector", "replica_fresh"):  # columns absent, or present and all null
        assert summary[name]["recorded"] is False and "not recorded" in summary[name]["reason"]
    # no probe columns anywhere: "not recorded" in the comparison, not an error
    res = run(case_credit(), probes=probe_deltas({"exact": _probe_pass(base, drop=True)}))
    assert all(v["recorded"] is False for v in res["probe"].values())
    assert run(case_credit(), probes=deltas)["probe"]["refeed"]["bit_exact_share"] == 0.5


def test_a_comparison_stops_where_too_few_exact_pivots_were_verified():
    assert analysis_settings().min_verified == 0.99  # absent: MIN_VERIFIED
    given = validate_config({"configs": {"c": {"model": "smollm2-135m"}}, "analysis": {"min_verified": 0.9}})
    assert AnalysisSettings.of(given["analysis"], 0).min_verified == 0.9
    check_verified({"pivots": 1097, "verified": 1091, "rate": 1091 / 1097}, 0.99)  # SGLang's 1.5B: 99.45%
    check_verified({"pivots": 100, "verified": 99, "rate": 0.99}, 0.99)  # at the bound
    check_verified({"pivots": 0, "verified": 0, "rate": None}, 0.99)  # no pivots: the comparison says so itself
    with pytest.raises(ValueError, match=r"98 of 100 pivots \(98.00%\), below analysis.min_verified 0.99"):
        check_verified({"pivots": 100, "verified": 98, "rate": 0.98}, 0.99)
