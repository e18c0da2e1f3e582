"""The per-step log of a training run, one row per optimizer step, read from the trainer's own log history."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import polars as pl

from replaynoise.io import atomic_path

#: Log column -> TRL's metric name. reward is the group mean of the grader's 0/1 over a step's completions;
#: entropy the mean per-token entropy of the sampled completions (nats); kl the per-token KL to the base model
#: (absent where train.kl_coef is 0, TRL then keeps no reference model).
LOG_COLUMNS = {
    "reward": "reward",
    "reward_std": "reward_std",
    "frac_reward_zero_std": "frac_reward_zero_std",
    "kl": "kl",
    "entropy": "entropy",
    "completion_length": "completions/mean_length",
    "clipped_ratio": "completions/clipped_ratio",
    "learning_rate": "learning_rate",
    "grad_norm": "grad_norm",
    "loss": "loss",
}
LOG_SCHEMA = {"step": pl.Int64, **{col: pl.Float64 for col in LOG_COLUMNS}}


def training_log(history: Sequence[Mapping]) -> pl.DataFrame:
    """One row per logged step (a resumed run's history repeats none: the checkpoint carries the steps before
    it), the columns of ``LOG_COLUMNS`` (null where the trainer did not log one)."""
    rows = {}
    for entry in history:
        if "reward" in entry and "step" in entry:
            rows[int(entry["step"])] = {
                "step": int(entry["step"]),
                **{col: _float(entry.get(key)) for col, key in LOG_COLUMNS.items()},
            }
    return pl.DataFrame([rows[s] for s in sorted(rows)], schema=LOG_SCHEMA)


def _float(value) -> float | None:
    return None if value is None else float(value)


def write_training_log(log: pl.DataFrame, target: str | os.PathLike) -> None:
    with atomic_path(target) as tmp:
        log.write_csv(tmp)


def read_training_log(path: str | os.PathLike) -> pl.DataFrame:
    return pl.read_csv(path, schema=LOG_SCHEMA)
