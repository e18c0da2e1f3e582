"""The README's front door: its answer table reads back from the reference folders its rows name, and it keeps its
bars (at most 120 lines and 1,000 words, the set-up commands within the first 30 lines, a complete layout)."""

from __future__ import annotations

import csv
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REFERENCE = ROOT / "reference"
#: (the answer table's model, engine) -> the reference folder its cells are read from
ROWS = {
    ("Qwen2.5-Coder-0.5B", "vLLM 0.26, stock"): "gpu-vllm/ladder/qwen-0.5b",
    ("Qwen2.5-Coder-1.5B", "vLLM 0.26, stock"): "gpu-vllm/ladder/qwen-1.5b",
    ("Qwen2.5-Coder-1.5B", "vLLM 0.26, batch-invariant"): "gpu-vllm/ladder/qwen-invariant",
    ("Qwen2.5-Coder-0.5B", "SGLang 0.5.16, stock"): "gpu-sglang/qwen-0.5b-vllm-problems",
    ("Qwen2.5-Coder-1.5B", "SGLang 0.5.16, stock"): "gpu-sglang/qwen-1.5b-vllm-problems",
}


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def table(title: str) -> list[list[str]]:
    """The rows of the first table in a README section, each as its stripped cells, header and rule left out."""
    lines = [line for line in section(title).splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def main_row(folder: str) -> dict[str, str]:
    text = (REFERENCE / folder / "tables" / "headline.csv").read_text()
    lines = [line for line in text.splitlines() if line[:1] != "#"]
    return next(r for r in csv.DictReader(lines) if r["conditioning"] == "main" and r["config"] != "pooled")


def test_the_answer_table_has_at_most_five_rows_each_a_named_folder():
    rows = table("The answer so far")
    assert 1 <= len(rows) <= 5
    assert {(model, engine) for model, engine, *_ in rows} == set(ROWS)


@pytest.mark.parametrize("label", sorted(ROWS), ids=" / ".join)
def test_each_answer_cell_is_its_reference_folders(label):
    excess, resolved = next(cells[2:] for cells in table("The answer so far") if tuple(cells[:2]) == label)
    row = main_row(ROWS[label])
    value = f"{float(row['excess_pp']):+.1f}"
    if float(row["refeed_disagreement"]) == 0 and float(row["floor"]) == 0:
        assert (excess, resolved) == (value, "exactly zero")
        return
    assert excess == f"{value} [{float(row['excess_pp_ci_lo']):+.1f}, {float(row['excess_pp_ci_hi']):+.1f}]"
    assert int(row["pairs"]) >= 2  # "resolved" is defined over replicated draws only
    assert resolved.startswith("yes") == (row["resolved"] == "true")


def test_the_readme_keeps_its_bars():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 120
    assert len(text.split()) <= 1000
    first = "\n".join(lines[:30])
    assert "bash install.sh && .venv/bin/snakemake --cores all" in first and "pytest -n auto" in first


def test_the_layout_names_every_tracked_top_level_path_engine_reference_and_docs_page():
    layout = section("Layout")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = {p.split("/")[0] for p in tracked.split()} - {".gitignore", "README.md", "pyproject.toml"}
    for name in sorted(top):
        stem = re.sub(r"-.*|\..*", "", name) if name.startswith("requirements") else name
        assert f"`{stem}" in layout, name
    for engine in (ROOT / "replaynoise" / "engines").iterdir():
        if engine.is_dir() and not engine.name.startswith("_"):
            assert f"`{engine.name}/`" in layout, engine.name
    for folder in REFERENCE.iterdir():
        if folder.is_dir():
            assert f"`{folder.name}/`" in layout, folder.name
    for page in (ROOT / "docs").glob("*.md"):
        assert page.stem in layout, page.name
