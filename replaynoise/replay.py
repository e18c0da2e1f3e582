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
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl

from replaynoise.engines.base import ContinuationRequest, Engine, SamplingSettings
from replaynoise.grading import extract_answer, is_correct
from replaynoise.io import intact_scratch, keyed_scratch, write_parquet
from replaynoise.passes import BRANCHES, pass_spec, schedule_of
from replaynoise.progress import Phases, TokenProgress
from replaynoise.seeds import derive_seed
from replaynoise.shards import batch_range


def continuation_seed(seed: int, config_name: str, pivot_id: str, branch: str, k: int, noise: str) -> int:
    """Common random numbers: the seed ignores the pass, so every 'crn' pass draws the same noise per row."""
    return derive_seed(seed, config_name, noise, pivot_id, branch, k)


def schedule_seed(seed: int, config_name: str, pass_name: str) -> int:
    return derive_seed(seed, config_name, "schedule", pass_name)


def kv_locations(kv_dirs: Sequence[Path]) -> dict[str, str]:
    """Where each stored KV file is, by file name, across the rollout shards' folders.

    Hidden files (Snakemake's ``.snakemake_timestamp`` in every directory output) are not KV files.
    """
    found: dict[str, str] = {}
    for folder in kv_dirs:
        for path in sorted(Path(folder).iterdir()):
            if path.name.startswith("."):
                continue
            if path.name in found:
                raise ValueError(f"KV file {path.name} is in two shard folders: {found[path.name]} and {path}")
            found[path.name] = str(path)
    return found


def kv_index(kv_dirs: Sequence[Path]) -> dict:
    """What the passes read of the rollout shards' KV folders: the folders and each file's size. One small file
    stands between every pass shard and all KV folders, so the plan grows with the shard count, not its
    square (every pass shard may read any rollout's KV: its batches are drawn from the whole pass)."""
    return {"folders": [str(d) for d in kv_dirs],
            "files": {name: {"path": path, "bytes": Path(path).stat().st_size}
                      for name, path in sorted(kv_locations(kv_dirs).items())}}


def build_requests(pivots: pl.DataFrame, rollouts: pl.DataFrame, *, pass_name: str, k: int, seed: int,
                   config_name: str, tokenizer=None, kv_dirs: Sequence[Path] | None = None
                   ) -> list[ContinuationRequest]:
    """2 branches x K requests per pivot, in pivot order; identical across passes but for the noise stream.

    With ``kv_dirs`` (the rollout shards' KV folders) the rollouts' ``kv_file`` is a file name looked up there,
    as in the gathered rollouts table; without, it is used as a path.
    """
    spec = pass_spec(pass_name)
    by_rollout = {(r["problem_id"], r.get("rollout", 0)): r for r in rollouts.iter_rows(named=True)}
    located = kv_locations(kv_dirs) if kv_dirs is not None else None
    requests = []
    for p in pivots.iter_rows(named=True):
        r = by_rollout[(p["problem_id"], p.get("rollout", 0))]
        kv_file = r["kv_file"]
        if located is not None and kv_file is not None:
            if kv_file not in located:
                raise FileNotFoundError(
                    f"KV file {kv_file} of problem {p['problem_id']} is in none of the rollout shard folders "
                    f"{[str(d) for d in kv_dirs]}: it was deleted or moved after generate_rollouts wrote it. The "
                    f"rollouts step rebuilds it (snakemake --forcerun generate_rollouts, or delete the KV folder "
                    f"of the problem's shard and run again); the KV cannot be recomputed by a pass")
            kv_file = located[kv_file]
        prefix = tuple(r["prompt_ids"] + r["response_ids"][: p["t"]])
        text_ids = None
        if spec.source.kind == "refeed_text":
            if tokenizer is None:
                raise ValueError("refeed_text needs the tokenizer to re-tokenize the prefix")
            text = tokenizer.decode(list(prefix), skip_special_tokens=False)
            text_ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        for branch, token in zip(BRANCHES, (p["orig_token"], p["sub_token"])):
            for j in range(k):
                requests.append(ContinuationRequest(
                    pivot_id=p["pivot_id"], branch=branch, k=j,
                    seed=continuation_seed(seed, config_name, p["pivot_id"], branch, j, spec.noise),
                    prefix_ids=prefix, branch_token=int(token), kv_file=kv_file, kv_sha256=r["kv_sha256"],
                    expected_digest=r["logits_digests"][p["t"]], text_prefix_ids=text_ids,
                    response_start=len(r["prompt_ids"])))
    return requests


def probe_requests(requests: list[ContinuationRequest]) -> list[ContinuationRequest]:
    """The greedy probe of each branch (the paper's channel): the k = 0 request of every (pivot, branch), run
    greedily for a fixed budget; its rows carry k = -1 until ``gather`` moves them onto the k = 0 rows."""
    return [replace(req, k=PROBE_K) for req in requests if req.k == 0]


def pivot_sample(pivots: pl.DataFrame, n: int, seed: int) -> pl.DataFrame:
    """A seeded sample of ``n`` pivots (all of them when there are fewer), in the frame's order: the same pivots
    for a given seed whatever the shard count or a resume."""
    if n >= pivots.height:
        return pivots
    ids = sorted(pivots["pivot_id"].to_list())
    chosen = set(np.random.default_rng(seed).choice(len(ids), size=n, replace=False).tolist())
    keep = {ids[i] for i in chosen}
    return pivots.filter(pl.col("pivot_id").is_in(keep))


def make_schedule(n_rows: int, batch_size: int, seed: int) -> list[list[int]]:
    """Shuffle the rows with the pass's schedule seed and cut them into batches, as arrival order would."""
    order = np.random.default_rng(seed).permutation(n_rows)
    return [sorted(int(i) for i in order[s:s + batch_size]) for s in range(0, n_rows, batch_size)]


#: Pivots a message names one by one; the rest it counts.
NAMED = 5


def check_continuation_room(units: Sequence[tuple], pivots: pl.DataFrame, *, context: int | None, config_name: str,
                            pass_name: str) -> None:
    """Refuse, before any continuation, the pivots whose prefix (prompt and response up to the pivot), branch token
    and continuation budget run past ``context``: the rollout step checked only the prompt and the rollout, and
    a continuation past the model's positions would still be graded. ``units`` are ``run_pass``'s (kind,
    requests, sampling, schedule seed); None: the context is unknown, nothing to check."""
    if context is None:
        return
    over: dict[str, tuple[int, int, str]] = {}
    for kind, requests, sampling, _ in units:
        key = "replay.probe_tokens" if kind == "probe" else "replay.max_new_tokens"
        for req in requests:
            prefix = len(req.text_prefix_ids if req.text_prefix_ids is not None else req.prefix_ids)
            if prefix + 1 + sampling.max_new_tokens > context and req.pivot_id not in over:
                over[req.pivot_id] = (prefix, sampling.max_new_tokens, key)
    if not over:
        return
    problem_of = dict(zip(pivots["pivot_id"], pivots["problem_id"]))
    named = [f"pivot {pid} of problem {problem_of[pid]}: {prefix} prefix tokens + 1 branch token + {budget} "
             f"({key}) = {prefix + 1 + budget}" for pid, (prefix, budget, key) in list(over.items())[:NAMED]]
    more = [f"and {len(over) - NAMED} more"] if len(over) > NAMED else []
    room = context - 1 - max(prefix for prefix, _, _ in over.values())
    keys = " and ".join(sorted({key for _, _, key in over.values()}))
    fixes = ([f"lower {keys} to {room} or less"] if room > 0 else []) + [
        f"raise the context (configs.{config_name}.vllm.max_model_len or invariant_context where set, else a model "
        "with more positions)", "shorten or remove these problems' questions"]
    raise ValueError(
        f"configuration {config_name}, pass {pass_name}: {len(over)} pivot(s) leave their continuations too few of "
        f"the {context}-position context (the prompt and the response up to the pivot, the branch token and the "
        "continuation budget together): " + "; ".join(named + more) + ". Either " + ", or ".join(fixes))


def run_pass(engine: Engine, pivots: pl.DataFrame, rollouts: pl.DataFrame, *, pass_name: str, config_name: str,
             seed: int, k: int, sampling: SamplingSettings, batch_size: int, work_dir: Path,
             shard: tuple[int, int] = (0, 1), kv_dirs: Sequence[Path] | None = None, probe_tokens: int = 0,
             scratch_key: str = "", sample_sizes: Mapping[str, int] | None = None,
             context: int | None = None) -> pl.DataFrame:
    """Run (or resume) one pass, or shard ``(index, count)`` of it; returns one graded row per continuation
    (and, with ``probe_tokens``, one greedy probe row per branch, k = -1, that ``gather`` folds in).

    The schedule is always that of the whole pass (``replaynoise.shards``), so sharding never changes a batch.
    A pass whose spec fixes its batch rows (``serial``: 1) runs so whatever ``batch_size`` says; one whose spec
    names a sample key runs on a seeded sample of the pivots of the size ``sample_sizes`` gives under that key.
    Every request must fit ``context`` (``models.engine_context``; ``check_continuation_room``).
    """
    spec = pass_spec(pass_name)
    if spec.sample_key is not None:
        if not sample_sizes or spec.sample_key not in sample_sizes:
            raise ValueError(f"pass {pass_name!r} runs on a sample of the pivots sized by replay.{spec.sample_key}, "
                             "which was not given")
        pivots = pivot_sample(pivots, sample_sizes[spec.sample_key],
                              derive_seed(seed, config_name, "sample", pass_name))
    batch_size = spec.batch_rows or batch_size
    requests = build_requests(pivots, rollouts, pass_name=pass_name, k=k, seed=seed, config_name=config_name,
                              tokenizer=engine.tokenizer, kv_dirs=kv_dirs)
    # a control pass packs its batches as the pass it varies does (PassSpec.schedule)
    layout = schedule_of(pass_name)
    sched_seed = schedule_seed(seed, config_name, layout)
    work_dir = keyed_scratch(work_dir, scratch_key)
    units = [("batch", requests, sampling, sched_seed)]
    if probe_tokens:
        units.append(("probe", probe_requests(requests), SamplingSettings(0.0, 1.0, probe_tokens),
                      schedule_seed(seed, config_name, f"{layout}:probe")))
    check_continuation_room(units, pivots, context=context, config_name=config_name, pass_name=pass_name)
    todo = []
    for kind, reqs, samp, sseed in units:
        all_batches = make_schedule(len(reqs), batch_size, sseed)
        reqs = with_restep_once(reqs, all_batches if kind == "batch" else [])
        mine = batch_range(shard[0], shard[1], len(all_batches))
        todo += [(kind, b, [reqs[i] for i in all_batches[b]], samp, sseed) for b in mine]
    done = {p.stem for p in work_dir.glob("*.parquet") if intact_scratch(p)}
    rows_done = sum(len(batch) for kind, b, batch, *_ in todo if f"{kind}_{b:05d}" in done)
    label = f"{pass_name} {config_name}" + (f" shard {shard[0] + 1}/{shard[1]}" if shard[1] > 1 else "")
    progress = TokenProgress(sum(len(batch) for _, _, batch, *_ in todo), label, initial=rows_done)
    golds = dict(zip(rollouts["problem_id"], rollouts["gold"]))
    pivot_problem = dict(zip(pivots["pivot_id"], pivots["problem_id"]))
    pivot_t = dict(zip(pivots["pivot_id"], pivots["t"]))
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
            results = engine.run_batch(batch, spec.source, samp)
            with grading("grade"):
                records = graded_records(batch, results, engine.tokenizer, spec.source.label, batch_id, sseed, golds,
                                         pivot_problem, pivot_t, engine.stop_ids)
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


def graded_records(batch: list[ContinuationRequest], results: list, tokenizer, source: str, batch_id: int,
                   sseed: int, golds: dict, pivot_problem: dict, pivot_t: dict,
                   stop_ids: set[int] | frozenset = frozenset()) -> list[dict]:
    """One batch's rows: each continuation decoded as part of its whole response and graded.

    The response ends at its first stop token (``configs.X.stop``): a branch token that is one (a pivot at the
    end of the answer line) ends the answer there, whatever the engine samples after it."""
    records = []
    # The K draws of a branch often agree, and a problem has few distinct answers: each response is decoded
    # and read once per batch, each (answer, gold) graded once.
    read: dict[tuple[int, ...], tuple[str, str | None]] = {}
    graded: dict[tuple[str | None, str], bool] = {}
    for req, res in zip(batch, results):
        prompt_len = len(req.prefix_ids) - pivot_t[req.pivot_id]
        response = (*req.prefix_ids[prompt_len:], req.branch_token, *res.token_ids)
        end = next((j for j, t in enumerate(response) if t in stop_ids), None)
        response = response if end is None else response[:end + 1]
        if response not in read:
            text = tokenizer.decode(list(response), skip_special_tokens=True)
            read[response] = text, extract_answer(text)
        text, answer = read[response]
        gold = golds[pivot_problem[req.pivot_id]]
        if (answer, gold) not in graded:
            graded[answer, gold] = is_correct(answer, gold)
        records.append({
            "pivot_id": req.pivot_id, "problem_id": pivot_problem[req.pivot_id], "branch": req.branch,
            "k": req.k, "branch_token": req.branch_token, "seed": req.seed, "schedule_seed": sseed,
            "batch_id": batch_id, "batch_size": len(batch), "prefix_source": source,
            "verified": res.verified, "prefix_len": res.prefix_len, "token_ids": res.token_ids, "text": text,
            "answer": answer, "correct": graded[answer, gold],
            "finish_reason": res.finish_reason, "n_tokens": len(res.token_ids),
            "next_topk_ids": res.next_topk_ids, "next_topk_logprobs": res.next_topk_logprobs,
            "next_digest": res.next_digest, "kv_maxdiff": res.kv_maxdiff,
            "cached_tokens": res.cached_tokens, "expected_cached_tokens": res.expected_cached_tokens,
            "tail_tokens": None if res.cached_tokens is None else res.prefix_len - res.cached_tokens,
            "restep_match": res.restep_match, "probe_ids": None, "probe_logprob": None,
            "prefix_logprobs": res.prefix_logprobs,
        })
    return records


def gather(shards: list[pl.DataFrame]) -> pl.DataFrame:
    """One pass table from its shards (or batches), in the canonical row order, whatever the split.

    Probe rows (k = -1) leave the table: their tokens and first-token log-prob become ``probe_ids`` and
    ``probe_logprob`` of the branch's k = 0 row (null elsewhere, and everywhere when no probe ran)."""
    frame = pl.concat(shards) if shards else pl.DataFrame(schema=PASS_SCHEMA)
    if not (frame["k"] == PROBE_K).any():  # no probe ran, or already gathered
        return frame.select(list(PASS_SCHEMA)).sort("pivot_id", "branch", "k")
    probes = frame.filter(pl.col("k") == PROBE_K).select(
        "pivot_id", "branch", pl.lit(0, dtype=pl.Int64).alias("k"), pl.col("token_ids").alias("probe_ids__p"),
        pl.col("next_topk_logprobs").list.first().alias("probe_logprob__p"))
    rows = frame.filter(pl.col("k") != PROBE_K).join(probes, on=["pivot_id", "branch", "k"], how="left")
    rows = rows.with_columns(pl.col("probe_ids__p").alias("probe_ids"),
                             pl.col("probe_logprob__p").alias("probe_logprob")).drop("probe_ids__p",
                                                                                     "probe_logprob__p")
    return rows.select(list(PASS_SCHEMA)).sort("pivot_id", "branch", "k")


PASS_SCHEMA = {
    "pivot_id": pl.Utf8, "problem_id": pl.Utf8, "branch": pl.Utf8, "k": pl.Int64, "branch_token": pl.Int64,
    "seed": pl.Int64, "schedule_seed": pl.Int64, "batch_id": pl.Int64, "batch_size": pl.Int64,
    "prefix_source": pl.Utf8, "verified": pl.Boolean, "prefix_len": pl.Int64, "token_ids": pl.List(pl.Int64),
    "text": pl.Utf8, "answer": pl.Utf8, "correct": pl.Boolean, "finish_reason": pl.Utf8, "n_tokens": pl.Int64,
    "next_topk_ids": pl.List(pl.Int64), "next_topk_logprobs": pl.List(pl.Float64), "next_digest": pl.Utf8,
    "kv_maxdiff": pl.List(pl.Float64),
    # prefix-cache accounting: prefix positions read from stored/cached KV, the number a faithful resume must
    # read (decode_kv), and the rest of the prefix, recomputed by prefill (HF decode_kv: all stored, tail 0)
    "cached_tokens": pl.Int64, "expected_cached_tokens": pl.Int64, "tail_tokens": pl.Int64,
    # decode_kv: a re-step of the last prefix token over the stored KV reproduced the rollout bitwise (measured)
    "restep_match": pl.Boolean,
    # the branch's greedy probe (k = 0 rows): its tokens, and the log-prob of its first token
    "probe_ids": pl.List(pl.Int64), "probe_logprob": pl.Float64,
    # a pass that builds its prefix state: the log-probs its prefill gave the prefix's response tokens, on the
    # one row per pivot that measures the pivot's once-per-pivot channels (null elsewhere)
    "prefix_logprobs": pl.List(pl.Float64),
}
#: the k of probe rows until ``gather`` folds them into the k = 0 rows
PROBE_K = -1


def continuation_sampling(settings: Mapping, replay: Mapping) -> SamplingSettings:
    """How a pass samples its continuations: the configuration's temperature and top_p unless ``replay`` sets its
    own (null: the configuration's, as the schema says; a temperature of 0 is greedy), ``replay.max_new_tokens``
    tokens."""
    return SamplingSettings(settings["temperature"] if replay["temperature"] is None else replay["temperature"],
                            settings["top_p"] if replay["top_p"] is None else replay["top_p"],
                            replay["max_new_tokens"])
