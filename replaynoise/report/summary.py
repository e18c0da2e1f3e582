"""The few lines a finished run prints: the main rows of its headline table, aligned for a terminal.

The Snakefile imports this while it parses (its ``onsuccess`` prints the summary), so it loads polars only.
"""

from __future__ import annotations

import os

import polars as pl

#: A cell the analysis left undefined.
NA = "n/a"


def aligned(cells: list[list[str]], indent: str = "") -> list[str]:
    """Rows of text cells as aligned lines: the first column left-aligned, the rest right, a rule under the
    header row."""
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    lines = []
    for j, row in enumerate(cells):
        lines.append(
            indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
        if j == 0:
            lines.append(indent + "  ".join("-" * w for w in widths))
    return lines


#: The end-of-run summary's columns: a short table a terminal can hold.
SUMMARY_HEADERS = ("configuration", "n (problems)", "re-feed %", "floor %", "excess pp [95% CI]", "t per problem")


def summary_value(row: dict, column: str, scale: float, fmt: str) -> str:
    value = row.get(column)
    try:
        return fmt.format(float(value) * scale)
    except (TypeError, ValueError):
        return NA


def _number(row: dict, column: str) -> float | None:
    try:
        return float(row.get(column))
    except (TypeError, ValueError):
        return None


def verdict(row: dict) -> tuple[str, str]:
    """Whether a headline row resolved an excess, as a short cell, and what the row means, as one sentence. Resolved
    needs replicated passes; one draw per pass gives an interval over problems only."""
    name, excess, lo, hi = (
        row["config"],
        *(_number(row, c) for c in ("excess_pp", "excess_pp_ci_lo", "excess_pp_ci_hi")),
    )
    if _number(row, "refeed_disagreement") == 0 and _number(row, "floor") == 0:
        return "exactly zero", f"{name}: every pass agrees with exact: re-feeding moved no credit."
    if excess is None or lo is None or hi is None:
        return NA, f"{name}: no interval ({row.get('note') or 'too few eligible pivots'})."
    excludes = lo > 0 or hi < 0
    if str(row.get("pairs")) not in ("", "1", NA, "None"):
        if str(row.get("resolved")).lower() == "true":
            return "yes", (
                f"{name}: re-feeding moved credit beyond the replay noise, {excess:+.1f} points of the pivots, "
                "over problems and pass draws."
            )
        return "no", f"{name}: the interval over problems and pass draws includes 0: no excess is resolved."
    if excludes:
        return "no: one draw per pass", (
            f"{name}: the interval over problems excludes 0 ({excess:+.1f} points); with one draw per pass it cannot "
            "see the pass-to-pass noise, so the excess is not resolved (replay.replicates: 3)."
        )
    return "no", f"{name}: the interval includes 0: this run shows no excess beyond the replay noise."


#: said where every configuration runs on CPU: bf16 kernels follow the instruction set, and a small run is a demo
CPU_NOTE = (
    "  On CPU a run's numbers follow the CPU's instruction set (provenance.json: torch_cpu_capability). A run this "
    "small, such as the embedded default, demonstrates the measurement: its interval may include 0 on some CPUs."
)


def run_summary(headline_csv: str | os.PathLike, conditioning: str, cpu: bool = False) -> str:
    """The main rows of a finished run's headline table, printed at the end of the run: what was measured, what each
    row means and where the files are. Cells the analysis left undefined print as n/a, with its note; ``cpu`` adds
    that a CPU run's numbers follow the CPU."""
    rows = pl.read_csv(headline_csv, comment_prefix="#", infer_schema_length=0)
    rows = rows.filter(pl.col("conditioning") == conditioning).to_dicts()
    replicated = any(str(r.get("pairs")) not in ("", "1", NA, "None") for r in rows)
    cells = [list(SUMMARY_HEADERS) + (["pairs", "resolved"] if replicated else [])]
    notes = []
    for r in rows:
        excess = summary_value(r, "excess_pp", 1.0, "{:+.1f}")
        if excess != NA:
            excess += (
                f" [{summary_value(r, 'excess_pp_ci_lo', 1.0, '{:+.1f}')}, "
                f"{summary_value(r, 'excess_pp_ci_hi', 1.0, '{:+.1f}')}]"
            )
        cells.append(
            [
                r["config"],
                f"{r['n']} ({r['n_problems']})",
                summary_value(r, "refeed_disagreement", 100.0, "{:.1f}"),
                summary_value(r, "floor", 100.0, "{:.1f}"),
                excess,
                summary_value(r, "t_per_problem", 1.0, "{:.2f}"),
            ]
            + (
                [str(r.get("pairs")), {"true": "yes", "false": "no"}.get(str(r.get("resolved")).lower(), NA)]
                if replicated
                else []
            )
        )
        if r.get("note") not in (None, "", NA):
            notes.append(f"  {r['config']}: {r['note']}")
    metrics = ", ".join(sorted({r["metric"] for r in rows})) or "sign"
    lines = [f"Re-feed against the replica floor ({conditioning} conditioning, {metrics} metric; {headline_csv}):"]
    meaning = [
        "  The excess is how many more pivots (in points of the set) change the sign of their credit when the prefix "
        "is re-fed than when the decode-time state is replayed again; an interval that excludes 0 means re-feeding "
        "moved credit beyond the replay noise this run measures.",
        "  Over replicated passes the interval covers the pass-to-pass noise too (column pairs in the table)."
        if replicated
        else "  With one draw per pass the interval covers the problems' noise only; replay.replicates: 3 adds the "
        "pass-to-pass noise (docs/method.md, section 4).",
    ]
    verdicts = [f"  {verdict(r)[1]}" for r in rows if r["config"] != "pooled" or len(rows) == 1]
    return (
        "\n".join(lines + aligned(cells, indent="  ") + notes + verdicts + meaning + ([CPU_NOTE] if cpu else [])) + "\n"
    )
