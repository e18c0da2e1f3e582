"""A design that stops when it knows: the spent-alpha boundary, where the rule stops on runs whose answer is clear or
hopeless, its replay over a run folder's credit tables, its plan, and its configuration key."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import REPO

from replaynoise.analysis.replicated import Components, crossed_interval
from replaynoise.analysis.stopping import StopRule, look_alphas, plan_stop, replay, spent, verdict
from replaynoise.config import analysis_hash, validate_config
from replaynoise.generation.passes import draw_name
from replaynoise.power import main as power_main
from replaynoise.savings import pass_seconds, saving
from replaynoise.settings import ConfigError

sys.path.insert(0, str(REPO / "benchmarks"))
import coverage  # noqa: E402

RESOLVED = StopRule("resolved", max_pairs=5, min_pairs=2, half_width_pp=3.0)


def cells(rng: np.random.Generator, excess: float, pairs: int = 5, g: int = 40, pass_sd: float = 0.0) -> tuple:
    """(S, N) of a run whose every pivot's excess is ``excess`` plus its problem's (SD 0.05), its pass draw's
    (``pass_sd``) and its own noise: 10 pivots per cell. The problems' spread dominates, as in the ladder's runs, so
    two pairs give the interval about G - 1 degrees of freedom."""
    n = np.full((g, pairs), 10.0)
    own, shift = rng.normal(0.0, 0.05, g), rng.normal(0.0, pass_sd, pairs)
    s = n * (excess + own[:, None] + shift[None, :]) + rng.normal(0.0, 1.0, (g, pairs)) * np.sqrt(n) * 0.1
    return s, n


# ------------------------------------------------------------------------------------------- the boundary


@pytest.mark.parametrize("rule", [RESOLVED, StopRule("bounded", 3, 2, 1.0), StopRule("resolved", 8, 3, 3.0)])
def test_the_boundary_is_monotone_and_spends_alpha_and_no_more(rule):
    cumulative = spent(rule, 0.05)
    assert all(b > a for a, b in zip(cumulative, cumulative[1:]))
    assert cumulative[-1] == pytest.approx(0.05)
    shares = look_alphas(rule, 0.05)
    assert len(shares) == len(rule.looks()) and all(x > 0 for x in shares)
    assert sum(shares) == pytest.approx(0.05) and sum(shares) <= 0.05 + 1e-15
    # linear spending: the first look has min_pairs pairs' worth, every later look one pair's
    assert shares[0] == pytest.approx(0.05 * rule.min_pairs / rule.max_pairs)
    assert shares[1:] == pytest.approx([0.05 / rule.max_pairs] * (len(shares) - 1))


def test_each_corrected_look_holds_the_naive_one():
    s, n = cells(np.random.default_rng(1), 0.01, pass_sd=0.02)
    corrected = replay(s, n, StopRule("bounded", 5, 2, 1e-6), 0.95)["looks"]
    naive = replay(s, n, StopRule("bounded", 5, 2, 1e-6), 0.95, corrected=False)["looks"]
    assert [x["pairs"] for x in corrected] == [x["pairs"] for x in naive] == [2, 3, 4, 5]
    for c, v in zip(corrected, naive):
        assert c["level"] > v["level"] == 0.95
        assert c["ci_lo"] < v["ci_lo"] and c["ci_hi"] > v["ci_hi"]
        assert c["estimate"] == v["estimate"]


@pytest.mark.parametrize(
    "given",
    [("sometimes", 5, 2, 3.0), ("resolved", 5, 1, 3.0), ("resolved", 2, 3, 3.0), ("bounded", 40, 2, 3.0)]
    + [("bounded", 5, 2, 0.0), ("bounded", 5, 2, float("nan"))],
)
def test_a_rule_that_cannot_be_run_is_refused(given):
    with pytest.raises(ValueError):
        StopRule(*given)


# ------------------------------------------------------------------------------------------- where it stops


def test_a_run_whose_every_pair_shows_a_large_excess_stops_at_min_pairs():
    s, n = cells(np.random.default_rng(2), 0.15)
    out = replay(s, n, RESOLVED, 0.95)
    assert out["stopped_at"] == 2 and out["reason"] == "resolved" and out["verdict"] == "+"
    assert len(out["looks"]) == 1 and out["level"] == pytest.approx(1 - 0.05 * 2 / 5)
    # the stopped interval is the corrected crossed interval over the first two pairs
    own = crossed_interval(s[:, :2], n[:, :2], 1 - 0.05 * 2 / 5, 100.0)
    assert (out["ci_lo"], out["ci_hi"]) == pytest.approx((own["ci_lo"], own["ci_hi"]))
    negative = replay(-s, n, RESOLVED, 0.95)
    assert negative["stopped_at"] == 2 and negative["verdict"] == "-"


def test_a_null_run_goes_to_max_pairs():
    s, n = cells(np.random.default_rng(3), 0.0)
    s -= n * (s.sum() / n.sum())  # an estimate of exactly zero: no look can exclude it
    out = replay(s, n, RESOLVED, 0.95)
    assert out["stopped_at"] == 5 and out["reason"] == "max_pairs" and out["verdict"] == "0"
    assert [x["pairs"] for x in out["looks"]] == [2, 3, 4, 5]
    assert out["level"] == pytest.approx(1 - 0.05 / 5)


def test_a_bounded_run_stops_at_the_first_look_narrow_enough():
    s, n = cells(np.random.default_rng(4), 0.0, g=200)
    looks = replay(s, n, StopRule("bounded", 5, 2, 1e-6), 0.95)["looks"]
    widths = [x["half_width_pp"] for x in looks]
    bound = widths[1]  # the look at three pairs is narrow enough, and perhaps the one at two
    first = next(i for i, w in enumerate(widths) if w <= bound)
    out = replay(s, n, StopRule("bounded", 5, 2, bound), 0.95)
    assert out["stopped_at"] == looks[first]["pairs"] and out["reason"] == "bounded"
    assert replay(s, n, StopRule("bounded", 5, 2, 1e-6), 0.95)["reason"] == "max_pairs"


def test_a_run_of_fewer_pairs_than_the_rule_ends_at_its_last():
    s, n = cells(np.random.default_rng(5), 0.0, pairs=3)
    s -= n * (s.sum() / n.sum())
    out = replay(s, n, RESOLVED, 0.95)
    assert out["stopped_at"] == 3 and out["reason"] == "pairs run out"
    with pytest.raises(ValueError, match="first look is at 2"):
        replay(s[:, :1], n[:, :1], RESOLVED, 0.95)


def test_a_look_leaves_out_problems_without_a_pivot_in_its_pairs():
    s, n = cells(np.random.default_rng(6), 0.15, pairs=3)
    s[:5, :2], n[:5, :2] = 0.0, 0.0  # five problems have pivots only in the third pair
    out = replay(s, n, StopRule("resolved", 3, 2, 3.0), 0.95)
    own = crossed_interval(s[5:, :2], n[5:, :2], 1 - 0.05 * 2 / 3, 100.0)
    assert out["stopped_at"] == 2 and out["ci_lo"] == pytest.approx(own["ci_lo"])


def test_verdicts():
    assert [verdict({"ci_lo": a, "ci_hi": b}) for a, b in ((1, 2), (-2, -1), (-1, 1), (None, 1))] == list("+-0?")


# ------------------------------------------------------------------------------------------- a run folder


def _run_folder(root: Path, swap: float, timings: str) -> Path:
    """A run folder of one configuration with three pairs of draws (the pass study's simulation), its comparison's
    parameters and its passes' seconds (each pass 60 s times its draw: pair r costs 2 r minutes)."""
    frames = coverage.simulate_credit(
        np.random.default_rng(7), pass_sd=0.0, swap=swap, swap_rng=np.random.default_rng(8), **coverage.DESIGN
    )
    config = "cfg"
    (root / "credit" / config).mkdir(parents=True)
    for name, frame in frames.items():
        frame.write_parquet(root / "credit" / config / f"{name}.parquet")
    (root / "analysis" / config).mkdir(parents=True)
    (root / "analysis" / config / "comparison.json").write_text(json.dumps({"parameters": {"ci": 0.95}}))
    draws = {draw_name(base, r): 60.0 * r for base in ("replica", "refeed") for r in (1, 2, 3)}
    if timings == "pipeline":
        rows = [{"rule": f"replay_{p}", "config": config, "seconds": s} for p, s in draws.items()]
        (root / "h200-pipeline.json").write_text(json.dumps({"rows": rows}))
    elif timings == "tsv":
        for p, s in draws.items():
            (root / "benchmarks" / f"replay_{p}").mkdir(parents=True)
            for shard in ("000", "001"):
                (root / "benchmarks" / f"replay_{p}" / f"{config}.{shard}.tsv").write_text(f"s\th:m:s\n{s / 2}\t0\n")
    return root


@pytest.mark.parametrize("timings", ["pipeline", "tsv", "none"])
def test_the_replay_of_a_run_whose_refeed_flips_every_pivot_stops_at_its_second_pair(tmp_path, timings):
    folder = _run_folder(tmp_path, swap=1.0, timings=timings)
    row = saving(folder, "cfg", {"when": "resolved", "min_pairs": 2, "half_width_pp": 3.0})
    assert row["pairs"] == 3 and row["stop"]["stopped_at"] == 2 and row["pairs_saved"] == 1
    assert row["rule"]["max_pairs"] == 3 and row["full"]["verdict"] == "+" and row["same_verdict"]
    if timings == "none":
        assert row["gpu_minutes_saved"] is None and pass_seconds(folder, "cfg", "replica_r3") is None
    else:
        assert row["pair_gpu_minutes"] == pytest.approx([2.0, 4.0, 6.0])
        assert row["gpu_minutes_saved"] == pytest.approx(6.0)


def test_the_replay_of_a_null_run_saves_nothing_and_keeps_its_verdict(tmp_path):
    folder = _run_folder(tmp_path, swap=0.0, timings="pipeline")
    row = saving(folder, "cfg", {"when": "resolved", "min_pairs": 2, "half_width_pp": 3.0})
    assert row["stop"]["stopped_at"] == 3 and row["pairs_saved"] == 0 and row["gpu_minutes_saved"] == 0.0
    assert row["full"]["verdict"] == row["stop"]["verdict"] == "0"


def test_the_savings_command_replays_a_committed_reference(tmp_path, capsys):
    out = tmp_path / "savings.json"
    assert power_main(["stopping", str(REPO / "reference/gpu-vllm/ladder/qwen-0.5b"), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # the ladder's 0.5B rung: pairs of +13.2 to +14.1 pp, resolved at its second pair (reference's comparison.json)
    assert row["stop"]["stopped_at"] == 2 and row["pairs_saved"] == 1 and row["same_verdict"]
    assert row["gpu_minutes_saved"] > 0 and "| 2 | resolved |" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- the plan

PILOT = Components(
    problem=0.03**2, pass_level=0.01**2, residual=0.08**2, n_problems=44, n_pairs=3, mean_squares=(0, 0, 0)
)


def test_the_plan_stops_early_on_a_large_excess_and_runs_on_without_one():
    large, null = (plan_stop(PILOT, d, RESOLVED, problems=[40], ci=0.95, sims=4000)[0] for d in (20.0, 0.0))
    assert large["expected_pairs"] == pytest.approx(2.0, abs=0.05) and large["power"] > 0.99
    assert null["expected_pairs"] > 4.9 and null["power"] <= 0.05
    assert sum(null["stop_share"].values()) == pytest.approx(1.0)
    again = plan_stop(PILOT, 0.0, RESOLVED, problems=[40], ci=0.95, sims=4000)[0]
    assert again == null  # seeded


def test_the_plan_pays_for_its_looks_in_power_at_a_middling_excess():
    (row,) = plan_stop(PILOT, 3.0, RESOLVED, problems=[80], ci=0.95, sims=4000)
    assert row["power"] < row["fixed_power"] and row["expected_pairs"] < 5


def test_the_power_command_plans_a_stopping_design(capsys):
    folder = REPO / "reference/gpu-vllm/ladder"
    argv = [str(folder / "qwen-1.5b"), "--excess", "5", "--stop", "resolved", "--max-pairs", "5"]
    assert power_main(argv) == 0
    text = capsys.readouterr().out
    assert "stop when resolved, pairs 2 to 5" in text and "expected pairs" in text
    assert power_main([*argv[:3], "--stop", "resolved", "--max-pairs", "1"]) == 2


# ------------------------------------------------------------------------------------------- the key

LADDER = "gpu-vllm/ladder/qwen-1.5b"


def _campaign() -> dict:
    provenance = json.loads((REPO / "reference" / LADDER / "provenance.json").read_text())
    return copy.deepcopy(provenance["config"])


def test_a_config_without_the_key_keeps_its_committed_analysis_hash():
    provenance = json.loads((REPO / "reference" / LADDER / "provenance.json").read_text())
    config = validate_config(_campaign())
    assert "stop" not in config["replay"]
    assert analysis_hash(config) == provenance["analysis_hash"]


def test_the_key_validates_fills_its_defaults_and_moves_no_fingerprint():
    given = _campaign()
    given["replay"]["stop"] = {"when": "resolved", "max_pairs": given["replay"]["replicates"]}
    config = validate_config(given)
    assert config["replay"]["stop"] == {"when": "resolved", "max_pairs": 3, "min_pairs": 2, "half_width_pp": 3.0}
    assert StopRule.from_config(config["replay"]["stop"]) == StopRule("resolved", 3, 2, 3.0)
    # no pass or table reads it (every pair is made): a change of it must rerun none of them
    assert analysis_hash(config) == analysis_hash(validate_config(_campaign()))


@pytest.mark.parametrize(
    ("stop", "said"),
    [
        ({"when": "soon", "max_pairs": 3}, "replay.stop.when"),
        ({"max_pairs": 3}, "'when' is a required property"),
        ({"when": "resolved", "max_pairs": 3, "min_pairs": 1}, "replay.stop.min_pairs"),
        ({"when": "resolved", "max_pairs": 3, "min_pairs": 3, "half_width_pp": 0}, "replay.stop.half_width_pp"),
        ({"when": "resolved", "max_pairs": 3, "tries": 3}, "replay.stop"),
        ({"when": "resolved", "max_pairs": 2, "min_pairs": 3}, "more than max_pairs"),
        ({"when": "resolved", "max_pairs": 5}, "set replicates to max_pairs"),
    ],
)
def test_a_bad_stop_key_fails_by_name(stop, said):
    given = _campaign()
    given["replay"]["stop"] = stop
    with pytest.raises(ConfigError, match=said.replace(".", r"\.").replace("(", r"\(")):
        validate_config(given)


def test_the_schema_documents_the_key_as_absent_by_default():
    schema = yaml.safe_load((REPO / "config" / "schema.yaml").read_text())
    stop = schema["properties"]["replay"]["properties"]["stop"]
    assert "default" not in stop and "x-absent-default" in stop
