"""Comments say what and why, not history: no issue numbers, leases or run dates in the library or the workflow. A
date may appear only inside a path it names (a results folder), since that cites a file rather than telling a story."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(
    p
    for p in [ROOT / "Snakefile", *(ROOT / "replaynoise").rglob("*"), *(ROOT / "workflow").rglob("*")]
    if p.suffix in {"", ".py", ".smk", ".rst", ".yaml"} and p.is_file() and "__pycache__" not in p.parts
)
HISTORY = re.compile(
    r"\b(issues?|PR|pull request) ?#?\d+|\bleas(e|es|ed)\b|\bonce (crashed|failed|broke)\b", re.IGNORECASE
)
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def history(text: str) -> list[str]:
    """The lines of a text that tell history: an issue number, a lease, or a date outside a path."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        tokens = re.split(r"[\s()`'\",;]+", line)
        dated = [t for t in tokens if DATE.search(t) and "/" not in t]
        if HISTORY.search(line) or dated:
            found.append(f"{number}: {line.strip()}")
    return found


def test_the_check_finds_each_kind_of_history():
    stories = ("# fixed in issue 55", "# the 1.5B lease", "x = 1  # run on 2026-12-07", "# this once crashed it")
    for line in stories:
        assert history(line), line
    assert not history("# see benchmarks/results/fa3-attention-2026-12-07/ for the timings\n# the release\n")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_history_in_code_comments(path):
    assert not history(path.read_text()), history(path.read_text())
