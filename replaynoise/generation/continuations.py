"""A pass's continuation requests: 2 branches x K per pivot, identical across passes but for the noise stream
they draw (common random numbers), where each finds its stored KV, the seeded schedule that packs them into
batches, and the check that every continuation fits the engine's context."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl

from replaynoise.engines.base import ContinuationRequest
from replaynoise.generation.passes import BRANCHES, pass_spec
from replaynoise.seeds import derive_seed

#: the k of probe rows until ``gather`` folds them into the k = 0 rows
PROBE_K = -1


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
    return {
        "folders": [str(d) for d in kv_dirs],
        "files": {
            name: {"path": path, "bytes": Path(path).stat().st_size}
            for name, path in sorted(kv_locations(kv_dirs).items())
        },
    }


def build_requests(
    pivots: pl.DataFrame,
    rollouts: pl.DataFrame,
    *,
    pass_name: str,
    k: int,
    seed: int,
    config_name: str,
    tokenizer=None,
    kv_dirs: Sequence[Path] | None = None,
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
                    f"of the problem's shard and run again); the KV cannot be recomputed by a pass"
                )
            kv_file = located[kv_file]
        prefix = tuple(r["prompt_ids"] + r["response_ids"][: p["t"]])
        text_ids = None
        if spec.source.kind.retokenizes:
            if tokenizer is None:
                raise ValueError("refeed_text needs the tokenizer to re-tokenize the prefix")
            text = tokenizer.decode(list(prefix), skip_special_tokens=False)
            text_ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        for branch, token in zip(BRANCHES, (p["orig_token"], p["sub_token"])):
            for j in range(k):
                requests.append(
                    ContinuationRequest(
                        pivot_id=p["pivot_id"],
                        branch=branch,
                        k=j,
                        seed=continuation_seed(seed, config_name, p["pivot_id"], branch, j, spec.noise),
                        prefix_ids=prefix,
                        branch_token=int(token),
                        kv_file=kv_file,
                        kv_sha256=r["kv_sha256"],
                        expected_digest=r["logits_digests"][p["t"]],
                        text_prefix_ids=text_ids,
                        response_start=len(r["prompt_ids"]),
                    )
                )
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
    return [sorted(int(i) for i in order[s : s + batch_size]) for s in range(0, n_rows, batch_size)]


#: Pivots a message names one by one; the rest it counts.
NAMED = 5


def check_continuation_room(
    units: Sequence[tuple], pivots: pl.DataFrame, *, context: int | None, config_name: str, pass_name: str
) -> None:
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
    named = [
        f"pivot {pid} of problem {problem_of[pid]}: {prefix} prefix tokens + 1 branch token + {budget} "
        f"({key}) = {prefix + 1 + budget}"
        for pid, (prefix, budget, key) in list(over.items())[:NAMED]
    ]
    more = [f"and {len(over) - NAMED} more"] if len(over) > NAMED else []
    room = context - 1 - max(prefix for prefix, _, _ in over.values())
    keys = " and ".join(sorted({key for _, _, key in over.values()}))
    fixes = ([f"lower {keys} to {room} or less"] if room > 0 else []) + [
        f"raise the context (configs.{config_name}.vllm.max_model_len or invariant_context where set, else a model "
        "with more positions)",
        "shorten or remove these problems' questions",
    ]
    raise ValueError(
        f"configuration {config_name}, pass {pass_name}: {len(over)} pivot(s) leave their continuations too few of "
        f"the {context}-position context (the prompt and the response up to the pivot, the branch token and the "
        "continuation budget together): " + "; ".join(named + more) + ". Either " + ", or ".join(fixes)
    )
