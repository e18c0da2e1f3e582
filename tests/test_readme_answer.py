"""The README's first screen says what the committed ladder and SGLang folders say: every cell of its tables is read
back from the headline table of the reference folder the row names (issues 51 and 55: no claim the committed files do
not support)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "reference"
LADDER = REFERENCE / "gpu-vllm" / "ladder"
SGLANG = REFERENCE / "gpu-sglang"
#: (the README table's engine, the row's first cell) -> the reference folder it is read from
ROWS = {
    ("vLLM", "Qwen2.5-Coder-0.5B, stock"): "gpu-vllm/ladder/qwen-0.5b",
    ("vLLM", "SmolLM2-135M, stock"): "gpu-vllm/ladder/smollm2",
    ("vLLM", "Qwen2.5-Coder-1.5B, stock"): "gpu-vllm/ladder/qwen-1.5b",
    ("vLLM", "Qwen2.5-Coder-1.5B, batch-invariant"): "gpu-vllm/ladder/qwen-invariant",
    ("SGLang", "Qwen2.5-Coder-0.5B, stock, vLLM's problems"): "gpu-sglang/qwen-0.5b-vllm-problems",
    ("SGLang", "Qwen2.5-Coder-1.5B, stock, vLLM's problems"): "gpu-sglang/qwen-1.5b-vllm-problems",
    ("SGLang", "Qwen2.5-Coder-1.5B, stock, vLLM's problems, an earlier lease"): (
        "gpu-sglang/qwen-1.5b-vllm-problems-2026-12-06"
    ),
    ("SGLang", "Qwen2.5-Coder-0.5B, stock, its own screen"): "gpu-sglang/qwen-0.5b",
    ("SGLang", "Qwen2.5-Coder-0.5B, deterministic"): "gpu-sglang/qwen-0.5b-deterministic",
}


def readme_rows() -> dict[tuple[str, str], list[str]]:
    """Each table row of the first screen, keyed by its table's engine (the header's "model (ENGINE)") and label."""
    text = (ROOT / "README.md").read_text()
    lines = text[text.index("**The answer so far**") : text.index("## Set-up")].splitlines()
    rows, engine = {}, None
    for line, following in zip(lines, [*lines[1:], ""]):
        if not line.startswith("| ") or "---" in line:
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if following.startswith("|---"):  # a header: its first cell names the engine
            engine = cells[0].removeprefix("model (").removesuffix(")")
            continue
        rows[(engine, cells[0])] = cells[1:]
    return rows


def main_row(folder: str) -> dict[str, str]:
    text = (REFERENCE / folder / "tables" / "headline.csv").read_text()
    lines = [line for line in text.splitlines() if line[:1] != "#"]
    return next(r for r in csv.DictReader(lines) if r["conditioning"] == "main" and r["config"] != "pooled")


def test_the_first_screen_names_every_rung_of_the_ladder_and_every_sglang_folder():
    assert set(readme_rows()) == set(ROWS)
    folders = [p for parent in (LADDER, SGLANG) for p in parent.iterdir() if p.is_dir()]
    assert {p.relative_to(REFERENCE).as_posix() for p in folders} == set(ROWS.values())


@pytest.mark.parametrize("label", sorted(ROWS), ids=" / ".join)
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
        sd, lo, hi = (row[k] for k in ("pass_sd_pp", "pass_sd_pp_ci_lo", "pass_sd_pp_ci_hi"))
        bound = f"up to {float(hi):.1f}" if lo == "n/a" else f"{float(lo):.1f}, {float(hi):.1f}"
        assert pass_sd == f"{float(sd):.1f} [{bound}]"
        assert resolved.startswith("yes") == (row["resolved"] == "true")
    elif float(row["refeed_disagreement"]) == 0 and float(row["floor"]) == 0:
        assert resolved == "exactly zero"
    else:
        assert "problems only" in excess and resolved.startswith("no")
