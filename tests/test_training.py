"""GRPO training as a workflow step (train_grpo): the wiring, the cache, and what reruns it. The model is a tiny
random one trained for three steps, so nothing here is a claim about learning."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
import torch
from helpers import built_once, clone_run, planned_rules, snakemake, with_setting
from tinymodel import save_tiny_chat_model
from transformers import TrainerCallback

from replaynoise.config import ConfigError, validate_config
from replaynoise.data.datasets import training_set
from replaynoise.data.preparation import prepare_model
from replaynoise.generation import training
from replaynoise.generation.training import train_grpo
from replaynoise.io import keyed_scratch, read_json, read_parquet, sha256_file

#: the tests that run the workflow (about 2 min on 2 cores for the first, which makes the run the others read)
workflow_run = pytest.mark.slow

#: Three steps of four prompts, eight two-token answers each: the tiny model's digits are right often enough by
#: chance that a step's group rewards differ, so the weights move.
TRAIN = {
    "dataset": "simple_addsub",
    "steps": 3,
    "prompts_per_step": 4,
    "generations": 8,
    "micro_batch": 16,
    "learning_rate": 0.01,
    "max_completion_length": 2,
}


#: the schema's defaults of the keys TRAIN leaves out, and the prompt of the runs below
TRAIN_DEFAULTS = {"method": "grpo", "kl_coef": 0.04, "temperature": 1.0, "seed": 0}
PROMPT = {"style": "chat", "instruction": "Answer."}
PLANNED = "planned-rules.json"  # beside the run: the rules its first dry run planned


def run_config(model: Path) -> dict:
    settings = {"model": str(model), "dtype": "float32", "max_new_tokens": 4}
    return {
        "seed": 5,
        "dataset": {"source": "simple_addsub", "n_problems": 3},
        "prompt": PROMPT,
        "configs": {"base": settings, "trained": {**settings, "train": TRAIN}},
        "rollouts": {"per_problem": 1, "screen": {"rule": "none"}},
        "pivots": {"max_margin": 1.0, "per_rollout": 1},
        "replay": {"k": 2, "max_new_tokens": 3, "probe_tokens": 32, "passes": ["exact", "replica", "refeed"]},
        "analysis": {"n_boot": 20, "min_eligible": 1},
    }


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory) -> tuple[Path, dict, set[str]]:
    """A finished run of the default target, and the rules a dry run planned before it: made once per session
    (under pytest -n, by one worker for all), each worker reading its own copy."""
    model = built_once(tmp_path_factory, "trained-run-model", save_tiny_chat_model)
    config = run_config(model)

    def run(workdir: Path) -> None:
        workdir.mkdir()
        planned = planned_rules(workdir, config)
        (workdir / PLANNED).write_text(json.dumps(sorted(planned)))
        snakemake(workdir, config)

    workdir = clone_run(built_once(tmp_path_factory, "trained-run", run), tmp_path_factory.mktemp("trained") / "run")
    return workdir, config, set(json.loads((workdir / PLANNED).read_text()))


def model_dirs(workdir: Path) -> dict[str, Path]:
    """{"base" or "trained": prepared model directory}, told apart by their own record."""
    dirs = [p for p in (workdir / "results" / "models").iterdir() if not p.name.startswith(".")]
    return {read_json(p / "replaynoise-model.json")["origin"]["kind"].replace("local", "base"): p for p in dirs}


@workflow_run
def test_the_default_target_trains_then_measures_the_trained_model(trained_run):
    workdir, _, planned = trained_run
    assert {
        "prepare_model",
        "training_problems",
        "train_grpo",
        "generate_rollouts",
        "figure_training",
        "policy_table",
    } <= planned
    models = model_dirs(workdir)
    assert set(models) == {"base", "trained"}
    assert models["trained"].name.startswith(models["base"].name + "-grpo-")
    info = read_json(models["trained"] / "replaynoise-model.json")
    assert info["origin"]["train"]["steps"] == 3 and info["origin"]["train"]["seed"] == 0  # the documented default
    assert info["origin"]["base"]["origin"]["kind"] == "local"
    # the evaluation's three problems come from the train set's dataset, so they are left out of it
    assert info["origin"]["train_problems"] == 500 - 3
    problems = read_parquet(workdir / "results" / "problems" / "simple_addsub.parquet")["question"].to_list()
    trained_on = read_parquet(workdir / "results" / "training" / models["trained"].name / "problems.parquet")
    assert trained_on.height == 497 and not trained_on["question"].is_in(problems).any()
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


@workflow_run
def test_a_rerun_does_nothing_and_an_unrelated_change_does_not_retrain(trained_run):
    workdir, config, _ = trained_run
    assert planned_rules(workdir, config) == set()
    changed = planned_rules(workdir, with_setting(config, "replay.k", 3))
    assert changed and not changed & {"prepare_model", "train_grpo", "generate_rollouts"}


@workflow_run
def test_a_changed_train_setting_retrains_and_remeasures_only_the_trained_model(trained_run):
    workdir, config, _ = trained_run
    changed = with_setting(config, "configs.trained.train.learning_rate", 0.02)
    assert {"train_grpo", "generate_rollouts"} <= planned_rules(workdir, changed)
    assert "prepare_model" not in planned_rules(workdir, changed)
    plan = snakemake(workdir, changed, "-n").stdout
    remade = {
        block.split(":", 1)[0] + ":" + block.split("wildcards: ", 1)[1].split("\n", 1)[0]
        for block in plan.split("\nrule ")[1:]
        if block.startswith("generate_rollouts:")
    }
    assert remade == {"generate_rollouts:config=trained, shard=000"}, plan[-3000:]


@workflow_run
def test_the_same_seed_and_settings_give_the_same_weights(trained_run, tmp_path):
    """The library call with the rule's settings reproduces the workflow's model bit for bit on this CPU."""
    workdir, config, _ = trained_run
    trained = model_dirs(workdir)["trained"]
    origin = read_json(trained / "replaynoise-model.json")["origin"]
    problems = read_parquet(workdir / "results" / "training" / trained.name / "problems.parquet")
    again = tmp_path / "again"
    info = train_grpo(
        model_dirs(workdir)["base"],
        again,
        tmp_path / "work",
        origin,
        dtype="float32",
        threads=2,
        problems=problems,
        log_csv=tmp_path / "log.csv",
    )
    assert info["origin"]["weights_sha256"] == origin["weights_sha256"]


def test_a_micro_batch_that_does_not_divide_the_step_is_refused_by_value():
    config = {"configs": {"a": {"model": "smollm2-135m", "train": {**TRAIN, "micro_batch": 5}}}}
    with pytest.raises(ConfigError, match=r"train\.micro_batch: 5 does not divide the 32 completions"):
        validate_config(config)


def test_training_on_a_gpu_other_than_the_first_is_refused_by_key():
    config = {"configs": {"a": {"model": "smollm2-135m", "device": "cuda:1", "train": TRAIN}}}
    with pytest.raises(ConfigError, match=r"configs\.a\.device: 'cuda:1' with a train block"):
        validate_config(config)


class KilledAfterCheckpoint(Exception):
    pass


def test_a_killed_training_resumes_from_its_checkpoint_to_the_same_weights(tmp_path, monkeypatch, capsys):
    """A training killed after a checkpoint loses only the steps after it, and the resumed run ends where an
    uninterrupted one does, on this CPU."""
    base = tmp_path / "base"
    prepare_model(str(save_tiny_chat_model(tmp_path / "tiny")), "float32", base, tmp_path)
    monkeypatch.setattr(training, "CHECKPOINT_EVERY", 2)

    def train(out: str, work: str):
        recipe = {"train": {**TRAIN_DEFAULTS, **TRAIN}, "prompt": PROMPT, "stop": [], "device": "cpu"}
        return train_grpo(
            base,
            tmp_path / out,
            keyed_scratch(tmp_path / work, "k"),
            recipe,
            dtype="float32",
            threads=2,
            problems=training_set("simple_addsub", tmp_path, [], 1),
            log_csv=tmp_path / f"{out}.csv",
        )

    whole = train("whole", "work-whole")

    class Killed(TrainerCallback):
        def on_save(self, args, state, control, **_):
            raise KilledAfterCheckpoint(state.global_step)

    class KilledTrainer(training.GRPOTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, callbacks=[Killed()], **kwargs)

    with monkeypatch.context() as m:
        m.setattr(training, "GRPOTrainer", KilledTrainer)
        with pytest.raises(KilledAfterCheckpoint):
            train("resumed", "work")
    assert [p.name for p in (tmp_path / "work").glob("checkpoint-*")] == ["checkpoint-2"]
    assert not (tmp_path / "resumed").exists()  # nothing half-written where the model goes
    capsys.readouterr()
    resumed = train("resumed", "work")
    assert f"resuming training from {tmp_path / 'work' / 'checkpoint-2'}" in capsys.readouterr().err
    assert pl.read_csv(tmp_path / "resumed.csv")["step"].to_list() == [1, 2, 3]
    assert resumed["origin"]["weights_sha256"] == whole["origin"]["weights_sha256"]


def test_a_checkpoint_killed_while_saving_is_not_resumed(tmp_path):
    """transformers writes a checkpoint's trainer_state.json last: one without it was cut short."""
    for step, whole in ((10, True), (20, False), (5, True)):
        (tmp_path / f"checkpoint-{step}").mkdir()
        if whole:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert training.last_checkpoint(tmp_path) == tmp_path / "checkpoint-10"
    assert training.last_checkpoint(tmp_path / "none") is None


def test_a_train_set_smaller_than_one_step_is_refused_before_any_model_is_prepared(tmp_path):
    """simple_addsub has 500 problems; with 498 taken for evaluation, 2 are left for steps of 4 prompts: a
    trainer would end at step 0 and publish the base weights as trained. Refused when the config is read, by key
    and sizes, and again where the train set is made (questions the evaluation shares are taken out by text)."""
    config = {
        "dataset": {"source": "simple_addsub", "n_problems": 498},
        "configs": {"a": {"model": "smollm2-135m", "train": TRAIN}},
    }
    with pytest.raises(
        ConfigError,
        match=r"train\.dataset and train\.prompts_per_step: simple_addsub has 500 "
        r"problems, 2 once the evaluation's 498",
    ):
        validate_config(config)
    excluded = training_set("simple_addsub", tmp_path, [], 1)["question"].to_list()[:498]
    with pytest.raises(ValueError, match=r"2 problems are left .* fewer than train\.prompts_per_step \(4\)"):
        training_set("simple_addsub", tmp_path, excluded, 4)


def _train_with(trainer_class, tmp_path, monkeypatch, train=None):
    base = tmp_path / "base"
    prepare_model(str(save_tiny_chat_model(tmp_path / "tiny")), "float32", base, tmp_path)
    monkeypatch.setattr(training, "GRPOTrainer", trainer_class)
    recipe = {"train": {**TRAIN_DEFAULTS, **TRAIN, **(train or {})}, "prompt": PROMPT, "stop": [], "device": "cpu"}
    return train_grpo(
        base,
        tmp_path / "out",
        keyed_scratch(tmp_path / "work", "k"),
        recipe,
        dtype="float32",
        threads=1,
        problems=training_set("simple_addsub", tmp_path, [], 4),
        log_csv=tmp_path / "log.csv",
    )


def test_a_training_that_takes_fewer_steps_than_asked_publishes_nothing(tmp_path, monkeypatch):
    class EndsAtStepZero(training.GRPOTrainer):
        def train(self, **_):  # what a trainer does with too few batches: returns, having taken no step
            return None

    with pytest.raises(RuntimeError, match=r"training took 0 of the 3 steps train\.steps asks for"):
        _train_with(EndsAtStepZero, tmp_path, monkeypatch)
    assert not (tmp_path / "out").exists()


def test_weights_that_are_not_finite_are_refused_at_publication_naming_the_key(tmp_path, monkeypatch):
    """A learning rate of 1e6 gives NaN weights, which a later rollout only met as an index error in sampling."""

    class Diverges(training.GRPOTrainer):
        def train(self, **_):
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
            self.state.global_step = 3

    with pytest.raises(ValueError, match=r"not finite .* lower train\.learning_rate \(1000000\.0\)"):
        _train_with(Diverges, tmp_path, monkeypatch, train={"learning_rate": 1.0e6})
    assert not (tmp_path / "out").exists()


def test_a_published_model_records_the_steps_it_took(trained_run):
    run, _, _ = trained_run
    records = [read_json(p) for p in (run / "results" / "models").glob("*-grpo-*/replaynoise-model.json")]
    assert records and all(r["origin"]["steps_taken"] == r["origin"]["train"]["steps"] for r in records)
