"""The report's first page, as reStructuredText: each configuration's main row with its interval, whether it
resolved and what it means, then the settings that differ from the defaults as tables a reader can scan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import polars as pl

from replaynoise.report.summary import NA, summary_value, verdict

#: the first page's table of main rows: (header, headline column, scale, format)
ROW_CELLS = (
    ("n (problems)", None, 1.0, ""),
    ("re-feed %", "refeed_disagreement", 100.0, "{:.1f}"),
    ("floor %", "floor", 100.0, "{:.1f}"),
)
MEANING = (
    "The excess is how many more pivots, in points of the set, flip the sign of their credit when the prefix is re-fed "
    "than when the decode-time state is replayed again; an interval that excludes 0 means re-feeding moved credit "
    "beyond the replay noise this run measures. Resolved needs replicated passes (``replay.replicates``): with one "
    "draw per pass the interval covers the problems' noise only."
)


def _literal(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = " ".join(str(text).split())
    return f"``{text}``" if text else "(empty)"


def _list_table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    lines = [f".. list-table:: {title}", "   :header-rows: 1", ""]
    for row in [header, *rows]:
        lines.append(f"   * - {row[0]}")
        lines.extend(f"     - {cell}" for cell in row[1:])
    return [*lines, ""]


def _main_rows(headline_csv: str | os.PathLike, conditioning: str) -> list[dict]:
    table = pl.read_csv(Path(headline_csv), comment_prefix="#", infer_schema_length=0)
    rows = table.filter(pl.col("conditioning") == conditioning).to_dicts()
    own = [r for r in rows if r["config"] != "pooled"]
    return own or rows


def answer_section(headline_csv: str | os.PathLike, conditioning: str) -> list[str]:
    """The main row of every configuration, its verdict cell, and one sentence per row of what it means."""
    rows = _main_rows(headline_csv, conditioning)
    cells = []
    for r in rows:
        excess = summary_value(r, "excess_pp", 1.0, "{:+.1f}")
        if excess != NA and summary_value(r, "excess_pp_ci_lo", 1.0, "{:+.1f}") != NA:
            lo, hi = (summary_value(r, c, 1.0, "{:+.1f}") for c in ("excess_pp_ci_lo", "excess_pp_ci_hi"))
            excess += f" [{lo}, {hi}]"
        pairs = r.get("pairs") if r.get("pairs") not in (None, "", NA) else "1"
        cells.append(
            [
                _literal(r["config"]),
                f"{r['n']} ({r['n_problems']})",
                *(summary_value(r, column, scale, fmt) for _, column, scale, fmt in ROW_CELLS[1:]),
                excess,
                str(pairs),
                verdict(r)[0],
            ]
        )
    header = ["configuration", *(h for h, *_ in ROW_CELLS), "excess pp [95% CI]", "pairs of draws", "resolved"]
    lines = ["The answer", "----------", ""]
    lines += _list_table(f"Main rows ({conditioning} conditioning)", header, cells)
    lines += [f"- {verdict(r)[1]}" for r in rows]
    return [*lines, "", MEANING, ""]


def settings_section(differences: dict[str, dict[str, Any]], deviations: list[dict]) -> list[str]:
    """The configurations' keys that differ from the schema's defaults (one column per configuration), and the run's
    settings that differ from the committed default config."""
    lines = ["The settings", "------------", ""]
    names = sorted(differences)
    keys = sorted({key for diff in differences.values() for key in diff})
    if keys:
        rows = [[_literal(key), *(_literal(differences[n].get(key, "default")) for n in names)] for key in keys]
        lines += _list_table(
            "Each configuration: what it is, and its keys that differ from the schema's defaults", ["key", *names], rows
        )
    shared = [d for d in deviations if not d["key"].startswith("configs.")]
    if shared:
        rows = [[_literal(d["key"]), _literal(d["value"]), _literal(d["default"])] for d in shared]
        lines += _list_table("Run settings that differ from the embedded default", ["key", "value", "default"], rows)
    else:
        lines += ["The run's other settings are the embedded default's (``config/config.yaml``).", ""]
    return lines


def landing_page(
    intro: str,
    headline_csv: str | os.PathLike,
    conditioning: str,
    differences: dict[str, dict[str, Any]],
    deviations: list[dict],
    analysis_hash: str,
) -> str:
    """The whole first page: the answer, the workflow's introduction, the settings, and where everything else is."""
    lines = [
        *answer_section(headline_csv, conditioning),
        "What this measures",
        "------------------",
        "",
        intro.strip(),
        "",
    ]
    lines += settings_section(differences, deviations)
    lines += [
        f"Analysis hash ``{analysis_hash}`` (in every table). Every figure and table, each with a caption that says "
        "what to look at: Figures_, Tables_; what made each number: ``results/provenance.json``.",
        "",
    ]
    return "\n".join(lines)
