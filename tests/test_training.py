"""GRPO training as a workflow step (train_grpo): the wiring, the cache, and what reruns it. The model is a tiny
random one trained for three steps, so nothing here is a claim about learning."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from conftest import planned_rules, snakemake, with_setting
from tinymodel import save_tiny_chat_model

from replaynoise.config import ConfigError, validate_config
from replaynoise.io import read_json, read_parquet, sha256_file
from replaynoise.training import train_grpo

pytestmark = pytest.mark.slow  # a workflow run of the whole DAG (about 2 min on 2 cores)

#: Three steps of four prompts, eight two-token answers each: the tiny model's digits are right often enough by
#: chance that a step's group rewards differ, so the weights move.
TRAIN = {"dataset": "simple_addsub", "steps": 3, "prompts_per_step": 4, "generations": 8, "micro_batch": 16,
         "learning_rate": 0.01, "max_completion_length": 2}


def run_config(model: Path) -> dict:
    settings = {"model": str(model), "dtype": "float32", "max_new_tokens": 4}
    return {
        "seed": 5,
        "dataset": {"source": "simple_addsub", "n_problems": 3},
        "prompt": {"style": "chat", "instruction": "Answer."},
        "configs": {"base": settings, "trained": {**settings, "train": TRAIN}},
        "pivots": {"max_margin": 1.0, "per_rollout": 1},
        "replay": {"k": 2, "max_new_tokens": 3, "passes": ["exact", "replica", "refeed"]},
        "analysis": {"n_boot": 20, "min_eligible": 1},
    }


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> tuple[Path, dict, set[str]]:
    """A finished run of the default target, and the rules a dry run planned before it."""
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model")
    workdir = tmp_path_factory.mktemp("trained-run")
    config = run_config(model)
    planned = planned_rules(workdir, config)
    snakemake(workdir, config)
    return workdir, config, planned


def model_dirs(workdir: Path) -> dict[str, Path]:
    """{"base" or "trained": prepared model directory}, told apart by their own record."""
    dirs = [p for p in (workdir / "results" / "models").iterdir() if not p.name.startswith(".")]
    return {read_json(p / "replaynoise-model.json")["origin"]["kind"].replace("local", "base"): p for p in dirs}


def test_the_default_target_trains_then_measures_the_trained_model(trained_run):
    workdir, _, planned = trained_run
    assert {"prepare_model", "train_grpo", "generate_rollouts", "figure_training", "policy_table"} <= planned
    models = model_dirs(workdir)
    assert set(models) == {"base", "trained"}
    assert models["trained"].name.startswith(models["base"].name + "-grpo-")
    info = read_json(models["trained"] / "replaynoise-model.json")
    assert info["origin"]["train"]["steps"] == 3 and info["origin"]["train"]["seed"] == 0  # the documented default
    assert info["origin"]["base"]["origin"]["kind"] == "local"
    # the evaluation's three problems come from the train set's dataset, so they are left out of it
    assert info["origin"]["excluded_questions"] == 3 and info["origin"]["train_problems"] == 500 - 3
    weights = models["trained"] / "model.safetensors"
    assert info["origin"]["weights_sha256"] == {"model.safetensors": sha256_file(weights)}
    assert sha256_file(weights) != sha256_file(Path(info["origin"]["base"]["origin"]["path"]) / "model.safetensors")
    log = pl.read_csv(next((workdir / "results" / "training").glob("*/log.csv")))
    assert log["step"].to_list() == [1, 2, 3]
    assert log["reward"].is_between(0, 1).all() and log["entropy"].is_not_null().all()
    # the trained configuration's rollouts were made by the trained model
    rollouts = read_parquet(workdir / "results" / "rollouts" / "trained" / "rollouts.parquet")
    assert rollouts.height == 3
    policy = pl.read_csv(workdir / "results" / "tables" / "policy.csv")
    assert policy["config"].to_list() == ["base", "trained"]
    assert policy["model"].to_list() == [models["base"].name, models["trained"].name]
    assert (workdir / "results" / "figures" / "training.png").stat().st_size > 0
    manifest = (workdir / "results" / "MANIFEST.sha256").read_text()
    assert f"models/{models['trained'].name}/model.safetensors" in manifest and "training.png" in manifest


def test_a_rerun_does_nothing_and_an_unrelated_change_does_not_retrain(trained_run):
    workdir, config, _ = trained_run
    assert planned_rules(workdir, config) == set()
    changed = planned_rules(workdir, with_setting(config, "replay.k", 3))
    assert changed and not changed & {"prepare_model", "train_grpo", "generate_rollouts"}


def test_a_changed_train_setting_retrains_and_remeasures_only_the_trained_model(trained_run):
    workdir, config, _ = trained_run
    changed = with_setting(config, "configs.trained.train.learning_rate", 0.02)
    assert {"train_grpo", "generate_rollouts"} <= planned_rules(workdir, changed)
    assert "prepare_model" not in planned_rules(workdir, changed)
    plan = snakemake(workdir, changed, "-n").stdout
    remade = {block.split(":", 1)[0] + ":" + block.split("wildcards: ", 1)[1].split("\n", 1)[0]
              for block in plan.split("\nrule ")[1:] if block.startswith("generate_rollouts:")}
    assert remade == {"generate_rollouts:config=trained, shard=000"}, plan[-3000:]


def test_the_same_seed_and_settings_give_the_same_weights(trained_run, tmp_path):
    """The library call with the rule's settings reproduces the workflow's model bit for bit on this CPU."""
    workdir, config, _ = trained_run
    trained = model_dirs(workdir)["trained"]
    origin = read_json(trained / "replaynoise-model.json")["origin"]
    questions = read_parquet(workdir / "results" / "problems" / "simple_addsub.parquet")["question"].to_list()
    again = tmp_path / "again"
    info = train_grpo(model_dirs(workdir)["base"], again, tmp_path / "work", train=origin["train"],
                      prompt=origin["prompt"], stops=[], dtype="float32", device="cpu", threads=2,
                      cache_dir=tmp_path, exclude=questions, log_csv=tmp_path / "log.csv", scratch_key="again")
    assert info["origin"]["weights_sha256"] == origin["weights_sha256"]


def test_a_micro_batch_that_does_not_divide_the_step_is_refused_by_value():
    config = {"configs": {"a": {"model": "smollm2-135m", "train": {**TRAIN, "micro_batch": 5}}}}
    with pytest.raises(ConfigError, match=r"train\.micro_batch: 5 does not divide the 32 completions"):
        validate_config(config)
