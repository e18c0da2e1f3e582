"""Benchmark problems: a packaged benchmark (``replaynoise.data.benchmarks``) or a user's file loaded into one
shape, checked, and sampled."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replaynoise.data.benchmarks import (
    FILE_FIELDS,
    FILE_SOURCE,
    FILE_SUFFIXES,
    PACKAGED_DATASETS,
    PackagedDataset,
    packaged_file,
)
from replaynoise.data.grading import parse_gold
from replaynoise.io import UnreadableFileError, write_parquet

# -------------------------------------------------------------------------------------- loading and sampling

Record = tuple[str, dict[str, Any]]  # (location for messages, row)


def _jsonl_lines(path: Path, data: bytes | None = None) -> Iterator[tuple[int, str]]:
    """The non-blank lines with their numbers (of ``data``, the file's bytes as read, where given). Decoded one
    line at a time so that invalid UTF-8 is reported at its line (a text-mode file decodes ahead in chunks); a
    byte-order mark, as some Windows editors write, is dropped from the first line."""
    with open(path, "rb") if data is None else io.BytesIO(data) as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}:{line_no}: not valid UTF-8 ({err.reason} at byte {err.start + 1} of the line)"
                ) from None
            if line.strip():
                yield line_no, line


def _read_jsonl(path: Path, data: bytes) -> list[Record]:
    records = []
    for line_no, line in _jsonl_lines(path, data):
        try:
            obj = json.loads(line)
        except ValueError as exc:  # a decoding error, or a number past Python's digit limit
            raise ValueError(f"{path}:{line_no}: not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
        records.append((f"{path}:{line_no}", obj))
    return records


def _read_parquet(path: Path, data: bytes) -> list[Record]:
    try:
        rows = pl.read_parquet(io.BytesIO(data)).to_dicts()
    except pl.exceptions.PolarsError as exc:
        raise UnreadableFileError(f"{path}: not a readable parquet file, truncated or corrupt ({exc})") from None
    return [(f"{path}: row {i}", row) for i, row in enumerate(rows)]


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_SUFFIXES)}")


def _read_records(path: Path) -> tuple[list[Record], str]:
    """The rows of a problem file and the sha256 of the very bytes they were parsed from: a file edited while
    the workflow runs is recorded as it was read, not as it is when the run ends."""
    _check_file(path)
    data = path.read_bytes()
    records = _read_jsonl(path, data) if path.suffix == ".jsonl" else _read_parquet(path, data)
    if not records:
        raise ValueError(f"{path}: no problems")
    return records, hashlib.sha256(data).hexdigest()


def _count_records(path: Path) -> int:
    """Counted without parsing a row: parquet keeps its row count in the footer, jsonl is one problem a line."""
    _check_file(path)
    if path.suffix == ".parquet":
        return pl.scan_parquet(path).select(pl.len()).collect().item()
    return sum(1 for _ in _jsonl_lines(path))


def _field(row: dict[str, Any], name: str, where: str) -> Any:
    value = row.get(name)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{where}: missing field {name!r}")
    return value


def join_sentences(parts: list[str]) -> str:
    """SVAMP's Body often ends mid-sentence ("If there are 15 baskets"); close it with a period before the
    Question, as the common SVAMP evaluation scripts do, so the prompt reads as separate sentences."""
    parts = [p.strip() for p in parts]
    closed = [p if p.endswith((".", "?", "!")) else p + "." for p in parts[:-1]]
    return " ".join([*closed, parts[-1]])


def _problem(row: dict[str, Any], index: int, where: str, dataset: str, spec: PackagedDataset) -> dict:
    parts = [_field(row, f, where) for f in spec.question_fields]
    if not all(isinstance(p, str) for p in parts):
        raise ValueError(f"{where}: question fields {spec.question_fields} must be text")
    try:
        gold = parse_gold(_field(row, spec.answer_field, where))
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    own_id = row.get(spec.id_field) if spec.id_field else None
    suffix = index if own_id is None or str(own_id).strip() == "" else str(own_id).strip()
    problem_id = f"{dataset}-{suffix}"
    check_problem_id(problem_id, where)
    return {"problem_id": problem_id, "question": join_sentences(parts), "gold": gold, "row": index}


#: A problem id names its rollouts' stored KV files (``<id>.r<n>.safetensors``) and lines of MANIFEST.sha256: no
#: folder separator (a path like ../../x would write outside results/), no control character and no Unicode line
#: break (U+0085, U+2028, U+2029: a newline, or what Python's str.splitlines reads as one, splits a manifest line),
#: and short enough that the longest file name made from it stays within the 255 bytes of a name.
UNSAFE_ID = re.compile(r"[/\\\x00-\x1f\x7f\x85\u2028\u2029]")
MAX_ID_BYTES = 200


def check_problem_id(problem_id: str, where: str) -> None:
    """Refuse an id that cannot name a file, by the row it came from, before any step makes a file of it."""
    if UNSAFE_ID.search(problem_id) or problem_id.startswith("."):
        raise ValueError(
            f"{where}: problem id {problem_id!r} cannot name a file (it has '/', '\\', a control "
            "character or a line break such as a newline or U+2028, or starts with '.'); change the "
            "row's id"
        )
    if len(problem_id.encode()) > MAX_ID_BYTES:
        raise ValueError(
            f"{where}: problem id {_shorten(problem_id)!r} is {len(problem_id.encode())} bytes long; "
            f"file names made from it need it at most {MAX_ID_BYTES}"
        )


PROBLEM_SCHEMA = {"problem_id": pl.Utf8, "question": pl.Utf8, "gold": pl.Utf8, "row": pl.Int64}

#: How much of a question an error message quotes.
QUESTION_SHOWN = 60


def _shorten(text: str, width: int = QUESTION_SHOWN) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _refuse_duplicate_questions(records: list[Record], problems: list[dict]) -> None:
    """A question asked twice would count as two independent clusters in the problem-clustered statistics,
    making their standard errors too small."""
    first_at: dict[str, str] = {}
    for (where, _), problem in zip(records, problems):
        first = first_at.setdefault(problem["question"], where)
        if first != where:
            raise ValueError(
                f"{where}: duplicate question {_shorten(problem['question'])!r}, first at {first}; "
                "each problem must appear once"
            )


SIMPLE_SOURCE = "simple_addsub"
SIMPLE_POOL_SIZE = 500
_NAMES = ("Anna", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kira", "Leo")
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "shells", "cards", "coins", "flowers")


def simple_addsub_problems(size: int = SIMPLE_POOL_SIZE) -> list[dict]:
    """A fixed pool of one-step addition/subtraction word problems with numbers up to 15.

    The packaged benchmarks are too hard for the 135M test-bed model (near 0% correct, so every credit estimate
    is 0); on these it is right about a third of the time, which is what makes credit estimates informative.
    The pool is generated from a fixed seed, so it is the same dataset everywhere.
    """
    rng = np.random.default_rng(20240229)
    problems = []
    for i in range(size):
        name, item = _NAMES[rng.integers(len(_NAMES))], _ITEMS[rng.integers(len(_ITEMS))]
        a = int(rng.integers(2, 16))
        if rng.random() < 0.5:
            b = int(rng.integers(1, 16))
            question = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?"
            gold = a + b
        else:
            b = int(rng.integers(1, a))
            question = f"{name} has {a} {item}. {name} gives away {b} {item}. How many {item} does {name} have left?"
            gold = a - b
        problems.append({"problem_id": f"{SIMPLE_SOURCE}-{i}", "question": question, "gold": str(gold), "row": i})
    return problems


def _unknown_source(source: str) -> ValueError:
    allowed = ", ".join([*PACKAGED_DATASETS, SIMPLE_SOURCE, FILE_SOURCE])
    return ValueError(f"unknown problem source {source!r}; allowed: {allowed}")


@dataclass(frozen=True)
class LoadedProblems:
    """A dataset as one step read it: the problems, where each came from (file:line, for messages) and the
    sha256 of the bytes read (None for the built-in pool)."""

    frame: pl.DataFrame
    where: dict[str, str]
    sha256: str | None


def load_problems(source: str, path: str | None, cache_dir: Path) -> pl.DataFrame:
    """All problems of a registered benchmark or of a user's file, in one shape:
    ``problem_id`` (``<dataset>-<id or row>``), ``question``, ``gold`` (canonical number text), ``row``."""
    return read_problems(source, path, cache_dir).frame


def read_problems(source: str, path: str | None, cache_dir: Path) -> LoadedProblems:
    """``load_problems``, with each problem's location and the digest of what was read."""
    if source == SIMPLE_SOURCE:
        problems = simple_addsub_problems()
        return LoadedProblems(
            pl.DataFrame(problems, schema=PROBLEM_SCHEMA),
            {p["problem_id"]: f"{SIMPLE_SOURCE}: problem {p['row']}" for p in problems},
            None,
        )
    if source == FILE_SOURCE:
        if not path:
            raise ValueError("source 'file' needs a path to a jsonl or parquet file")
        file, spec, dataset = Path(path), FILE_FIELDS, Path(path).stem
    elif source in PACKAGED_DATASETS:
        file, spec, dataset = packaged_file(source, Path(cache_dir)), PACKAGED_DATASETS[source], source
    else:
        raise _unknown_source(source)
    records, digest = _read_records(file)
    problems = [_problem(row, i, where, dataset, spec) for i, (where, row) in enumerate(records)]
    counts = Counter(p["problem_id"] for p in problems)
    dupes = sorted(pid for pid, c in counts.items() if c > 1)
    if dupes:
        raise ValueError(f"{file}: duplicate problem ids {dupes[:5]}")
    if source == FILE_SOURCE:  # the pinned MAWPS files repeat some questions, but must load as published
        _refuse_duplicate_questions(records, problems)
    return LoadedProblems(
        pl.DataFrame(problems, schema=PROBLEM_SCHEMA),
        {p["problem_id"]: where for (where, _), p in zip(records, problems)},
        digest,
    )


def packaged_rows(source: str) -> int:
    """How many problems a packaged source holds (from the registry: nothing is fetched)."""
    return SIMPLE_POOL_SIZE if source == SIMPLE_SOURCE else PACKAGED_DATASETS[source].rows


def training_set(source: str, cache_dir: Path, exclude: list[str], per_step: int) -> pl.DataFrame:
    """The problems a model is trained on: a packaged set without the questions ``exclude`` (the evaluation's
    sampled problems, where they come from the same set: a model must not be scored on what it was trained on).
    Fewer than one step's ``per_step`` distinct prompts would make a training of no step, which trainers end
    quietly at step 0 with the base weights: refused, with both sizes."""
    kept = load_problems(source, None, cache_dir).filter(~pl.col("question").is_in(exclude))
    if kept.height < per_step:
        raise ValueError(
            f"train.dataset {source!r}: {kept.height} problems are left once the evaluation's "
            f"{len(exclude)} are taken out, fewer than train.prompts_per_step ({per_step}), the "
            "distinct prompts of one step; lower dataset.n_problems or prompts_per_step, or train on "
            "another dataset"
        )
    return kept


def check_n_problems(dataset: dict, cache_dir: Path) -> None:
    """Refuse a ``dataset.n_problems`` the dataset cannot supply while the workflow parses its config: the
    sample_problems job would find out only after Snakemake had deleted its previous, good output. Nothing is
    fetched or extracted (packaged sizes are in the registry), so the check is cheap and works offline."""
    source, n = dataset["source"], dataset["n_problems"]
    if source == SIMPLE_SOURCE:
        name, available = source, SIMPLE_POOL_SIZE
    elif source == FILE_SOURCE:
        if not dataset.get("path"):
            raise ValueError("source 'file' needs a path to a jsonl or parquet file")
        name, available = dataset["path"], _count_records(Path(dataset["path"]))
    elif source in PACKAGED_DATASETS:
        name, available = source, PACKAGED_DATASETS[source].rows
    else:
        raise _unknown_source(source)
    if available == 0:
        raise ValueError(f"{name}: no problems")
    if n > available:
        raise ValueError(f"dataset.n_problems is {n}, but {name} has only {available} problems")


SAMPLINGS = ("random", "first", "listed")


def sample_problems(
    df: pl.DataFrame, n: int, seed: int, how: str = "random", ids: list[str] | None = None
) -> pl.DataFrame:
    """A seeded uniform sample without replacement (``random``), the first ``n`` problems (``first``: the paper's
    fixed cohort, GSM8K test indices 0..n-1, and the order its screen scans in), or the problems ``ids`` names
    (``listed``: another run's problems), in source order.

    The frame is sorted by ``row`` before drawing so the sample depends only on (problems, n, seed), not on
    how the frame happened to be ordered; numpy's PCG64 generator gives the same draw on every machine.
    """
    available = df.height
    if n < 1 or n > available:
        raise ValueError(f"cannot sample n={n} problems: {available} available (need 1 <= n <= {available})")
    if how not in SAMPLINGS:
        raise ValueError(f"dataset.sample must be one of {SAMPLINGS}, got {how!r}")
    ordered = df.sort("row")
    if how == "listed":
        return _listed(ordered, ids or [], n)
    if how == "first":
        return ordered[:n]
    picked = np.random.default_rng(seed).choice(available, size=n, replace=False)
    return ordered[np.sort(picked).tolist()]


def _listed(ordered: pl.DataFrame, ids: list[str], n: int) -> pl.DataFrame:
    """The listed problems; an id the dataset lacks is named (a list from another dataset, a typo), and a list that
    does not hold n distinct ids is refused (the shards and the screen count n)."""
    missing = sorted(set(ids) - set(ordered["problem_id"].to_list()))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"dataset.ids: {shown} not in the dataset (its ids look like {ordered['problem_id'][0]!r})")
    if len(set(ids)) != n:
        raise ValueError(f"dataset.ids: {len(set(ids))} distinct ids, but n_problems is {n}")
    return ordered.filter(pl.col("problem_id").is_in(ids))


def write_problems(df: pl.DataFrame, target: str | os.PathLike) -> None:
    write_parquet(df, target)
