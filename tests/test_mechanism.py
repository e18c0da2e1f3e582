"""The mechanism analysis: where re-fed prefix log-probs and first steps stop equalling the decode-time ones, and
the excess by prefix length, checked against hand-built rows and against the run-wide comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from helpers import TINY, planned_rules, seed_model, snakemake

from replaynoise.analysis.agreement import (
    change_point,
    first_steps,
    length_bins,
    pivot_agreement,
    position_agreement,
    regime_stats,
    token_gaps,
    with_decode_rows,
)
from replaynoise.analysis.comparison import replicated_block
from replaynoise.analysis.conditionings import wide_frame
from replaynoise.analysis.factors import factor_rows
from replaynoise.analysis.mechanism import credit_by_length, main_flips, mechanism_summary
from replaynoise.generation.passes import replay_draws, replicate_pairs
from replaynoise.io import read_json, read_parquet
from replaynoise.regime import folder_mechanism, folder_probe, main, recompute, validation_markdown, validation_rows
from replaynoise.settings import AnalysisSettings


def credit_frames(seed: int = 0, pivots: int = 240, problems: int = 12, pairs: int = 2, k: int = 4) -> dict:
    """Credit tables of exact and ``pairs`` draws of replica and refeed, each pivot with a prefix length; re-feed
    moves long prefixes' outcomes more often than short ones'."""
    rng = np.random.default_rng(seed)
    problem = rng.integers(0, problems, pivots)
    length = rng.integers(90, 400, pivots)
    p = rng.uniform(0.1, 0.9, (pivots, 2))
    exact = rng.random((pivots, 2, k)) < p[:, :, None]
    frames = {"exact": exact}
    for r in range(1, pairs + 1):
        for base, chance in (("replica", np.full(pivots, 0.2)), ("refeed", np.where(length > 230, 0.8, 0.2))):
            name = base if r == 1 else ("refeed_replica" if (base, r) == ("refeed", 2) else f"{base}_r{r}")
            moved = rng.random((pivots, 2, k)) < chance[:, None, None]
            frames[name] = np.where(moved, rng.random((pivots, 2, k)) < p[:, :, None], exact)
    out = {}
    for name, outcome in frames.items():
        orig, sub = outcome[:, 0].sum(axis=1), outcome[:, 1].sum(axis=1)
        out[name] = pl.DataFrame(
            {
                "pivot_id": [f"v{i}" for i in range(pivots)],
                "problem_id": [f"q{j}" for j in problem],
                "margin": np.zeros(pivots),
                "t": length - 90,
                "prefix_len": length,
                "k": np.full(pivots, k),
                "n_orig_correct": orig,
                "n_sub_correct": sub,
                "eligible": np.ones(pivots, dtype=bool),
                "a_hat": (orig - sub) / k,
            }
        )
    return out


SETTINGS = AnalysisSettings(
    theta=0.5, n_boot=200, min_eligible=1, ci=0.95, metric="sign", margin_split=0.3, eligibility="graded", seed=3
)


def test_one_bin_gives_the_run_wide_rates_and_interval():
    credit = credit_frames()
    wide, masks, refeed, floor = main_flips(credit, metric="sign")
    (row,) = credit_by_length(wide, masks, refeed, floor, [0], ci=0.95, n_boot=200, seed=3)
    block = replicated_block(wide_frame(credit), "main", replicate_pairs(sorted(credit)), SETTINGS)
    assert row["main_pivots"] == sum(block["n_per_pair"])
    assert row["refeed"] == pytest.approx(block["refeed"]["estimate"])
    assert row["floor"] == pytest.approx(block["floor"]["estimate"])
    assert row["excess_pp"] == pytest.approx(block["excess_pp"]["estimate"])
    crossed = block["excess_pp"]["crossed"]
    assert (row["excess_lo"], row["excess_hi"], row["interval"]) == pytest.approx(
        (crossed["ci_lo"], crossed["ci_hi"], "crossed")
    )


def test_bins_split_the_pivots_and_find_where_the_excess_is():
    credit = credit_frames(pivots=600)
    summary = mechanism_summary(credit, None, None, metric="sign", ci=0.95, n_boot=200, seed=3)
    rows = summary["by_length"]
    wide, masks, *_ = main_flips(credit, metric="sign")
    assert sum(r["main_pivots"] for r in rows) == masks.sum()
    assert sum(r["pivots"] for r in rows) == 600
    short = [r for r in rows if r["lo"] + 32 <= 230]
    long = [r for r in rows if r["lo"] >= 256]
    assert short and long
    assert max(r["excess_pp"] for r in short) < min(r["excess_pp"] for r in long)


def test_length_bins_merge_the_sparse_ends():
    lengths = [100] * 3 + list(range(128, 256)) + [300, 301]
    edges = length_bins(lengths, width=32, minimum=20)
    assert edges[0] == 96 and edges[-1] == 224  # 3 prefixes merged up, the 2 past 256 merged down
    assert length_bins([], 32, 20) == []


def test_tokens_are_placed_by_the_keys_their_step_attended():
    mismatch = pl.DataFrame(
        {
            "pass": ["refeed", "refeed"],
            "pivot_id": ["a", "b"],
            "t": [4, 2],
            "decode_logprobs": [[-1.0, -2.0, -3.0], []],
            "refeed_logprobs": [[-1.0, -2.5, -3.0], []],
        }
    )
    gaps = token_gaps(mismatch, pl.DataFrame({"pivot_id": ["a", "b"], "prefix_len": [10, 5]}))
    assert gaps["keys"].to_list() == [7, 8, 9]
    assert gaps["step"].to_list() == [1, 2, 3]  # a prompt of 10 - 4 tokens: position 7 is the response's token 1
    assert gaps["pivot_id"].to_list() == ["a"] * 3
    positions = position_agreement(gaps)
    assert positions["equal_share"].to_list() == [1.0, 0.0, 1.0]
    assert positions["token_mult_prob_error"][1] == pytest.approx(np.exp(0.5))


def test_each_token_knows_how_many_sequences_its_decode_step_ran():
    """A batch's rollouts decode together until each ends: at step s, those whose responses are longer than s."""
    decode = pl.DataFrame(
        {
            "problem_id": ["p", "p", "p", "q"],
            "rollout": [0, 1, 2, 0],
            "batch": [0, 0, 0, 1],
            "response_len": [3, 5, 10, 4],
        }
    )
    mismatch = pl.DataFrame({"pivot_id": ["p/r2@9", "q/r0@3"], "problem_id": ["p", "q"], "rollout": [2, 0]})
    gaps = pl.DataFrame({"pivot_id": ["p/r2@9"] * 4 + ["q/r0@3"], "step": [2, 3, 4, 5, 2]})
    assert with_decode_rows(gaps, mismatch, decode)["rows"].to_list() == [3, 2, 2, 1, 1]


def test_change_point_finds_a_kernel_switch():
    keys = np.arange(1, 301)
    share = np.where(keys < 129, 1.0, 0.1)
    point = change_point(keys, np.full(300, 10), share)
    assert point["keys"] == 129
    assert point["share_below"] == pytest.approx(1.0) and point["share_above"] == pytest.approx(0.1)
    assert point["tokens_below"] == 1280
    assert point["spread"] == pytest.approx(0.1 * 0.9 * 1720 / 3000)  # the part above, 172 positions of 10 tokens
    blurred = change_point(keys, np.full(300, 10), np.where(keys < 100, 1.0, np.where(keys < 160, 0.5, 0.1)))
    assert blurred["spread"] > point["spread"]  # the sharper switch has the lower spread
    by_step = change_point(keys, np.full(300, 10), share, name="step")
    assert by_step["step"] == 129 and "keys" not in by_step
    assert change_point(np.array([5]), np.array([1]), np.array([1.0]))["keys"] is None
    flat = change_point(keys, np.full(300, 10), np.where(keys < 129, 1.0, 0.95))
    assert flat["keys"] is None and flat["tokens_below"] == 3000  # no step: nothing to name


def test_first_steps_compare_each_row_with_exact():
    def rows(digests, top1_b_sub):
        return pl.DataFrame(
            {
                "pivot_id": ["a", "a", "b", "b", "a"],
                "problem_id": ["q"] * 5,
                "branch": ["orig", "sub", "orig", "sub", "orig"],
                "k": [0, 0, 0, 0, -1],  # the last a greedy probe row, left out
                "prefix_len": [100, 100, 300, 300, 100],
                "verified": [True] * 5,
                "next_digest": digests,
                "next_topk_ids": [[1, 2]] * 5,
                "next_topk_logprobs": [[-0.5, -1.0], [-0.5, -1.0], [-0.5, -1.0], [top1_b_sub, -1.0], [-0.5, -1.0]],
            }
        )

    steps = first_steps(
        {"exact": rows(["x", "y", "z", "w", "p"], -0.5), "refeed": rows(["x", "y", "z", "changed", "q"], -0.25)}
    )
    assert steps.height == 8 and steps["cached_tokens"].null_count() == 8
    agreement = pivot_agreement(steps)
    assert agreement["pivot_id"].to_list() == ["a", "b"]
    assert agreement["equal"].to_list() == [1.0, 0.5]
    assert agreement["all_equal"].to_list() == [True, False]
    assert agreement["top1_gap"].to_list() == pytest.approx([0.0, 0.125])  # mean of 0 and 0.25
    stats = regime_stats(agreement, None)
    assert stats["first_step"]["refeed"] == {"pivots": 2, "equal": 0.75, "all_equal": 0.5}


def test_the_mechanism_reads_exact_and_the_draws_only():
    assert replay_draws(["exact", "refeed", "replica", "refeed_replica", "replica_r2", "serial"]) == [
        "exact",
        "replica",
        "replica_r2",
        "refeed",
        "refeed_replica",
    ]


@pytest.fixture(scope="module")
def tiny_regime(tiny_prepared, tmp_path_factory):
    """The regime probe of the tiny configuration, run through its Snakemake target."""
    workdir = tmp_path_factory.mktemp("regime")
    seed_model(workdir, tiny_prepared)
    snakemake(workdir, TINY, "regime")
    return workdir


def test_the_regime_probe_runs_through_its_target_and_keeps_its_rows(tiny_regime):
    results = tiny_regime / "results" / "regime" / "tiny"
    summary = read_json(results / "probe.json")
    steps, mismatch = read_parquet(results / "first_steps.parquet"), read_parquet(results / "mismatch.parquet")
    # one rollout batch of the campaign's (rollouts.batch_size 1 over per_problem 1: one problem), one row a branch
    assert summary["size"] == {"problems": 1, "rollouts": 1, "pivots": 16}
    assert summary["problems"] == 1 and summary["rollouts"] == 1
    assert sorted(steps["pass"].unique()) == ["exact", "refeed", "replica"]
    assert (steps.group_by("pass").len()["len"] == 2 * summary["pivots"]).all()
    assert set(steps["k"]) == {0}
    assert summary["first_step"]["refeed"]["pivots"] == summary["pivots"]
    assert mismatch.height == summary["pivots"] and set(mismatch["pass"]) == {"refeed"}
    assert summary["prefix"]["tokens"] == mismatch["decode_logprobs"].list.len().sum()
    assert (
        summary["change_point"]["tokens_below"] + summary["change_point"]["tokens_above"]
        == (summary["prefix"]["tokens"])
    )
    decode = read_parquet(results / "decode.parquet")
    assert decode.select("batch", "rollout").rows() == [(0, 0)] and decode["response_len"][0] > 0
    assert "change_point_by_rows" in summary and "change_point_by_step" in summary
    report = (tiny_regime / "results" / "regime" / "all" / "regime.md").read_text()
    assert "## tiny" in report and "token_mult_prob_error" in report


def test_the_regime_probe_is_no_part_of_a_campaign(tiny_regime):
    assert "regime_probe" not in planned_rules(tiny_regime, TINY)
    assert planned_rules(tiny_regime, TINY, "regime") == set()  # done, and keyed by what made it
    assert planned_rules(tiny_regime, {**TINY, "regime": {"pivots": 4}}, "regime") == {"regime_probe", "regime"}


REPO = Path(__file__).resolve().parents[1]
LEASE = REPO / "benchmarks" / "results" / "regime-2026-12-07"
#: SGLang's probes, one factor at a time, on one H100
SGLANG_LEASE = REPO / "benchmarks" / "results" / "regime-sglang-factors-2026-12-07"
MECHANISM = REPO / "reference" / "mechanism"


def _folders_of(readme: Path) -> tuple[list[str], list[str]]:
    """The folders and the drawn ones of the command a README gives (its lines joined by their backslashes)."""
    lines = readme.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "python -m replaynoise.regime mechanism" in line)
    command = []
    for line in lines[at:]:
        command.append(line.strip().rstrip("\\"))
        if not line.rstrip().endswith("\\"):
            break
    words = " ".join(command).split()
    out, figure = words.index("--out"), words.index("--figure")
    return words[words.index("mechanism") + 1 : out], words[figure + 1 :]


def test_the_committed_mechanism_table_recomputes_from_its_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # labels are the folders as the README's command names them
    folders, drawn = _folders_of(MECHANISM / "README.md")
    assert main(["mechanism", *folders, "--out", str(tmp_path), "--figure", *drawn]) == 0
    fresh, committed = read_json(tmp_path / "mechanism.json"), read_json(MECHANISM / "mechanism.json")
    assert set(fresh) == set(committed) and set(drawn) <= set(folders)
    for label, summary in fresh.items():
        assert summary == committed[label], label
    assert (tmp_path / "mechanism.md").read_text() == (MECHANISM / "mechanism.md").read_text()


PROBES = sorted([*LEASE.glob("*/probe.json"), *SGLANG_LEASE.glob("*/*/probe.json")])


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: str(p.parent.relative_to(p.parents[2])))
def test_each_committed_probe_recomputes_from_its_rows(probe):
    assert recompute(probe.parent) == read_json(probe)


VALIDATED = {
    LEASE: [
        ("qwen-1.5b/probe.json", "reference/gpu-vllm/ladder/qwen-1.5b"),
        ("qwen-0.5b/probe.json", "reference/gpu-vllm/ladder/qwen-0.5b"),
        ("qwen-1.5b-invariant/probe.json", "reference/gpu-vllm/ladder/qwen-invariant"),
    ],
    SGLANG_LEASE: [
        ("alone/base/probe.json", "reference/gpu-sglang/qwen-1.5b-vllm-problems-2026-12-06"),
        ("alone/base/probe.json", "reference/gpu-sglang/qwen-1.5b-vllm-problems"),
    ],
}


@pytest.mark.parametrize("lease", list(VALIDATED), ids=lambda p: p.name)
def test_the_committed_validation_recomputes(lease, monkeypatch):
    monkeypatch.chdir(REPO)  # the committed table names the folders as the README's command gave them
    pairs = [(lease.relative_to(REPO) / probe, Path(campaign)) for probe, campaign in VALIDATED[lease]]
    fresh = validation_rows(pairs)
    committed = read_json(lease / "validation" / "validation.json")
    assert [(r["probe"], r["campaign"]) for r in fresh] == [(r["probe"], r["campaign"]) for r in committed]
    assert (
        validation_markdown(fresh).splitlines()[2:]
        == (lease / "validation" / "validation.md").read_text().splitlines()[2:]
    )


def test_the_probe_commands_refuse_what_they_cannot_read(tmp_path, capsys):
    assert main(["validate", f"{tmp_path}/none.json=reference/gpu-vllm/ladder/qwen-1.5b", "--out", str(tmp_path)]) == 2
    assert "none.json" in capsys.readouterr().err
    folder = str(REPO / "reference/gpu-vllm/ladder/qwen-0.5b")
    assert main(["mechanism", folder, "--out", folder]) == 2  # named, not a traceback
    assert "mechanism would write" in capsys.readouterr().err


def test_the_statistics_do_not_depend_on_the_thread_count():
    """The same bits with one polars thread as with the machine's: the sums run in one fixed order."""
    script = (
        "import json, sys; from pathlib import Path; from replaynoise.regime import recompute, folder_mechanism; "
        "print(json.dumps([recompute(Path(sys.argv[1])), folder_mechanism(Path(sys.argv[2]), sys.argv[3])]))"
    )
    args = [str(LEASE / "qwen-1.5b"), str(REPO / "reference/gpu-vllm/ladder/qwen-0.5b"), "qwen2.5-coder-0.5b-vllm"]
    env = {**os.environ, "POLARS_MAX_THREADS": "1", "PYTHONPATH": str(REPO)}
    single = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, check=True)
    here = [recompute(Path(args[0])), folder_mechanism(Path(args[1]), args[2])]
    assert json.loads(single.stdout) == json.loads(json.dumps(here))


def test_a_factor_is_set_against_the_base_probe_on_the_same_problems():
    """The batch-32 probe against the campaign's own: the same first problems, another decode batch. Its effect on
    the re-fed first step's agreement is read on the same problem resamples as the base's; the base against itself
    replays every row bit for bit and moves nothing."""
    probes = {name: folder_probe(LEASE / name) for name in ("qwen-1.5b", "qwen-1.5b-batch32")}
    base, batch32 = factor_rows({"self": probes["qwen-1.5b"], **probes}, "qwen-1.5b")[1:]
    assert base["base"] and base["against_base"] is None and "effect" not in base["refeed"]
    refeed = batch32["refeed"]
    assert refeed["base_share"] == base["refeed"]["share"]
    assert refeed["effect"] == pytest.approx(refeed["share"] - refeed["base_share"])
    assert refeed["effect_ci_lo"] <= refeed["effect"] <= refeed["effect_ci_hi"] < 0
    assert 0 < batch32["against_base"]["pivots_shared"] < 1 and not batch32["against_base"]["identical"]
    itself = factor_rows({"a": probes["qwen-1.5b"], "b": probes["qwen-1.5b"]}, "a")[1]
    assert itself["against_base"]["identical"] and itself["against_base"]["pivots_shared"] == 1.0
    assert itself["refeed"]["effect"] == itself["refeed"]["effect_ci_lo"] == itself["refeed"]["effect_ci_hi"] == 0.0
    assert {row["share"] for row in itself["against_base"]["rows_bitwise_equal"].values()} == {1.0}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["a=LEASE/qwen-1.5b", "a=LEASE/qwen-0.5b"], "given twice: a"),
        (["a=LEASE/qwen-1.5b", "b=LEASE/qwen-0.5b", "--base", "c"], "--base 'c' names none"),
        (["a=LEASE/none"], "is not NAME=FOLDER"),
        (["LEASE/qwen-1.5b"], "is not NAME=FOLDER"),
    ],
)
def test_the_factor_command_names_what_it_cannot_use(args, message, tmp_path, capsys):
    args = [a.replace("LEASE", str(LEASE)) for a in args]
    if "--base" not in args:
        args += ["--base", "a"]
    assert main(["factors", *args, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "table", [LEASE / "factors-1.5b", LEASE / "factors-0.5b", SGLANG_LEASE / "factors-summary"], ids=lambda p: p.name
)
def test_the_committed_factor_tables_recompute_from_their_probes(table, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the tables name the probe folders as the command was given them
    committed = read_json(table / "factors.json")
    named = [f"{row['probe']}={row['folder']}" for row in committed]
    base = next(row["probe"] for row in committed if row["base"])
    assert main(["factors", *named, "--base", base, "--out", str(tmp_path)]) == 0
    assert read_json(tmp_path / "factors.json") == committed
    assert (tmp_path / "factors.md").read_text() == (table / "factors.md").read_text()
