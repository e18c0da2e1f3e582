"""Runs of one campaign combined: the interval over problems, pass draws and runs (analysis.runs), the committed
combination of the two SGLang 1.5B runs, and the planning of runs (python -m replaynoise.power --runs)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

from replaynoise.analysis.runs import RunCells, combined_interval, plan_runs
from replaynoise.io import read_json
from replaynoise.power import main as power_main
from replaynoise.power import pilot_components
from replaynoise.reference import main

ROOT = Path(__file__).resolve().parents[1]
SGLANG = ROOT / "reference" / "gpu-sglang"


def _run(rng: np.random.Generator, problems: list[str], pairs: int, shift: float) -> RunCells:
    s = 0.1 + shift + rng.normal(0.0, 0.05, (len(problems), pairs))
    return RunCells(problems=np.array(problems), s=s, n=np.ones_like(s), pairs=tuple(("r", "f") for _ in range(pairs)))


def test_the_combined_estimate_is_the_mean_of_the_runs_and_its_run_sd_their_spread():
    """Runs of 3, 1 and 2 pairs, one lacking a problem: the estimate is the runs' mean, each run keeps its own
    estimate, and a large run-level shift is found (F test rejects) and widens the interval past a single run's."""
    rng = np.random.default_rng(1)
    names = [f"q{i:02d}" for i in range(30)]
    shifts = [0.0, 0.2, -0.15]
    runs = [_run(rng, names, 3, shifts[0]), _run(rng, names[1:], 1, shifts[1]), _run(rng, names, 2, shifts[2])]
    out = combined_interval(runs, 0.95)
    own = [100 * r.s.sum() / r.n.sum() for r in runs]
    assert [r["estimate"] for r in out["runs"]] == pytest.approx(own)
    assert out["estimate"] == pytest.approx(np.mean(own))
    assert out["n_problems"] == 30 and out["shared_problems"] == 29
    parts = out["components"]
    assert parts["run_sd"] == pytest.approx(100 * np.std(shifts, ddof=1), rel=0.15)
    assert parts["run_test"]["p"] < 0.001 and parts["run_sd_ci_lo"] > 0
    assert out["runs"][1]["crossed"]["ci_lo"] is None  # one pair: no crossed interval of its own
    assert out["ci_hi"] - out["ci_lo"] > out["runs"][0]["crossed"]["ci_hi"] - out["runs"][0]["crossed"]["ci_lo"]


def test_runs_that_agree_give_no_lower_end_to_the_run_sd():
    rng = np.random.default_rng(2)
    names = [f"q{i}" for i in range(40)]
    out = combined_interval([_run(rng, names, 3, 0.0), _run(rng, names, 3, 0.0)], 0.95)
    assert out["components"]["run_test"]["p"] > 0.05 and out["components"]["run_sd_ci_lo"] is None
    assert out["ci_lo"] < 10 < out["ci_hi"]
    with pytest.raises(ValueError, match="two runs or more"):
        combined_interval([_run(rng, names, 3, 0.0)], 0.95)


def test_the_committed_combination_of_the_sglang_runs_is_what_its_command_writes(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    name = "combined-qwen2.5-coder-1.5b-sglang"
    committed = read_json(SGLANG / f"{name}.json")
    folders = committed["folders"]
    assert main(["combine", *folders, "--out", str(tmp_path)]) == 0
    written_md = (tmp_path / f"{name}.md").read_text().replace(str(tmp_path), "reference/gpu-sglang")
    assert written_md == (SGLANG / f"{name}.md").read_text()
    written = read_json(tmp_path / f"{name}.json")
    assert {k: v for k, v in written.items() if k != "command"} == {
        k: v for k, v in committed.items() if k != "command"
    }
    main_block = written["conditionings"]["main"]
    assert [r["n_pairs"] for r in main_block["runs"]] == [3, 1]
    assert [round(r["estimate"], 1) for r in main_block["runs"]] == [26.0, 11.9]  # each run's own headline


def test_runs_are_planned_and_more_runs_help_where_runs_differ(capsys):
    folder = ROOT / "reference" / "gpu-vllm" / "ladder" / "qwen-1.5b"
    comparison = read_json(folder / "analysis" / "qwen2.5-coder-1.5b-vllm" / "comparison.json")
    comp = pilot_components(comparison, "main")
    power = [plan_runs(comp, 5.0, problems=[44], runs=[k], run_sd_pp=2.8, ci=0.95)[0]["power"] for k in (2, 3, 5)]
    assert power[0] < power[1] < power[2]
    assert plan_runs(comp, 5.0, problems=[44], runs=[3], run_sd_pp=0.0, ci=0.95)[0]["power"] > power[1]
    with pytest.raises(ValueError, match="K >= 2"):
        plan_runs(comp, 5.0, problems=[44], runs=[1], run_sd_pp=0.0, ci=0.95)
    assert power_main([str(folder), "--excess", "3", "--runs", "2", "5", "--run-sd", "0", "2.8"]) == 0
    out = capsys.readouterr().out
    assert "0.76 / 0.33 / 0.00 at SD 0.0 / 1.2 / 10.5" in out and "runs of 3 pairs each" in out


def test_a_run_level_shift_escapes_one_run_s_interval_and_not_the_interval_over_runs():
    """benchmarks/coverage.py's run study, small: at a run-level SD of 9.7 pp one run's crossed interval misses the
    mean over runs often, the interval over three runs seldom (benchmarks/results/coverage-runs.json: 0.43, 0.95)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    coverage = importlib.import_module("coverage")
    effect = coverage.swap_effect()
    assert 40 < effect < 80  # swapping every re-feed pivot's branches moves the excess by this many pp
    result = coverage.run_coverage(60, 9.7, effect, seed=5)["coverage"]
    assert result["single_run"] < 0.7 and result["three_runs"] > 0.85, result
