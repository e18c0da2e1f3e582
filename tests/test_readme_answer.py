"""The README's first screen says what the committed ladder says: every cell of its table is read back from the
headline table of the reference folder the row names (issue 51: no claim the committed files do not support)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LADDER = ROOT / "reference" / "gpu-vllm" / "ladder"
#: the README row's first cell -> the ladder folder it is read from
ROWS = {
    "Qwen2.5-Coder-0.5B, stock": "qwen-0.5b",
    "SmolLM2-135M, stock": "smollm2",
    "Qwen2.5-Coder-1.5B, stock": "qwen-1.5b",
    "Qwen2.5-Coder-1.5B, batch-invariant": "qwen-invariant",
}


def readme_rows() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    block = text[text.index("**The answer so far**") : text.index("## Set-up")]
    rows = [line.strip("|").split("|") for line in block.splitlines() if line.startswith("| ") and "---" not in line]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def main_row(folder: str) -> dict[str, str]:
    lines = [line for line in (LADDER / folder / "tables" / "headline.csv").read_text().splitlines() if line[:1] != "#"]
    return next(r for r in csv.DictReader(lines) if r["conditioning"] == "main" and r["config"] != "pooled")


def test_the_first_screen_names_every_rung_of_the_ladder():
    assert set(readme_rows()) == set(ROWS)
    assert {p.name for p in LADDER.iterdir() if p.is_dir()} == set(ROWS.values())


@pytest.mark.parametrize("label", sorted(ROWS))
def test_each_cell_of_the_first_screen_is_its_reference_folders(label):
    pairs, n, refeed, floor, excess, pass_sd, resolved = readme_rows()[label]
    row = main_row(ROWS[label])
    assert int(pairs) == (int(row["pairs"]) if row["pairs"] != "n/a" else 1)
    assert n == f"{row['n']} ({row['n_problems']})"
    assert refeed == f"{100 * float(row['refeed_disagreement']):.1f}"
    assert floor == f"{100 * float(row['floor']):.1f}"
    value = f"{float(row['excess_pp']):+.1f}"
    if row["excess_pp_ci_lo"] not in ("", "n/a") and float(row["refeed_disagreement"]) > 0:
        value += f" [{float(row['excess_pp_ci_lo']):+.1f}, {float(row['excess_pp_ci_hi']):+.1f}]"
    assert excess.startswith(value)
    if int(pairs) > 1:  # the crossed interval and the pass component exist only with replicated draws
        sd = [float(row[k]) for k in ("pass_sd_pp", "pass_sd_pp_ci_lo", "pass_sd_pp_ci_hi")]
        assert pass_sd == f"{sd[0]:.1f} [{sd[1]:.1f}, {sd[2]:.1f}]"
        assert resolved.startswith("yes") == (row["resolved"] == "true")
    elif float(row["refeed_disagreement"]) == 0 and float(row["floor"]) == 0:
        assert resolved == "exactly zero"
    else:
        assert "problems only" in excess and resolved.startswith("no")
