"""The regime probe: a campaign's own steps shrunk to what decides its re-feed rate, in one engine's lifetime.

A few problems' rollouts are generated with their decode-time state captured, many pivots per rollout are chosen
by the campaign's own rules (at random among its candidates, so their prefixes spread over the lengths the campaign
replays), and each pass replays one continuation of one token per branch: the first step, from the resumed state
(exact, replica) and from a re-fed one (refeed). What a user learns in minutes is whether, and up to what length,
this engine's prefill reproduces its decode: the measurement the campaign's excess follows.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import polars as pl

from replaynoise.engines.base import Engine, SamplingSettings
from replaynoise.generation import replay, rollouts
from replaynoise.generation.pivots import PivotRules, select_pivots
from replaynoise.settings import PromptSettings, ReplaySettings, RolloutSettings

#: The probe's size where a configuration gives no ``regime`` block, or leaves a key of it out (config/schema.yaml).
REGIME_ABSENT: dict[str, int | None] = {"problems": None, "rollouts": None, "pivots": 16}
#: The passes a probe replays: the resumed state twice (its own repeatability) and the re-fed one.
PROBE_PASSES = ("exact", "replica", "refeed")


@dataclass(frozen=True)
class RegimeSettings:
    """The probe's size (``regime``): the first ``problems`` problems of the campaign's sample, ``rollouts`` each,
    up to ``pivots`` pivots a rollout. Unset, the rollouts are the campaign's ``per_problem`` and the problems fill
    one of its rollout batches: a decode step's kernels can depend on how many sequences it decodes together."""

    problems: int
    rollouts: int
    pivots: int

    @classmethod
    def of(cls, block: Mapping[str, Any] | None, rollout_block: Mapping[str, Any]) -> RegimeSettings:
        block = {**REGIME_ABSENT, **(block or {})}
        rollouts = int(block["rollouts"] or rollout_block["per_problem"])
        problems = int(block["problems"] or max(1, rollout_block["batch_size"] // rollouts))
        return cls(problems=problems, rollouts=rollouts, pivots=int(block["pivots"]))


@dataclass(frozen=True)
class ProbeJob:
    """What a probe replays, from its campaign: the configuration's name, seed and settings, and the prompt, rollout,
    pivot and replay blocks, with the probe's size."""

    config_name: str
    seed: int
    settings: Mapping[str, Any]
    prompt: Mapping[str, Any]
    rollouts: Mapping[str, Any]
    pivots: Mapping[str, Any]
    replay: Mapping[str, Any]
    size: RegimeSettings


@dataclass(frozen=True)
class ProbeRun:
    """A probe's rows: the rollouts, the pivots and each pass's replayed rows, seconds per phase, and per rollout its
    generation batch and response length (``decode``), from which the rows each decode step ran follow."""

    rollouts: pl.DataFrame
    pivots: pl.DataFrame
    passes: dict[str, pl.DataFrame]
    seconds: dict[str, float]
    decode: pl.DataFrame


def probe_rules(pivots: Mapping[str, Any], block_size: int, size: RegimeSettings) -> PivotRules:
    """The campaign's pivot rules, choosing ``size.pivots`` a rollout at random among its candidates: the
    earliest (the paper's choice) would leave the long prefixes, where engines part, unprobed."""
    return replace(PivotRules.from_config(dict(pivots), block_size), per_rollout=size.pivots, choose="random")


def decode_batches(frame: pl.DataFrame, per_problem: int, batch_size: int) -> pl.DataFrame:
    """Per rollout: the generation batch it was decoded in (``rollouts.rollout_batches`` over the problems in the
    order generated) and its response length: a batch's rollouts decode together until each one ends."""
    ids = frame["problem_id"].unique(maintain_order=True).to_list()
    batches = rollouts.rollout_batches(ids, per_problem, batch_size)
    batch_of = {pid: b for b, batch in enumerate(batches) for pid in batch}
    return frame.select(
        "problem_id",
        "rollout",
        pl.col("problem_id").replace_strict(batch_of, return_dtype=pl.Int64).alias("batch"),
        pl.col("response_ids").list.len().cast(pl.Int64).alias("response_len"),
    ).sort("batch", "problem_id", "rollout")


def run_probe(
    engine: Engine, problems: pl.DataFrame, job: ProbeJob, *, work_dir: Path, context: int | None = None
) -> ProbeRun:
    """Rollouts of the first ``job.size.problems`` problems, pivots by ``probe_rules`` and each of ``PROBE_PASSES``
    replaying one first step per branch, all through ``engine``; scratch in ``work_dir``."""
    work_dir = Path(work_dir)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    s, size = job.settings, job.size
    rules = probe_rules(job.pivots, s["block_size"], size)
    rollout_job = rollouts.RolloutJob(
        config_name=job.config_name,
        seed=job.seed,
        sampling=SamplingSettings(s["temperature"], s["top_p"], s["max_new_tokens"]),
        prompt=PromptSettings.of(job.prompt),
        rollouts=RolloutSettings.of({**job.rollouts, "per_problem": size.rollouts}),
        rules=rules,
    )
    frame = rollouts.generate(
        engine,
        problems.head(size.problems),
        rollout_job,
        kv_dir=work_dir / "kv",
        work_dir=work_dir / "rollouts",
        context=context,
    )
    seconds["rollouts"] = time.perf_counter() - start
    decode = decode_batches(frame, rollout_job.rollouts.per_problem, rollout_job.rollouts.batch_size)
    pivots = select_pivots(frame, rules, seed=job.seed, config_name=job.config_name)
    one_step = {**job.replay, "k": 1, "max_new_tokens": 1, "probe_tokens": 0}
    passes = {}
    for name in PROBE_PASSES:
        start = time.perf_counter()
        pass_job = replay.PassJob(
            pass_name=name,
            config_name=job.config_name,
            seed=job.seed,
            sampling=replay.continuation_sampling(s, one_step),
            replay=ReplaySettings.of(one_step),
        )
        # the rollouts' kv_file are paths here (in the workflow, names that the KV index locates)
        passes[name] = replay.run_pass(engine, pivots, frame, pass_job, work_dir=work_dir / name, context=context)
        seconds[name] = time.perf_counter() - start
    return ProbeRun(frame, pivots, passes, seconds, decode)
