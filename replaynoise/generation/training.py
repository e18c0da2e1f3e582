"""GRPO training of a prepared model, so that a configuration can measure "this base model after RL".

TRL's GRPOTrainer runs the loop; this module gives it what makes the result this tool's: the prompts are the
run's own prompt block (``replaynoise.data.prompts``) over a packaged train set, the reward is the tool's own grader,
and the trained model is written as a prepared model directory, atomically, with a record of what made it.
Checkpoints go to a scratch folder keyed by everything that decides the weights, so a killed step resumes from
its last checkpoint and a changed setting starts afresh.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import version as package_version
from pathlib import Path

import polars as pl
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from replaynoise.data.grading import extract_answer, is_correct
from replaynoise.data.loading import eos_ids, load_tokenizer, model_weights_dir, stop_token_ids
from replaynoise.data.preparation import check_tokenizer, publish_model_dir, staging_dir
from replaynoise.data.prompts import chat_turns, check_chat_template, check_style, plain_text
from replaynoise.generation.training_log import training_log, write_training_log
from replaynoise.io import read_json, sha256_file
from replaynoise.settings import PromptSettings

#: Steps between the checkpoints an interrupted training resumes from (each holds the optimizer state too).
CHECKPOINT_EVERY = 10


def training_prompts(problems: pl.DataFrame, tokenizer, prompt: dict) -> Dataset:
    """TRL's prompt column, as the rollouts ask: a conversation for ``chat`` (TRL applies the chat template just
    as ``rollouts.prompt_ids`` does), the plain text otherwise; the gold answer rides along for the reward."""
    settings = PromptSettings.of(prompt)
    style, instruction, shots = settings.style, settings.instruction, settings.shots
    check_style(style)
    if style == "chat":
        check_chat_template(tokenizer)
        prompts = [chat_turns(q, instruction, shots) for q in problems["question"]]
    else:
        prompts = [plain_text(q, instruction, shots) for q in problems["question"]]
    return Dataset.from_dict(
        {"prompt": prompts, "gold": problems["gold"].to_list(), "problem_id": problems["problem_id"].to_list()}
    )


def completion_text(completion) -> str:
    """A completion's text (the assistant turn's content for a chat prompt). It ends at its end or stop token,
    where TRL cuts it, so it is graded on the text a rollout would be."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct(completions, gold, **_) -> list[float]:
    """The reward: 1 for a completion whose final answer the grader accepts, else 0."""
    return [float(is_correct(extract_answer(completion_text(c)), g)) for c, g in zip(completions, gold)]


def grpo_config(train: dict, work_dir: Path, device: str) -> GRPOConfig:
    """TRL's settings from the train block; what the block does not name keeps TRL's default."""
    completions = train["prompts_per_step"] * train["generations"]
    return GRPOConfig(
        output_dir=str(work_dir),
        max_steps=train["steps"],
        per_device_train_batch_size=train["micro_batch"],
        gradient_accumulation_steps=completions // train["micro_batch"],
        num_generations=train["generations"],
        max_completion_length=train["max_completion_length"],
        beta=train["kl_coef"],
        learning_rate=train["learning_rate"],
        temperature=train["temperature"],
        top_p=1.0,
        seed=train["seed"],
        data_seed=train["seed"],
        logging_steps=1,
        report_to="none",
        save_strategy="steps",
        save_steps=CHECKPOINT_EVERY,
        save_total_limit=1,
        use_cpu=device == "cpu",
        bf16=device != "cpu",
        dataloader_num_workers=0,
        disable_tqdm=False,
        # the models this trains fit with their activations kept; recomputing them costs a third of a step
        gradient_checkpointing=False,
        # fp32 master weights; TF32 matmuls outside the bf16 autocast (generation) cut a step's time
        tf32=device != "cpu",
        # the reference model (kl_coef > 0) loads as every model here does: offline, safetensors only, on the
        # run's device (TRL's default spreads it over every visible GPU)
        model_init_kwargs={
            "local_files_only": True,
            "use_safetensors": True,
            "device_map": None if device == "cpu" else device,
        },
    )


def _trainable(weights: Path, stops: Sequence[str]) -> tuple:
    """The model to train and its tokenizer: float32 master weights (the optimizer's small steps vanish in bf16;
    bf16 autocast on a GPU computes in it), a pad token for TRL's batches of prompts, and the end tokens of a
    rollout. A completion ends where a rollout would, at the engines' end tokens and the configuration's stop
    tokens: TRL reads its end tokens from the generation config once, and stops generating, cuts the completion
    (so nothing after a stop is trained on or graded) and masks the loss at them."""
    tokenizer = load_tokenizer(weights)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(
        weights, dtype=torch.float32, local_files_only=True, trust_remote_code=False, use_safetensors=True
    )
    model.generation_config.eos_token_id = sorted(eos_ids(weights, tokenizer) | stop_token_ids(tokenizer, stops))
    return model, tokenizer


def train_grpo(
    base_dir: Path,
    out_dir: Path,
    work_dir: Path,
    recipe: Mapping,
    *,
    dtype: str,
    threads: int,
    problems: pl.DataFrame,
    log_csv: Path,
) -> dict:
    """Train the prepared model at ``base_dir`` on ``problems`` (``datasets.training_set``) by ``recipe`` (its
    ``train`` block, ``prompt``, ``stop`` texts and ``device``); write the trained one to ``out_dir``
    (atomically) and the per-step log to ``log_csv``. Returns the record written to its
    ``replaynoise-model.json``. ``work_dir`` holds the checkpoints, keyed by what produced them
    (``io.keyed_scratch``)."""
    train, prompt, stops, device = recipe["train"], recipe["prompt"], recipe["stop"], recipe["device"]
    torch.set_num_threads(threads)  # the caller passes settings.compute_threads: on CPU, cpu_threads
    weights = model_weights_dir(Path(base_dir))
    model, tokenizer = _trainable(weights, stops)
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correct],
        args=grpo_config(train, work, device),
        train_dataset=training_prompts(problems, tokenizer, prompt),
        processing_class=tokenizer,
    )
    resume = last_checkpoint(work)
    if resume:
        print(f"resuming training from {resume}", file=sys.stderr, flush=True)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    taken = int(trainer.state.global_step)
    if taken < train["steps"]:  # a trainer that runs out of batches ends early and says so only in its log
        raise RuntimeError(
            f"training took {taken} of the {train['steps']} steps train.steps asks for (train set of "
            f"{problems.height} problems, {train['prompts_per_step']} a step); no model is published"
        )
    log = training_log(trainer.state.log_history)
    write_training_log(log, log_csv)
    base = read_json(Path(base_dir) / "replaynoise-model.json")
    origin = {
        "kind": "trained",
        "method": train["method"],
        "base": base,
        "train": train,
        "prompt": prompt,
        "stop": list(stops),
        "device": device,
        "train_problems": problems.height,
        "steps_taken": taken,
        "versions": {p: package_version(p) for p in ("trl", "transformers", "torch")},
    }
    return save_model(trainer.model, tokenizer, dtype, Path(out_dir), origin, weights)


def last_checkpoint(work: Path) -> Path | None:
    """The newest checkpoint a killed training left whole: transformers writes its ``trainer_state.json`` last, so
    one killed while saving lacks it and is skipped (resuming from it would fail at every rerun)."""
    whole = [
        p for p in work.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and (p / "trainer_state.json").is_file()
    ]
    return max(whole, key=lambda p: int(p.name.split("-")[-1]), default=None)


def check_finite(model, train: dict) -> None:
    """Refuse weights that are not finite (a training that diverged: a learning rate of 1e6 gives NaN), naming
    the first such tensor and the key to change, before anything is published: a later rollout would otherwise
    fail deep inside sampling with an index error."""
    for name, param in model.named_parameters():
        if not torch.isfinite(param).all():
            raise ValueError(
                f"the trained weights are not finite ({name} holds NaN or inf): the training diverged; "
                f"lower train.learning_rate ({train.get('learning_rate')}) or train.steps. No model "
                "is published"
            )


def save_model(model, tokenizer, dtype: str, out_dir: Path, origin: dict, base: Path) -> dict:
    """Write a prepared model directory in ``dtype`` (the configuration's), atomically. Its config and generation
    config are the base model's: transformers' Trainer rewrites the model's end token to the tokenizer's, and a
    trained model that stopped elsewhere than its base would differ at evaluation in more than its weights."""
    check_finite(model, origin.get("train", {}))
    with staging_dir(out_dir) as tmp:
        model.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name in ("config.json", "generation_config.json"):
            if (base / name).is_file():
                shutil.copyfile(base / name, tmp / name)
        check_tokenizer(load_tokenizer(tmp), str(out_dir))
        origin = {**origin, "weights_sha256": {p.name: sha256_file(p) for p in sorted(tmp.glob("*.safetensors"))}}
        info = {"spec": f"grpo:{origin['base']['spec']}", "dtype": dtype, "origin": origin}
        publish_model_dir(tmp, out_dir, info)
    return info
