"""The benchmarks read what the library logs: the two must agree on the lines' form, or a GPU lease measures
nothing. And the roofline arithmetic of benchmarks/scale.py, checked against a published parameter count, and the
test-suite timeline of benchmarks/suite_times.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from helpers import REPO

from replaynoise.progress import Phases, TokenProgress

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import mutants  # noqa: E402
import pipeline  # noqa: E402
import scale  # noqa: E402
import suite_times  # noqa: E402


def test_the_benchmark_reads_the_loop_lines_the_library_writes(tmp_path, capsys):
    phases = Phases()
    with phases("decode"):
        pass
    phases.seconds = {"compile and capture": 1.25, "decode": 12.5}
    phases.count("decode", 400)
    phases.count("decode", 112)
    bar = TokenProgress(1024, "exact q7b")
    bar.rows(1024, 409600)
    bar.close(phases)
    print(
        "engine start-up by phase: process before the engine 3.10 s, imports 2.00 s, weights check 0.01 s, "
        "model load 6.50 s, engine build 0.20 s",
        file=sys.stderr,
    )
    log = tmp_path / "job.log"
    log.write_text(capsys.readouterr().err)
    assert pipeline.phases(log) == {"compile and capture": 1.25, "decode": 12.5}
    assert pipeline.steps(log) == {"decode": 512}
    assert pipeline.phases(log, "engine start-up by phase: ") == {
        "process before the engine": 3.1,
        "imports": 2.0,
        "weights check": 0.01,
        "model load": 6.5,
        "engine build": 0.2,
    }
    assert pipeline.loop_seconds(log) is not None


def test_the_7b_shape_has_the_published_parameter_count():
    costs = scale.model_costs({**scale.SHAPES["qwen2.5-7b"], "vocab_size": scale.VOCAB})
    # Qwen2.5-7B: 7.61 B parameters (its model card), 6.53 B without the embeddings; our count leaves out the
    # attention biases (0.2 M)
    assert costs["params"] == pytest.approx(7.61e9, rel=2e-3)
    assert costs["linear_params"] - 3584 * scale.VOCAB == pytest.approx(6.53e9, rel=2e-3)
    # 57 KB of bf16 KV per token of context (28 layers x 4 KV heads x 128 x 2 x 2 bytes)
    assert costs["kv_bytes_per_token"] == 57344


def test_the_roofline_fractions_follow_from_the_logged_decode(tmp_path):
    costs = scale.model_costs({**scale.SHAPES["qwen2.5-7b"], "vocab_size": scale.VOCAB})
    (tmp_path / "results" / "pivots").mkdir(parents=True)
    pl.DataFrame({"prefix_len": [99, 99]}).write_parquet(tmp_path / "results" / "pivots" / "c.parquet")
    config = {"configs": {"c": {"engine": "hf"}}, "replay": {"batch_size": 1024}, "rollouts": {"batch_size": 64}}
    row = {
        "rule": "replay_exact",
        "config": "c",
        "rows": 2048,
        "generated_tokens": 2048 * 400,
        "phases": {"decode": 40.0},
        "steps": {"decode": 800},
        "loop_tokens_per_s": 2048 * 400 / 41,
    }
    got = scale.roofline(tmp_path, row, config, costs)
    assert got["mean_context"] == 300 and got["rows_per_step"] == 1024
    assert got["decode_ms_per_step"] == pytest.approx(50.0)
    flop = costs["flop_per_token"] + costs["attention_flop_per_context_token"] * 300
    assert got["compute_fraction"] == pytest.approx(2048 * 400 / 40 * flop / scale.PEAK_FLOPS)
    floor = (costs["weight_bytes"] + 1024 * 300 * costs["kv_bytes_per_token"]) / scale.PEAK_BYTES
    assert got["memory_fraction"] == pytest.approx(floor / 0.05)
    row.update(roofline=got, tokens_per_s=2048 * 400 / 50, fixed_cost={"seconds": 9.0})
    shown = scale.table([row], "NVIDIA H100 80GB HBM3").splitlines()
    fractions = f"{got['compute_fraction']:.0%} | {got['memory_fraction']:.0%}"
    assert shown[2] == f"| replay_exact | c | 2048 | 19,980 | 16,384 | 50.0 (1024) | {fractions} | 9.0 |"
    assert shown[-1] == (
        "compute, memory: fractions of the H200's measured peaks (790 TFLOP/s, 4.8 TB/s) whatever the card; this "
        "run's card: NVIDIA H100 80GB HBM3"
    )


def test_the_paper_design_is_projected_per_configuration_and_static_rows_caps_a_step(tmp_path):
    """Two configurations of one engine (HF with and without static_rows) are two projections, not one pooled
    rate; a refilled HF decoder's step advances static_rows rows, not the batch."""

    def job(config, rule, tokens, loop, seconds):
        return {
            "config": config,
            "rule": rule,
            "generated_tokens": tokens,
            "loop_seconds": loop,
            "loop_tokens_per_s": tokens / loop,
            "seconds": seconds,
        }

    rows = [
        job("hf", "generate_rollouts", 1000, 1.0, 11.0),
        job("hf", "replay_exact", 4000, 2.0, 12.0),
        job("hf-r256", "generate_rollouts", 1000, 1.0, 11.0),
        job("hf-r256", "replay_exact", 4000, 1.0, 11.0),
    ]
    got = scale.projection(
        rows, {"hf": "hf", "hf-r256": "hf"}, pivots=10, per_rollout=5, k=1, trunk=100, continuation=100, passes=1
    )["configs"]
    assert set(got) == {"hf", "hf-r256"} and got["hf"]["engine"] == "hf"
    assert got["hf"]["pass_tokens_per_s"] == 2000 and got["hf-r256"]["pass_tokens_per_s"] == 4000
    # 2 rollouts x 100 tokens at 1,000 tok/s + 10 s fixed, then 10 pivots x 2 branches x 100 tokens + 10 s fixed
    assert got["hf"]["gpu_minutes"] == pytest.approx((0.2 + 10 + 2000 / 2000 + 10) / 60)
    assert got["hf-r256"]["gpu_minutes"] == pytest.approx((0.2 + 10 + 2000 / 4000 + 10) / 60)
    batch = 1024
    assert scale.step_rows({}, {"engine": "hf"}, batch) == 1024
    assert scale.step_rows({}, {"engine": "hf", "static_rows": 256}, batch) == 256
    assert scale.step_rows({}, {"engine": "vllm", "vllm": {"max_num_seqs": 256}}, batch) == 256


def test_the_suite_timeline_pairs_each_test_s_start_and_end_per_worker(tmp_path, monkeypatch):
    monkeypatch.setenv(suite_times.RECORD_DIR, str(tmp_path))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    suite_times.pytest_runtest_logstart("t.py::short", None)
    suite_times.pytest_runtest_logfinish("t.py::short", None)
    written = [line.split("\t")[1:] for line in (tmp_path / "gw1.tsv").read_text().splitlines()]
    assert written == [["start", "t.py::short"], ["end", "t.py::short"]]
    (tmp_path / "gw1.tsv").write_text(
        "101.0\tstart\tt.py::short\n102.0\tend\tt.py::short\n102.0\tstart\tt.py::middling\n110.0\tend\tt.py::middling\n"
    )
    (tmp_path / "gw0.tsv").write_text("100.0\tstart\tt.py::long\n130.5\tend\tt.py::long\n")
    (tmp_path / "main.tsv").write_text("100.1\tstart\tt.py::long\n131.0\tend\tt.py::long\n")  # the controller's
    finished, long_tests = suite_times._timeline(tmp_path, started=90.0)
    assert finished == {"gw0": 40.5, "gw1": 20.0}
    assert long_tests == [
        {"test": "t.py::long", "worker": "gw0", "start_s": 10.0, "end_s": 40.5, "seconds": 30.5},
        {"test": "t.py::middling", "worker": "gw1", "start_s": 12.0, "end_s": 20.0, "seconds": 8.0},
    ]
    serial = tmp_path / "serial"  # without -n: the one process's record
    serial.mkdir()
    (serial / "main.tsv").write_text("100.0\tstart\tt.py::long\n106.0\tend\tt.py::long\n")
    assert suite_times._timeline(serial, started=100.0) == (
        {"main": 6.0},
        [{"test": "t.py::long", "worker": "main", "start_s": 0.0, "end_s": 6.0, "seconds": 6.0}],
    )
    record = {
        "commit": "abc",
        "dirty": False,
        "command": ["python", "-m", "pytest"],
        "cpu_count": 2,
        "wall_s": 41.0,
        "summary": "2 passed",
    }
    assert suite_times.durations_record(record, long_tests) == {
        "measured": {
            "commit": "abc",
            "dirty": False,
            "command": ["python", "-m", "pytest"],
            "cpu_count": 2,
            "wall_s": 41.0,
        },
        "seconds": {"t.py::long": 30.5, "t.py::middling": 8.0},
    }


def test_every_mutant_breaks_text_the_tree_holds_once_and_names_tests_that_exist():
    """A mutant whose text is gone (a reformat, a rename) would run its tests on the unbroken code and pass."""
    root = Path(__file__).resolve().parents[1]
    for name, _, file, text, broken, tests in mutants.MUTANTS:
        assert (root / file).read_text().count(text) == 1, f"{name}: its text is not once in {file}"
        assert broken != text, name
        for test in tests:
            path, func = test.split("::")
            assert f"def {func}(" in (root / path).read_text(), f"{name}: no {test}"


def test_the_report_reads_an_overlay_with_its_base(tmp_path):
    """benchmarks/configs/rollouts-7b-4batches.yaml is an overlay: the report validated it alone and failed on the
    lent machine ('configs' is a required property); it must read it merged over its base, as the run did."""
    model = tmp_path / "run" / "shapes" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    base = REPO / "benchmarks" / "configs" / "rollouts-7b.yaml"
    (tmp_path / "base.yaml").write_text(base.read_text().replace("shapes/qwen2.5-7b", "shapes/m"))
    (tmp_path / "overlay.yaml").write_text("overlay_of: base.yaml\ndataset: {n_problems: 32}\n")
    record = scale.report(tmp_path / "run", [tmp_path / "overlay.yaml"], None)
    assert record["rows"] == [] and set(record["vllm_settings"]) == {"q7b-vllm"}


def test_the_report_reads_several_configuration_files_run_on_one_folder(tmp_path, capsys):
    """The lent machine's driver runs one configuration file per engine environment on one folder (HF's
    configs/attention-7b.yaml, then vLLM's configs/scale-7b.yaml): the report failed on the first file's rows when
    given the second (KeyError); it takes both, and leaves out, by name, a configuration neither names."""
    model = tmp_path / "run" / "shapes" / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({**scale.SHAPES["qwen2-tiny"], "vocab_size": 151936}))
    (model / "model.safetensors").write_bytes(b"")
    (model / "tokenizer.json").write_text("{}")
    base = (REPO / "benchmarks" / "configs" / "rollouts-7b.yaml").read_text().replace("shapes/qwen2.5-7b", "shapes/m")
    (tmp_path / "hf.yaml").write_text(base)
    config = yaml.safe_load(base)
    config["configs"] = {"q7b-other": {**config["configs"]["q7b-hf"], "top_p": 0.9}}
    (tmp_path / "other.yaml").write_text(yaml.safe_dump(config))
    results = tmp_path / "run" / "results"
    for name in ("q7b-hf", "q7b-other", "q7b-neither"):  # a finished rollout job of each
        (results / "benchmarks" / "generate_rollouts").mkdir(parents=True, exist_ok=True)
        (results / "benchmarks" / "generate_rollouts" / f"{name}.000.tsv").write_text("s\n2.0\n")
        (results / "rollouts" / name / "shards").mkdir(parents=True)
        pl.DataFrame({"prompt_ids": [[1, 2]], "response_ids": [[3, 4, 5]]}).write_parquet(
            results / "rollouts" / name / "shards" / "000.parquet"
        )
    (results / "logs" / "generate_rollouts").mkdir(parents=True)
    record = scale.report(tmp_path / "run", [tmp_path / "hf.yaml", tmp_path / "other.yaml"], None)
    assert sorted(r["config"] for r in record["rows"]) == ["q7b-hf", "q7b-other"]
    assert "left out: the folder's configurations ['q7b-neither']" in capsys.readouterr().err
    config["configs"] = {"q7b-hf": {**config["configs"]["q7b-other"]}}  # the same name, other settings
    (tmp_path / "clash.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit, match="configuration 'q7b-hf' differs between"):
        scale.report(tmp_path / "run", [tmp_path / "hf.yaml", tmp_path / "clash.yaml"], None)
