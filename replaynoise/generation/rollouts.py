"""Rollout generation: N seeded rollouts (trunks) per problem, generated in batches of whole problems, with the
decode-time KV each later pivot can need.

Work is kept per batch in a scratch folder keyed by the settings that made it, so a killed step resumes where
it stopped; batches are fixed by the problem order and every rollout by its own seed, so resumed and
uninterrupted runs give the same bytes.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from replaynoise.data.datasets import read_problems
from replaynoise.data.grading import extract_answer, is_correct
from replaynoise.data.prompts import chat_turns, check_chat_template, check_style, plain_text
from replaynoise.engines.base import Engine, Rollout, RolloutRequest, SamplingSettings
from replaynoise.generation.answer_spans import answer_token_span
from replaynoise.generation.pivots import PivotRules, rollout_pivots
from replaynoise.io import intact_scratch, write_parquet
from replaynoise.progress import TokenProgress
from replaynoise.seeds import derive_seed
from replaynoise.settings import PromptSettings, RolloutSettings

#: What a problem whose prompt leaves its rollout too few of the context's positions gets (rollouts.long_prompts):
#: the step refuses before any generation, or leaves it out and counts it in the log.
LONG_PROMPTS = ("refuse", "skip")
#: Problems a message names one by one; the rest it counts.
NAMED = 5


def prompt_ids(tokenizer, question: str, style: str, instruction: str, shots: Sequence[Mapping] = ()) -> list[int]:
    """The prompt as token ids: the chat template for instruct models, a plain Q/A frame for base models, with
    the worked examples ``shots`` ({question, answer}) before the question in the same frame."""
    check_style(style)
    if style == "chat":
        check_chat_template(tokenizer)
        ids = tokenizer.apply_chat_template(
            chat_turns(question, instruction, shots), add_generation_prompt=True, tokenize=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer(plain_text(question, instruction, shots), add_special_tokens=True)["input_ids"])


def overlong_prompts(prompts: Mapping[str, Sequence[int]], budget: int, context: int | None) -> dict[str, int]:
    """{problem_id: prompt tokens} of the prompts with fewer than ``budget`` positions of ``context`` left after
    them: a model run past its positions still answers, and the answer is graded. None where the context is
    unknown."""
    if context is None:
        return {}
    return {pid: len(ids) for pid, ids in prompts.items() if len(ids) + budget > context}


def problem_locations(over: Mapping[str, int], problems: pl.DataFrame, dataset: Mapping | None) -> list[str]:
    """``file:line: problem <id>: <n> prompt tokens`` for the first ``NAMED`` of ``over`` and a count of the rest.
    The dataset (``dataset``: source, path, cache) is read again only here, when there is something to name: the
    step would otherwise depend on it as well as on the problems sampled from it; a dataset edited or gone
    since then leaves the row the problem was sampled from."""
    try:
        where = read_problems(dataset["source"], dataset["path"], Path(dataset["cache"])).where if dataset else {}
    except (OSError, ValueError, RuntimeError):  # gone, edited, or its package no longer cached
        where = {}
    rows = dict(zip(problems["problem_id"], problems["row"]))
    named = [
        f"{where.get(pid, f'dataset row {rows.get(pid)}')}: problem {pid}: {n} prompt tokens"
        for pid, n in list(over.items())[:NAMED]
    ]
    return named + ([f"and {len(over) - NAMED} more"] if len(over) > NAMED else [])


def fit_context(
    prompts: Mapping[str, Sequence[int]],
    problems: pl.DataFrame,
    *,
    config_name: str,
    budget: int,
    context: int | None,
    long_prompts: str,
    dataset: Mapping | None,
    own: set[str],
) -> set[str]:
    """The problems to leave out: none, or with ``long_prompts`` "skip" those whose prompt plus the rollout budget
    do not fit ``context`` (counted in the log for the problems of ``own``); with "refuse" such a prompt stops the
    step here, before any generation, naming each problem by file and line."""
    if long_prompts not in LONG_PROMPTS:
        raise ValueError(f"rollouts.long_prompts must be one of {LONG_PROMPTS}, got {long_prompts!r}")
    over = overlong_prompts(prompts, budget, context)
    if not over:
        return set()
    past = (
        f"and their {budget} rollout tokens (configs.{config_name}.max_new_tokens) run past its {context}-position "
        "context"
    )
    if long_prompts == "skip":
        mine = {pid: n for pid, n in over.items() if pid in own}
        if mine:
            print(
                f"configuration {config_name}: skipped {len(mine)} of {len(own)} problems of this shard, whose "
                f"prompts {past} (rollouts.long_prompts: skip): "
                + "; ".join(problem_locations(mine, problems, dataset)),
                file=sys.stderr,
            )
        return set(over)
    raise ValueError(
        f"configuration {config_name}: {len(over)} prompt(s) {past}: "
        + "; ".join(problem_locations(over, problems, dataset))
        + f". Shorten or remove these questions, lower configs.{config_name}.max_new_tokens, raise the context "
        f"(configs.{config_name}.vllm.max_model_len or invariant_context where set, else a model with more "
        "positions), or set rollouts.long_prompts: skip to leave such problems out with a count in the log"
    )


def rollout_record(rollout: Rollout, tokenizer, gold: str, span: tuple[int, int] | None, special: set[int]) -> dict:
    """One rollouts.parquet row; ``span`` is the final-answer span (``answer_token_span``), ``special`` the
    tokens no substitute may be (the tokenizer's special tokens and the engine's stop tokens)."""
    text = tokenizer.decode(rollout.response_ids, skip_special_tokens=True)
    answer = extract_answer(text)
    return {
        "problem_id": rollout.problem_id,
        "rollout": rollout.rollout,
        "prompt_ids": rollout.prompt_ids,
        "response_ids": rollout.response_ids,
        "topk_ids": rollout.topk_ids,
        "topk_logprobs": rollout.topk_logprobs,
        "logits_digests": rollout.logits_digests,
        "finish_reason": rollout.finish_reason,
        "text": text,
        "answer": answer,
        "gold": gold,
        "correct": is_correct(answer, gold),
        "answer_span": list(span) if span else None,
        "special_ids": sorted(special),
        "kv_file": rollout.kv_file,
        "kv_len": rollout.kv_len,
        "kv_sha256": rollout.kv_sha256,
        "response_logprobs": rollout.token_logprobs,
    }


def rollout_batches(problem_ids: list[str], per_problem: int, batch_size: int) -> list[list[str]]:
    """Whole problems per batch (their N rollouts together, as one ``n=N`` request would be), about
    ``batch_size`` rollouts a batch; fixed by the problem order, so a resumed step meets the same batches."""
    per_batch = max(1, batch_size // per_problem)
    return [problem_ids[i : i + per_batch] for i in range(0, len(problem_ids), per_batch)]


@dataclass(frozen=True)
class RolloutJob:
    """What one configuration's rollout step makes, whatever its shard: its name and seed, how it samples,
    prompts and batches, and the pivot rules that decide how much of each rollout's KV is kept."""

    config_name: str
    seed: int
    sampling: SamplingSettings
    prompt: PromptSettings
    rollouts: RolloutSettings
    rules: PivotRules


def generate(
    engine: Engine,
    problems: pl.DataFrame,
    job: RolloutJob,
    *,
    kv_dir: Path,
    work_dir: Path,
    mine: range | None = None,
    context: int | None = None,
    dataset: Mapping | None = None,
) -> pl.DataFrame:
    """Generate (or resume) the rollouts of problems ``mine`` (rows of ``problems``; default all),
    ``job.rollouts.per_problem`` per problem; KV files end in ``kv_dir``, each kept as far as the rollout's chosen
    pivots need it. ``work_dir`` is the step's scratch, keyed by what produced it (``io.keyed_scratch``).

    Batches are cut from the whole problem list, whatever the shard, so the shard size never changes a batch: a
    batch that straddles two shards is generated in both, and each keeps its own rows.

    Before any generation every prompt is measured as the engine receives it against ``context`` (the engine's
    positions, ``models.engine_context``) less the rollout budget: ``fit_context`` refuses, naming each problem
    by its place in ``dataset``, or leaves them out."""
    parts, work_kv = Path(work_dir) / "records", Path(work_dir) / "kv"
    parts.mkdir(parents=True, exist_ok=True)
    work_kv.mkdir(parents=True, exist_ok=True)
    step = _Step(engine, problems, job, mine)
    step.fit(context, dataset)
    per_problem = job.rollouts.per_problem
    done = {b for b in step.batches if _resumable(parts / f"batch_{b:05d}.parquet", work_kv)}
    progress = TokenProgress(
        len(step.own) * per_problem,
        f"rollouts {job.config_name}",
        initial=sum(len(step.own & set(step.batches[b])) for b in done) * per_problem,
    )
    for b, batch in step.batches.items():
        if b in done:
            continue
        records = step.records(batch, work_kv, kv_dir)
        write_parquet(pl.DataFrame(records), parts / f"batch_{b:05d}.parquet")
        progress.rows(len(records), sum(len(r["response_ids"]) for r in records))
    progress.close(engine.phases)

    # a shard whose every problem was left out (rollouts.long_prompts: skip) has no rows, and no columns either
    frame = (
        pl.concat([pl.read_parquet(parts / f"batch_{b:05d}.parquet") for b in step.batches], how="diagonal_relaxed")
        if step.batches
        else pl.DataFrame()
    )
    # Linked (or copied), not moved: the scratch copy must survive until the step's outputs are all in place.
    if Path(kv_dir).exists():
        shutil.rmtree(kv_dir)
    shutil.copytree(work_kv, kv_dir, copy_function=link_or_copy)
    return frame


class _Step:
    """One rollout step's problems: those of its shard (``own``), the batches that hold them, their prompts."""

    def __init__(self, engine: Engine, problems: pl.DataFrame, job: RolloutJob, mine: range | None) -> None:
        self.engine, self.problems, self.job = engine, problems, job
        ids = problems["problem_id"].to_list()
        self.own = set(ids if mine is None else ids[mine.start : mine.stop])
        batches = rollout_batches(ids, job.rollouts.per_problem, job.rollouts.batch_size)
        self.batches = {b: batch for b, batch in enumerate(batches) if self.own & set(batch)}
        self.by_id = {row["problem_id"]: row for row in problems.iter_rows(named=True)}
        prompt = job.prompt
        self.prompts = {
            pid: tuple(
                prompt_ids(
                    engine.tokenizer, self.by_id[pid]["question"], prompt.style, prompt.instruction, prompt.shots
                )
            )
            for batch in self.batches.values()
            for pid in batch
        }
        # a stop token ends a response as EOS does
        self.special = set(engine.tokenizer.all_special_ids) | engine.stop_ids

    def fit(self, context: int | None, dataset: Mapping | None) -> None:
        """Leave out (or refuse) the problems whose prompts do not fit ``context``: each step that runs a batch
        leaves out the same problems of it, so shards still agree."""
        left_out = fit_context(
            self.prompts,
            self.problems,
            config_name=self.job.config_name,
            budget=self.job.sampling.max_new_tokens,
            context=context,
            long_prompts=self.job.rollouts.long_prompts,
            dataset=dataset,
            own=self.own,
        )
        if left_out:
            self.own -= left_out
            kept = {b: [pid for pid in batch if pid not in left_out] for b, batch in self.batches.items()}
            self.batches = {b: batch for b, batch in kept.items() if self.own & set(batch)}

    def records(self, batch: list[str], work_kv: Path, kv_dir: Path) -> list[dict]:
        """The rows of one batch's rollouts of this shard's problems, their KV files written to ``work_kv``."""
        job, tokenizer = self.job, self.engine.tokenizer
        requests = [
            RolloutRequest(pid, self.prompts[pid], derive_seed(job.seed, job.config_name, "rollout", pid, r), rollout=r)
            for pid in batch
            for r in range(job.rollouts.per_problem)
        ]
        spans = {}  # the answer span, computed once: keep_len needs it before the record does
        phases = self.engine.phases  # host work on the rows, timed apart from the engine's own phases

        def keep_len(r: Rollout) -> int:
            if r.problem_id not in self.own:
                return 0  # another shard's row, generated only for its batch's sake: nothing kept
            with phases("choose pivots"):
                span = spans[(r.problem_id, r.rollout)] = answer_token_span(tokenizer, r.response_ids)
                _, chosen = rollout_pivots(
                    {
                        "problem_id": r.problem_id,
                        "rollout": r.rollout,
                        "prompt_ids": r.prompt_ids,
                        "response_ids": r.response_ids,
                        "topk_ids": r.topk_ids,
                        "topk_logprobs": r.topk_logprobs,
                        "special_ids": self.special,
                        "answer_span": span,
                    },
                    job.rules,
                    job.seed,
                    job.config_name,
                )
            return len(r.prompt_ids) + max(chosen) if chosen else 0

        records = []
        generated = self.engine.generate_rollouts(requests, job.sampling, work_kv, keep_len)
        with phases("records"):
            for rollout in generated:
                if rollout.problem_id not in self.own:
                    continue
                key = (rollout.problem_id, rollout.rollout)
                span = spans[key] if key in spans else answer_token_span(tokenizer, rollout.response_ids)
                gold = self.by_id[rollout.problem_id]["gold"]
                record = rollout_record(rollout, tokenizer, gold, span, self.special)
                if record["kv_file"]:
                    record["kv_file"] = str(Path(kv_dir) / Path(record["kv_file"]).name)
                records.append(record)
        return records


def link_or_copy(source: str, target: str) -> None:
    """A hard link where the file system allows one (KV files are large and never modified in place: a rerun
    writes new files and renames them over), a copy otherwise."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def gather(shards: list[pl.DataFrame]) -> pl.DataFrame:
    """One table from the rollout shards, in shard order; ``kv_file`` keeps only the file name.

    The folder a KV file sits in names its shard, and the gathered table must not depend on the shard size:
    passes find each file again among the shard folders they are given (``continuations.kv_locations``).
    """
    frame = pl.concat(shards, how="diagonal_relaxed")
    if "problem_id" not in frame.columns:
        raise ValueError(
            f"none of the {len(shards)} rollout shards has a rollout: every problem's prompt was left "
            "out as past the context (rollouts.long_prompts: skip; each shard's log names them)"
        )
    keys = frame.select("problem_id", "rollout")
    duplicated = keys.filter(keys.is_duplicated())["problem_id"].unique().to_list()
    if duplicated:
        raise ValueError(f"problems {sorted(duplicated)[:5]} appear in more than one rollout shard")
    return frame.with_columns(pl.col("kv_file").map_elements(lambda f: Path(f).name, return_dtype=pl.Utf8))


def _resumable(record_path: Path, work_kv: Path) -> bool:
    """A finished batch counts only if every KV file it names is still in the scratch folder."""
    if not intact_scratch(record_path):
        return False
    files = pl.read_parquet(record_path, columns=["kv_file"])["kv_file"].drop_nulls()
    return all((work_kv / Path(f).name).is_file() for f in files)
