"""Replicated passes: the crossed (problems x pairs) interval of the excess, its components, the coverage it
promises, the plan it makes, and the draws the workflow runs for it."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY, analysis_settings, planned_rules
from scipy import stats as sps

from replaynoise.analysis.comparison import compare_passes
from replaynoise.analysis.replicated import (
    Components,
    components,
    crossed_difference,
    crossed_interval,
    level_interval,
    pass_level_interval,
    plan,
    replicated_stats,
)
from replaynoise.config import analysis_hash, validate_config
from replaynoise.generation.passes import draw_name, pass_spec, replicate_pairs, run_passes
from replaynoise.io import read_json, read_parquet
from replaynoise.settings import AnalysisSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import coverage  # noqa: E402

SETTINGS = analysis_settings(n_boot=200, seed=3, min_eligible=1)


# ------------------------------------------------------------------------------------------- the estimator


def test_the_components_of_an_additive_table_are_its_row_and_column_spreads():
    """e[p, r] = u[p] + v[r] exactly (one pivot per cell): no residual, the problem and pass components are the
    variances of u and v, and the variance of the mean is theirs over G and R."""
    u, v = np.array([0.0, 0.2, -0.1, 0.3, -0.4]), np.array([0.05, -0.05, 0.1])
    s = 0.5 + u[:, None] + v[None, :]  # cell sums of one pivot each: the ratio's numerator
    n = np.ones_like(s)
    estimate, comp = components(s, n)
    assert estimate == pytest.approx(s.mean())
    assert comp.residual == pytest.approx(0.0, abs=1e-15)
    assert comp.problem == pytest.approx(np.var(u, ddof=1))
    assert comp.pass_level == pytest.approx(np.var(v, ddof=1))
    assert comp.variance() == pytest.approx(np.var(u, ddof=1) / 5 + np.var(v, ddof=1) / 3)


def test_a_pass_component_estimated_at_zero_still_widens_the_interval_by_its_few_degrees_of_freedom():
    """Pairs that agree (MS_pairs below MS_residual): the pass component is 0, but from R - 1 = 2 degrees of
    freedom it cannot be told from a small one, so the interval is wider than the problem bootstrap's."""
    rng = np.random.default_rng(0)
    s = rng.normal(0.0, 1.0, (30, 1)) + rng.normal(0.0, 0.5, (30, 3))
    s -= s.mean(axis=0) - s.mean()  # the pairs' means made equal: no pass-level spread at all
    stat = crossed_interval(s, np.ones_like(s), 0.95)
    assert stat["components"]["pass_sd"] == 0.0
    assert stat["df"] < 29  # a problem-only t would have G - 1 = 29 degrees of freedom
    assert stat["components"]["pass_sd_ci_lo"] is None and stat["components"]["pass_sd_ci_hi"] > 0
    assert stat["components"]["pass_test"]["p"] > 0.05


def test_a_pass_component_of_rounding_alone_is_zero_with_a_finite_interval():
    """The ladder's SmolLM2 main set: every pair's excess nearly the same, MS_pairs and MS_residual equal but for
    their last bits. The difference was a pass component of 1e-19, Satterthwaite's degrees of freedom 0 and the
    component's lower bound NaN (null in comparison.json, a bare "0.0" in the table)."""
    folder = Path(__file__).resolve().parents[1] / "reference" / "gpu-vllm" / "ladder" / "smollm2"
    config = read_json(folder / "provenance.json")["config"]
    credit = {
        p: read_parquet(folder / "credit" / "smollm2-135m-vllm" / f"{p}.parquet") for p in run_passes(config["replay"])
    }
    result = compare_passes(credit, AnalysisSettings.of(config["analysis"], config["seed"]))
    crossed = result["conditionings"]["main"]["replicated"]["excess_pp"]["crossed"]
    ms = crossed["components"]["mean_squares"]
    assert ms["pairs"] == pytest.approx(ms["residual"], rel=1e-12)  # the case itself
    assert crossed["components"]["pass_sd"] == 0.0 and crossed["components"]["pass_sd_ci_lo"] is None
    assert 0 < crossed["components"]["pass_sd_ci_hi"] < 10 and crossed["ci_lo"] < 0 < crossed["ci_hi"]


def test_a_pass_component_gets_a_lower_end_only_where_its_f_test_rejects():
    """Pairs spread as residual noise would spread them give a positive estimate now and then; its F test (MS_pairs /
    MS_residual on R - 1 and (G - 1)(R - 1) df) does not reject, so only the upper bound is reported. A real pass
    shift rejects and gets both ends."""
    rng = np.random.default_rng(2)
    noise = rng.normal(0.0, 0.3, (40, 1)) + rng.normal(0.0, 0.2, (40, 3))
    for shift, significant in ((np.zeros(3), False), (np.array([-0.3, 0.0, 0.3]), True)):
        s = noise + shift
        stat = crossed_interval(s, np.ones_like(s), 0.95)["components"]
        ms = stat["mean_squares"]
        f = ms["pairs"] / ms["residual"]
        assert stat["pass_test"]["f"] == pytest.approx(f)
        assert stat["pass_test"]["p"] == pytest.approx(sps.f.sf(f, 2, 78))
        assert (stat["pass_test"]["p"] < 0.05) == significant
        assert (stat["pass_sd_ci_lo"] is not None) == significant and stat["pass_sd_ci_hi"] > 0
    assert 0 < stat["pass_sd_ci_lo"] < stat["pass_sd"] < stat["pass_sd_ci_hi"]


def test_the_pass_interval_of_a_design_without_pass_degrees_of_freedom_is_empty_not_a_division_by_zero():
    """One pair (R - 1 = 0) has no pass component to test or bound; a difference of mean squares that is rounding
    alone gives Satterthwaite 0 degrees of freedom and a zero lower end, not a NaN."""
    one_pair = Components(
        problem=0.01, pass_level=0.0, residual=0.02, n_problems=40, n_pairs=1, mean_squares=(0.03, 0.0, 0.02)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pass_level_interval(one_pair, 0.95) == {
            "ci_lo": None,
            "ci_hi": None,
            "f": None,
            "p": None,
            "df": 0,
            "df_residual": 0,
        }
        out = level_interval(1.0, 0.0, 2, 10**9, 40, 0.95)  # MS_residual 0: rejects; nu = df
        assert out["p"] == 0.0 and 0 < out["ci_lo"] < out["ci_hi"]
        edge = level_interval(1.0 + 1e-12, 1.0, 2, 10**12, 40, 0.95)  # rejects at huge df; difference is rounding
        assert edge["ci_lo"] == 0.0 or edge["ci_lo"] is None


def test_replicated_stats_pool_the_pairs_and_keep_each_pair_s_own_excess():
    codes = np.repeat(np.arange(4), 5)
    masks = np.ones((2, 20), dtype=bool)
    masks[1, :3] = False  # pair 2's set lacks three pivots
    refeed = np.zeros((2, 20))
    refeed[0, ::2] = 1
    refeed[1, ::4] = 1
    floor = np.zeros((2, 20))
    floor[:, ::5] = 1
    out = replicated_stats(codes, masks, refeed, floor, ci=0.95, n_boot=100, seed=1)
    z = refeed - floor
    pooled = 100 * z[masks].sum() / masks.sum()
    assert out["excess_pp"]["estimate"] == pytest.approx(pooled)
    assert out["excess_pp"]["problem_only"]["estimate"] == pytest.approx(pooled)
    assert [p["estimate"] for p in out["pairs"]] == pytest.approx([100 * z[0].mean(), 100 * z[1][masks[1]].mean()])
    assert out["n_per_pair"] == [20, 17] and out["n_problems"] == 4 and out["n_pairs"] == 2
    assert out["refeed"]["estimate"] == pytest.approx(refeed[masks].mean())
    assert out["resolved"] == (out["excess_pp"]["crossed"]["ci_lo"] > 0)


# -------------------------------------------------------------------------------------------- coverage


@pytest.mark.parametrize("pass_sd", [0.25, 0.5])
def test_the_crossed_interval_covers_zero_where_the_problem_bootstrap_does_not(pass_sd):
    """Simulated runs (benchmarks/coverage.py: 40 problems, K = 4, three pairs, continuations that reproduce the
    exact pass unless they diverge, a divergence chance shifted per pass draw on the logit scale) with no true
    excess: the crossed 95% interval holds zero in at least 93% of them; the problem bootstrap, which holds the
    draws fixed, in far fewer (benchmarks/results/coverage-crossed.json has 2,000 runs of each)."""
    result = coverage.coverage(500, pass_sd, seed=11)
    assert result["coverage"]["crossed"] >= 0.93, result
    assert result["coverage"]["problem_only"] <= 0.8, result
    assert result["median_pass_sd_pp"] > 1.0  # the component it found is there to be found


# ------------------------------------------------------------------------------------------------ power


def test_the_difference_of_two_runs_is_welch_s_interval_of_two_independent_means():
    """Two samples' means as two runs' estimates (se s/sqrt(n), df n - 1): the difference's interval is scipy's
    Welch t interval of the same samples."""
    rng = np.random.default_rng(5)
    x, y = rng.normal(3.0, 2.0, 12), rng.normal(1.0, 0.7, 30)
    run = [{"estimate": z.mean(), "se": z.std(ddof=1) / math.sqrt(z.size), "df": z.size - 1.0} for z in (x, y)]
    diff = crossed_difference(run[0], run[1], 0.95)
    welch = sps.ttest_ind(x, y, equal_var=False).confidence_interval(0.95)
    assert diff["estimate"] == pytest.approx(x.mean() - y.mean())
    assert (diff["ci_lo"], diff["ci_hi"]) == pytest.approx((welch.low, welch.high), rel=1e-9)
    assert diff["resolved"] == (welch.low > 0 or welch.high < 0)
    swapped = crossed_difference(run[1], run[0], 0.95)
    assert (swapped["ci_lo"], swapped["ci_hi"]) == pytest.approx((-diff["ci_hi"], -diff["ci_lo"]))


def test_a_difference_from_a_run_without_spread_is_the_other_run_s_interval_shifted():
    first = crossed_interval(*_two_pair_table(), ci=0.95, scale=100.0)
    exact = {"estimate": 4.0, "se": 0.0, "df": 3.0}
    diff = crossed_difference(first, exact, 0.95)
    assert diff["df"] == pytest.approx(first["df"])
    assert (diff["ci_lo"], diff["ci_hi"]) == pytest.approx((first["ci_lo"] - 4.0, first["ci_hi"] - 4.0))


def test_a_run_of_one_pair_has_no_difference_interval_and_says_which_run_and_why():
    one_pair = crossed_interval(np.array([[1.0], [2.0]]), np.array([[4.0], [4.0]]), 0.95)
    diff = crossed_difference({"estimate": 1.0, "se": 0.5, "df": 9.0}, one_pair, 0.95)
    assert diff["estimate"] == pytest.approx(1.0 - 3.0 / 8.0) and diff["ci_lo"] is None
    assert "second run's" in diff["reason"] and "2 pairs" in diff["reason"] and diff["resolved"] is None


def test_a_difference_refuses_an_impossible_interval_naming_the_run_and_values():
    with pytest.raises(ValueError, match="first run's crossed interval has se -1.0 and df 3.0"):
        crossed_difference({"estimate": 1.0, "se": -1.0, "df": 3.0}, {"estimate": 0.0, "se": 1.0, "df": 3.0}, 0.95)


def _two_pair_table() -> tuple[np.ndarray, np.ndarray]:
    """Cell sums and counts of 6 problems x 2 pairs, 4 pivots a cell."""
    s = np.array([[1.0, 2.0], [0.0, 1.0], [2.0, 2.0], [1.0, 0.0], [3.0, 2.0], [0.0, 1.0]])
    return s, np.full_like(s, 4.0)


def test_a_plan_needs_more_problems_or_pairs_for_a_smaller_excess_and_refuses_one_pair():
    rng = np.random.default_rng(2)
    s = rng.normal(0.05, 0.3, (40, 3)) + rng.normal(0, 0.05, (1, 3))
    _, comp = components(s, np.ones_like(s))
    rows = plan(comp, 5.0, problems=[20, 40, 80, 160], pairs=[2, 3, 5], ci=0.95)
    power = {(r["problems"], r["pairs"]): r["power"] for r in rows}
    assert power[(160, 5)] > power[(40, 5)] > power[(20, 5)]
    assert power[(80, 5)] > power[(80, 2)]
    big = plan(comp, 20.0, problems=[40], pairs=[3], ci=0.95)[0]
    assert big["power"] > plan(comp, 5.0, problems=[40], pairs=[3], ci=0.95)[0]["power"]
    assert all(math.isfinite(r["df"]) for r in rows)
    with pytest.raises(ValueError, match="one pair"):
        plan(comp, 5.0, problems=[40], pairs=[1], ci=0.95)


# -------------------------------------------------------------------------------------- passes and config


def test_draws_are_passes_of_their_own_and_refeed_replica_is_the_re_feeds_second():
    assert [draw_name("refeed", r) for r in (1, 2, 3)] == ["refeed", "refeed_replica", "refeed_r3"]
    assert [draw_name("replica", r) for r in (1, 2, 3)] == ["replica", "replica_r2", "replica_r3"]
    assert pass_spec("refeed_replica").draw == ("refeed", 2) and pass_spec("refeed_r3").draw == ("refeed", 3)
    # each re-feed draw prefills under its own tag (vLLM: its own cache salt), each draw in its own schedule
    tags = {pass_spec(draw_name("refeed", r)).source.label for r in (1, 2, 3, 4)}
    assert len(tags) == 4
    with pytest.raises(ValueError, match="refeed_replica"):
        pass_spec("refeed_r2")
    passes = run_passes({"passes": ["exact", "replica", "refeed", "selector"], "replicates": 3})
    assert passes == [
        "exact",
        "replica",
        "replica_r2",
        "replica_r3",
        "refeed",
        "refeed_replica",
        "refeed_r3",
        "selector",
    ]
    assert replicate_pairs(passes) == [
        ("replica", "refeed"),
        ("replica_r2", "refeed_replica"),
        ("replica_r3", "refeed_r3"),
    ]
    # a run of the paper's two named controls has one replica: no pair beyond the first
    assert replicate_pairs(run_passes({"passes": ["exact", "replica", "refeed", "refeed_replica"]})) == [
        ("replica", "refeed")
    ]


def test_one_replicate_written_out_is_the_default_and_keeps_the_fingerprint():
    base = {**TINY, "configs": {"tiny": {**TINY["configs"]["tiny"], "model": "smollm2-135m"}}}
    plain = validate_config(base)
    written = validate_config({**base, "replay": {**base["replay"], "replicates": 1}})
    three = validate_config({**base, "replay": {**base["replay"], "replicates": 3}})
    assert written == plain and analysis_hash(written) == analysis_hash(plain)
    assert analysis_hash(three) != analysis_hash(plain)


def test_one_draw_leaves_the_comparison_as_it_was_and_three_add_the_replicated_blocks():
    credit = coverage.simulate_credit(np.random.default_rng(4), pass_sd=0.3, **coverage.DESIGN)
    one = compare_passes({p: credit[p] for p in ("exact", "replica", "refeed")}, SETTINGS)
    assert "replicates" not in one
    assert all("replicated" not in block for block in one["conditionings"].values())
    three = compare_passes(credit, SETTINGS)
    assert three["replicates"]["n_pairs"] == 3
    main = three["conditionings"]["main"]
    assert main["replicated"]["draws"][0] == ["replica", "refeed"]
    # the first pair's statistics are the run's first draws', as with one draw
    assert main["excess_pp"] == one["conditionings"]["main"]["excess_pp"]
    first = main["replicated"]["by_metric"]["sign"]["pairs"][0]
    assert first["estimate"] == pytest.approx(one["conditionings"]["main"]["excess_pp"]["estimate"])
    # the treatment-independent set does not depend on the pair: every pair has the same n
    ti = three["conditionings"]["treatment_independent"]["replicated"]
    assert len(set(ti["n_per_pair"])) == 1


def test_adding_replicates_to_a_finished_run_runs_the_new_draws_and_no_other_pass(tiny_run):
    config = {**TINY, "replay": {**TINY["replay"], "replicates": 2}}
    rules = planned_rules(tiny_run, config)
    assert {"replay_replica_r2", "replay_refeed_replica", "compare_passes"} <= rules, rules
    assert not rules & {"generate_rollouts", "select_pivots", *(f"replay_{p}" for p in TINY["replay"]["passes"])}
