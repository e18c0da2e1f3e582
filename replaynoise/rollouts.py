"""Rollout generation: one seeded rollout per problem, with the decode-time KV each later pivot can need.

Work is kept per problem in a scratch folder, so a killed step resumes where it stopped; a rollout depends
only on its own seed, so resumed and uninterrupted runs give the same bytes.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import polars as pl

from replaynoise.data import extract_answer, is_correct
from replaynoise.engines.base import Engine, Rollout, RolloutRequest, SamplingSettings
from replaynoise.seeds import derive_seed
from replaynoise.pivots import candidate_positions
from replaynoise.progress import TokenProgress
from replaynoise.provenance import write_parquet

PROMPT_STYLES = ("chat", "plain")
_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def prompt_ids(tokenizer, question: str, style: str, instruction: str) -> list[int]:
    """The prompt as token ids: the chat template for instruct models, a plain Q/A frame for base models."""
    text = f"{instruction} {question}".strip() if instruction else question
    if style == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("prompt.style is 'chat' but the model has no chat template; use prompt.style: plain")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    if style == "plain":
        return list(tokenizer(f"Question: {text}\nAnswer:", add_special_tokens=True)["input_ids"])
    raise ValueError(f"prompt.style must be one of {PROMPT_STYLES}, got {style!r}")


def char_offsets(tokenizer, ids: list[int]) -> list[int]:
    """Start character of each token in the decoded text (incremental decoding, so byte merges are honoured)."""
    return [len(tokenizer.decode(ids[:i], skip_special_tokens=False)) for i in range(len(ids) + 1)]


def answer_token_span(tokenizer, response_ids: list[int]) -> tuple[int, int] | None:
    """Token indices [start, end) covering the last number of the response: the final-answer span."""
    text = tokenizer.decode(response_ids, skip_special_tokens=False)
    matches = list(_LAST_NUMBER.finditer(text))
    if not matches:
        return None
    lo, hi = matches[-1].span()
    offsets = char_offsets(tokenizer, response_ids)
    tokens = [i for i in range(len(response_ids)) if offsets[i] < hi and offsets[i + 1] > lo]
    return (tokens[0], tokens[-1] + 1) if tokens else None


def rollout_record(rollout: Rollout, tokenizer, gold: str, span: tuple[int, int] | None) -> dict:
    """One rollouts.parquet row; ``span`` is the final-answer span (``answer_token_span``)."""
    text = tokenizer.decode(rollout.response_ids, skip_special_tokens=True)
    answer = extract_answer(text)
    return {
        "problem_id": rollout.problem_id, "prompt_ids": rollout.prompt_ids, "response_ids": rollout.response_ids,
        "topk_ids": rollout.topk_ids, "topk_logprobs": rollout.topk_logprobs,
        "logits_digests": rollout.logits_digests, "finish_reason": rollout.finish_reason, "text": text,
        "answer": answer, "gold": gold, "correct": is_correct(answer, gold),
        "answer_span": list(span) if span else None, "special_ids": sorted(tokenizer.all_special_ids),
        "kv_file": rollout.kv_file, "kv_len": rollout.kv_len, "kv_sha256": rollout.kv_sha256,
    }


def generate(engine: Engine, problems: pl.DataFrame, *, config_name: str, seed: int, sampling: SamplingSettings,
             style: str, instruction: str, max_margin: float, kv_dir: Path, work_dir: Path) -> pl.DataFrame:
    """Generate (or resume) all rollouts of one configuration; KV files end in ``kv_dir``."""
    tokenizer = engine.tokenizer
    parts, work_kv = Path(work_dir) / "records", Path(work_dir) / "kv"
    parts.mkdir(parents=True, exist_ok=True)
    work_kv.mkdir(parents=True, exist_ok=True)
    done = {p.stem for p in parts.glob("*.parquet") if _resumable(p, work_kv)}
    progress = TokenProgress(problems.height, f"rollouts {config_name}", initial=len(done))
    special = set(tokenizer.all_special_ids)

    for row in problems.iter_rows(named=True):
        if row["problem_id"] in done:
            continue
        request = RolloutRequest(row["problem_id"], tuple(prompt_ids(tokenizer, row["question"], style, instruction)),
                                 derive_seed(seed, config_name, "rollout", row["problem_id"]))

        spans = {}  # the answer span, computed once: keep_len needs it before the record does

        def keep_len(r: Rollout) -> int:
            span = spans[r.problem_id] = answer_token_span(tokenizer, r.response_ids)
            cands = candidate_positions(r.response_ids, r.topk_ids, r.topk_logprobs, special, span, max_margin)
            return len(r.prompt_ids) + max(cands) if cands else 0

        (rollout,) = engine.generate_rollouts([request], sampling, work_kv, keep_len)
        span = spans.get(rollout.problem_id) or answer_token_span(tokenizer, rollout.response_ids)
        record = rollout_record(rollout, tokenizer, row["gold"], span)
        if record["kv_file"]:
            record["kv_file"] = str(Path(kv_dir) / Path(record["kv_file"]).name)
        write_parquet(pl.DataFrame([record]), parts / f"{row['problem_id']}.parquet")
        progress.rows(1, len(rollout.response_ids))
    progress.close()

    frame = pl.concat([pl.read_parquet(parts / f"{pid}.parquet") for pid in problems["problem_id"]],
                      how="diagonal_relaxed")
    # Copy, not move: the scratch copy must survive until the step's outputs are all in place.
    if Path(kv_dir).exists():
        shutil.rmtree(kv_dir)
    shutil.copytree(work_kv, kv_dir)
    return frame


def gather(shards: list[pl.DataFrame]) -> pl.DataFrame:
    """One table from the rollout shards, in shard order; ``kv_file`` keeps only the file name.

    The folder a KV file sits in names its shard, and the gathered table must not depend on the shard size:
    passes find each file again among the shard folders they are given (``replay.kv_locations``).
    """
    frame = pl.concat(shards, how="diagonal_relaxed")
    duplicated = frame["problem_id"].filter(frame["problem_id"].is_duplicated()).unique().to_list()
    if duplicated:
        raise ValueError(f"problems {sorted(duplicated)[:5]} appear in more than one rollout shard")
    return frame.with_columns(pl.col("kv_file").map_elements(lambda f: Path(f).name, return_dtype=pl.Utf8))


def _resumable(record_path: Path, work_kv: Path) -> bool:
    """A finished record counts only if the KV file it names is still in the scratch folder."""
    kv_file = pl.read_parquet(record_path, columns=["kv_file"])["kv_file"][0]
    return kv_file is None or (work_kv / Path(kv_file).name).is_file()
