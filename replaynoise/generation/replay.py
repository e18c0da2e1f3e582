"""Replay passes: the same continuation requests, replayed from different prefix states.

A pass turns every pivot into 2 branches x K continuation requests, packs them into batches by its own
schedule seed (so a replica meets different batch compositions, as on a stock serving engine), runs the
batches through the engine and grades each continuation. Batches are written to a scratch folder as they
finish: a killed pass resumes without redoing them, and since the schedule is fixed by its seed the resumed
result is the same as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import polars as pl

from replaynoise.data.grading import extract_answer, is_correct
from replaynoise.engines.base import ContinuationRequest, Engine, SamplingSettings
from replaynoise.generation.continuations import (
    PROBE_K,
    build_requests,
    check_continuation_room,
    make_schedule,
    pivot_sample,
    probe_requests,
    schedule_seed,
)
from replaynoise.generation.passes import pass_spec, schedule_of
from replaynoise.generation.shards import batch_range
from replaynoise.io import intact_scratch, write_parquet
from replaynoise.progress import Phases, TokenProgress
from replaynoise.seeds import derive_seed
from replaynoise.settings import ReplaySettings


@dataclass(frozen=True)
class PassJob:
    """What one pass of a configuration replays, whatever its shard: the pass, the configuration's name and
    seed, how its continuations sample, and the replay block's sizes."""

    pass_name: str
    config_name: str
    seed: int
    sampling: SamplingSettings
    replay: ReplaySettings


def run_pass(
    engine: Engine,
    pivots: pl.DataFrame,
    rollouts: pl.DataFrame,
    job: PassJob,
    *,
    work_dir: Path,
    shard: tuple[int, int] = (0, 1),
    kv_dirs: Sequence[Path] | None = None,
    context: int | None = None,
) -> pl.DataFrame:
    """Run (or resume) one pass, or shard ``(index, count)`` of it; returns one graded row per continuation
    (and, with ``probe_tokens``, one greedy probe row per branch, k = -1, that ``gather`` folds in). ``work_dir``
    is the step's scratch, keyed by what produced it (``io.keyed_scratch``).

    The schedule is always that of the whole pass (``replaynoise.generation.shards``), so sharding never changes a
    batch.
    A pass whose spec fixes its batch rows (``serial``: 1) runs so whatever ``batch_size`` says; one whose spec
    names a sample key runs on a seeded sample of the pivots of the size the replay block gives under that key.
    Every request must fit ``context`` (``models.engine_context``; ``check_continuation_room``).
    """
    pivots = _sampled(pivots, job)
    todo = _batches(engine, pivots, rollouts, job, shard, kv_dirs, context)
    work_dir = Path(work_dir)
    done = {p.stem for p in work_dir.glob("*.parquet") if intact_scratch(p)}
    rows_done = sum(len(batch) for kind, b, batch, *_ in todo if f"{kind}_{b:05d}" in done)
    label = f"{job.pass_name} {job.config_name}" + (f" shard {shard[0] + 1}/{shard[1]}" if shard[1] > 1 else "")
    progress = TokenProgress(sum(len(batch) for _, _, batch, *_ in todo), label, initial=rows_done)
    grader = Grader(engine.tokenizer, rollouts, pivots, engine.stop_ids)
    source = pass_spec(job.pass_name).source
    grading, writing = Phases(), Phases()

    def write(kind, batch_id, records) -> None:
        with writing("write (beside the engine)"):
            write_parquet(pl.DataFrame(records, schema=PASS_SCHEMA), work_dir / f"{kind}_{batch_id:05d}.parquet")

    # Grading stays on the main thread (symbolic grading's timeout is a SIGALRM, which only the main thread
    # may use); building and writing a batch's table run in a thread while the engine runs the next batch. A
    # resume counts a batch as done only once its file is written.
    with ThreadPoolExecutor(1) as writer:
        pending: list[Future] = []
        for kind, batch_id, batch, samp, sseed in todo:
            if f"{kind}_{batch_id:05d}" in done:
                continue
            results = engine.run_batch(batch, source, samp)
            with grading("grade"):
                records = grader.records(batch, results, source.label, batch_id, sseed)
            pending.append(writer.submit(write, kind, batch_id, records))
            for future in [f for f in pending if f.done()]:
                future.result()  # a failed write stops the pass here, not at the end
                pending.remove(future)
            progress.rows(len(batch), sum(len(r.token_ids) for r in results))
        for future in pending:
            future.result()
    progress.close(engine.phases, grading, writing)
    parts = [pl.read_parquet(work_dir / f"{kind}_{b:05d}.parquet") for kind, b, *_ in todo]
    frame = pl.concat(parts) if parts else pl.DataFrame(schema=PASS_SCHEMA)
    return gather([frame]) if shard[1] == 1 else frame  # a shard's probes may belong to another's rows


def _sampled(pivots: pl.DataFrame, job: PassJob) -> pl.DataFrame:
    """The pivots a pass runs on: all, or for a pass whose spec names a sample key, a seeded sample of them."""
    key = pass_spec(job.pass_name).sample_key
    if key is None:
        return pivots
    if key not in job.replay.sample_sizes:
        raise ValueError(
            f"pass {job.pass_name!r} runs on a sample of the pivots sized by replay.{key}, which was not given"
        )
    return pivot_sample(
        pivots, job.replay.sample_sizes[key], derive_seed(job.seed, job.config_name, "sample", job.pass_name)
    )


def _batches(
    engine: Engine,
    pivots: pl.DataFrame,
    rollouts: pl.DataFrame,
    job: PassJob,
    shard: tuple[int, int],
    kv_dirs: Sequence[Path] | None,
    context: int | None,
) -> list[tuple]:
    """This shard's batches of the whole pass's schedule, (kind, batch id, requests, sampling, schedule seed),
    the continuations' first and then, with probe tokens, the probes'."""
    seed, config_name, pass_name = job.seed, job.config_name, job.pass_name
    batch_size = pass_spec(pass_name).batch_rows or job.replay.batch_size
    requests = build_requests(
        pivots,
        rollouts,
        pass_name=pass_name,
        k=job.replay.k,
        seed=seed,
        config_name=config_name,
        tokenizer=engine.tokenizer,
        kv_dirs=kv_dirs,
    )
    # a control pass packs its batches as the pass it varies does (PassSpec.schedule)
    layout = schedule_of(pass_name)
    units = [("batch", requests, job.sampling, schedule_seed(seed, config_name, layout))]
    if job.replay.probe_tokens:
        units.append(
            (
                "probe",
                probe_requests(requests),
                SamplingSettings(0.0, 1.0, job.replay.probe_tokens),
                schedule_seed(seed, config_name, f"{layout}:probe"),
            )
        )
    check_continuation_room(units, pivots, context=context, config_name=config_name, pass_name=pass_name)
    todo = []
    for kind, reqs, samp, sseed in units:
        all_batches = make_schedule(len(reqs), batch_size, sseed)
        reqs = with_restep_once(reqs, all_batches if kind == "batch" else [])
        mine = batch_range(shard[0], shard[1], len(all_batches))
        todo += [(kind, b, [reqs[i] for i in all_batches[b]], samp, sseed) for b in mine]
    return todo


def with_restep_once(requests: list[ContinuationRequest], schedule: list[list[int]]) -> list[ContinuationRequest]:
    """Ask for the once-per-pivot channels (the re-step; a built prefix's tokens' log-probs) on the pivot's first
    row in the whole pass's schedule (so neither a shard nor a resume changes which batch measures it); nowhere
    when ``schedule`` is empty (probe rows)."""
    first: dict[str, int] = {}
    for rows in schedule:
        for i in rows:
            first.setdefault(requests[i].pivot_id, i)
    chosen = set(first.values())
    return [replace(req, restep=i in chosen) for i, req in enumerate(requests)]


class Grader:
    """Decodes each continuation as part of its whole response and grades it against its problem's answer."""

    def __init__(self, tokenizer, rollouts: pl.DataFrame, pivots: pl.DataFrame, stop_ids: set[int] | frozenset) -> None:
        self.tokenizer, self.stop_ids = tokenizer, stop_ids
        self.golds = dict(zip(rollouts["problem_id"], rollouts["gold"]))
        self.problem = dict(zip(pivots["pivot_id"], pivots["problem_id"]))
        self.t = dict(zip(pivots["pivot_id"], pivots["t"]))

    def records(
        self, batch: list[ContinuationRequest], results: list, source: str, batch_id: int, sseed: int
    ) -> list[dict]:
        """One batch's rows. The response ends at its first stop token (``configs.X.stop``): a branch token that
        is one (a pivot at the end of the answer line) ends the answer there, whatever the engine samples after
        it."""
        records = []
        # The K draws of a branch often agree, and a problem has few distinct answers: each response is decoded
        # and read once per batch, each (answer, gold) graded once.
        read: dict[tuple[int, ...], tuple[str, str | None]] = {}
        graded: dict[tuple[str | None, str], bool] = {}
        for req, res in zip(batch, results):
            prompt_len = len(req.prefix_ids) - self.t[req.pivot_id]
            response = (*req.prefix_ids[prompt_len:], req.branch_token, *res.token_ids)
            end = next((j for j, t in enumerate(response) if t in self.stop_ids), None)
            response = response if end is None else response[: end + 1]
            if response not in read:
                text = self.tokenizer.decode(list(response), skip_special_tokens=True)
                read[response] = text, extract_answer(text)
            text, answer = read[response]
            gold = self.golds[self.problem[req.pivot_id]]
            if (answer, gold) not in graded:
                graded[answer, gold] = is_correct(answer, gold)
            records.append(
                _record(req, res, self.problem[req.pivot_id], text, answer, graded[answer, gold])
                | {"schedule_seed": sseed, "batch_id": batch_id, "batch_size": len(batch), "prefix_source": source}
            )
        return records


def _record(req: ContinuationRequest, res, problem_id: str, text: str, answer: str | None, correct: bool) -> dict:
    """A continuation's row but for its batch's columns."""
    return {
        "pivot_id": req.pivot_id,
        "problem_id": problem_id,
        "branch": req.branch,
        "k": req.k,
        "branch_token": req.branch_token,
        "seed": req.seed,
        "verified": res.verified,
        "prefix_len": res.prefix_len,
        "token_ids": res.token_ids,
        "text": text,
        "answer": answer,
        "correct": correct,
        "finish_reason": res.finish_reason,
        "n_tokens": len(res.token_ids),
        "next_topk_ids": res.next_topk_ids,
        "next_topk_logprobs": res.next_topk_logprobs,
        "next_digest": res.next_digest,
        "kv_maxdiff": res.kv_maxdiff,
        "cached_tokens": res.cached_tokens,
        "expected_cached_tokens": res.expected_cached_tokens,
        "tail_tokens": None if res.cached_tokens is None else res.prefix_len - res.cached_tokens,
        "restep_match": res.restep_match,
        "probe_ids": None,
        "probe_logprob": None,
        "prefix_logprobs": res.prefix_logprobs,
    }


def gather(shards: list[pl.DataFrame]) -> pl.DataFrame:
    """One pass table from its shards (or batches), in the canonical row order, whatever the split.

    Probe rows (k = -1) leave the table: their tokens and first-token log-prob become ``probe_ids`` and
    ``probe_logprob`` of the branch's k = 0 row (null elsewhere, and everywhere when no probe ran)."""
    frame = pl.concat(shards) if shards else pl.DataFrame(schema=PASS_SCHEMA)
    if not (frame["k"] == PROBE_K).any():  # no probe ran, or already gathered
        return frame.select(list(PASS_SCHEMA)).sort("pivot_id", "branch", "k")
    probes = frame.filter(pl.col("k") == PROBE_K).select(
        "pivot_id",
        "branch",
        pl.lit(0, dtype=pl.Int64).alias("k"),
        pl.col("token_ids").alias("probe_ids__p"),
        pl.col("next_topk_logprobs").list.first().alias("probe_logprob__p"),
    )
    rows = frame.filter(pl.col("k") != PROBE_K).join(probes, on=["pivot_id", "branch", "k"], how="left")
    rows = rows.with_columns(
        pl.col("probe_ids__p").alias("probe_ids"), pl.col("probe_logprob__p").alias("probe_logprob")
    ).drop("probe_ids__p", "probe_logprob__p")
    return rows.select(list(PASS_SCHEMA)).sort("pivot_id", "branch", "k")


PASS_SCHEMA = {
    "pivot_id": pl.Utf8,
    "problem_id": pl.Utf8,
    "branch": pl.Utf8,
    "k": pl.Int64,
    "branch_token": pl.Int64,
    "seed": pl.Int64,
    "schedule_seed": pl.Int64,
    "batch_id": pl.Int64,
    "batch_size": pl.Int64,
    "prefix_source": pl.Utf8,
    "verified": pl.Boolean,
    "prefix_len": pl.Int64,
    "token_ids": pl.List(pl.Int64),
    "text": pl.Utf8,
    "answer": pl.Utf8,
    "correct": pl.Boolean,
    "finish_reason": pl.Utf8,
    "n_tokens": pl.Int64,
    "next_topk_ids": pl.List(pl.Int64),
    "next_topk_logprobs": pl.List(pl.Float64),
    "next_digest": pl.Utf8,
    "kv_maxdiff": pl.List(pl.Float64),
    # prefix-cache accounting: prefix positions read from stored/cached KV, the number a faithful resume must
    # read (decode_kv), and the rest of the prefix, recomputed by prefill (HF decode_kv: all stored, tail 0)
    "cached_tokens": pl.Int64,
    "expected_cached_tokens": pl.Int64,
    "tail_tokens": pl.Int64,
    # decode_kv: a re-step of the last prefix token over the stored KV reproduced the rollout bitwise (measured)
    "restep_match": pl.Boolean,
    # the branch's greedy probe (k = 0 rows): its tokens, and the log-prob of its first token
    "probe_ids": pl.List(pl.Int64),
    "probe_logprob": pl.Float64,
    # a pass that builds its prefix state: the log-probs its prefill gave the prefix's response tokens, on the
    # one row per pivot that measures the pivot's once-per-pivot channels (null elsewhere)
    "prefix_logprobs": pl.List(pl.Float64),
}


def continuation_sampling(settings: Mapping, replay: Mapping) -> SamplingSettings:
    """How a pass samples its continuations: the configuration's temperature and top_p unless ``replay`` sets its
    own (null: the configuration's, as the schema says; a temperature of 0 is greedy), ``replay.max_new_tokens``
    tokens."""
    return SamplingSettings(
        settings["temperature"] if replay["temperature"] is None else replay["temperature"],
        settings["top_p"] if replay["top_p"] is None else replay["top_p"],
        replay["max_new_tokens"],
    )
