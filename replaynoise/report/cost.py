"""Compute accounting: device-hours per rule from Snakemake's benchmark files, and what they would cost.

A paper's compute statement ("total compute was under 10 USD") should come from the run, not from memory.
Each model step writes a benchmark file (wall seconds, CPU seconds, peak memory); a GPU job is charged its
wall time times the GPUs it held, a CPU job its wall time times the cores it held, since that is what a
cluster or a cloud bills. Only the last run of each job is on disk, so interrupted or superseded attempts
are not counted; the statement says so.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from replaynoise.io import atomic_path


@dataclass(frozen=True)
class TimedJob:
    """One job the run planned: its rule, its benchmark file, and what it held while running."""

    rule: str
    benchmark: str
    gpus: int
    threads: int


def read_benchmark(path: str | os.PathLike) -> dict[str, float] | None:
    """Wall seconds, CPU seconds and peak RSS (MB) of one benchmark file; None if the job was never timed."""
    path = Path(path)
    if not path.is_file():
        return None
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    if not rows:
        raise ValueError(f"{path}: benchmark file has no measurement row")

    def number(row: dict, key: str) -> float:
        value = row.get(key, "NA")
        try:
            return float(value)
        except (TypeError, ValueError):
            return float("nan")

    row = rows[-1]  # with --benchmark-repeats the last repeat; there is one otherwise
    return {"seconds": number(row, "s"), "cpu_seconds": number(row, "cpu_time"), "max_rss_mb": number(row, "max_rss")}


def job_table(jobs: list[TimedJob]) -> pl.DataFrame:
    """One row per planned job, with its measurement (nulls where it has none) and device-hours."""
    rows = []
    for job in jobs:
        measured = read_benchmark(job.benchmark)
        hours = None if measured is None else measured["seconds"] / 3600
        rows.append(
            {
                "rule": job.rule,
                "benchmark": job.benchmark,
                "gpus": job.gpus,
                "threads": job.threads,
                "timed": measured is not None,
                "wall_hours": hours,
                "gpu_hours": None if hours is None else hours * job.gpus,
                "cpu_core_hours": None if hours is None or job.gpus else hours * job.threads,
                "cpu_seconds": None if measured is None else measured["cpu_seconds"],
                "max_rss_mb": None if measured is None else measured["max_rss_mb"],
            }
        )
    schema = {
        "rule": pl.Utf8,
        "benchmark": pl.Utf8,
        "gpus": pl.Int64,
        "threads": pl.Int64,
        "timed": pl.Boolean,
        "wall_hours": pl.Float64,
        "gpu_hours": pl.Float64,
        "cpu_core_hours": pl.Float64,
        "cpu_seconds": pl.Float64,
        "max_rss_mb": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema)


def per_rule(jobs: pl.DataFrame, *, gpu_hour: float, cpu_core_hour: float) -> pl.DataFrame:
    """Device-hours and cost per rule, plus a total row."""
    by_rule = (
        jobs.group_by("rule", maintain_order=True)
        .agg(
            pl.len().alias("jobs"),
            pl.col("timed").sum().alias("timed_jobs"),
            pl.col("wall_hours").sum(),
            pl.col("gpu_hours").sum(),
            pl.col("cpu_core_hours").sum(),
            pl.col("max_rss_mb").max().alias("peak_rss_mb"),
        )
        .sort("rule")
    )
    total = by_rule.select(
        pl.lit("total").alias("rule"),
        pl.col("jobs").sum(),
        pl.col("timed_jobs").sum(),
        pl.col("wall_hours").sum(),
        pl.col("gpu_hours").sum(),
        pl.col("cpu_core_hours").sum(),
        pl.col("peak_rss_mb").max(),
    )
    table = pl.concat([by_rule, total], how="vertical_relaxed")
    return table.with_columns((pl.col("gpu_hours") * gpu_hour + pl.col("cpu_core_hours") * cpu_core_hour).alias("cost"))


def statement(table: pl.DataFrame, *, gpu_hour: float, cpu_core_hour: float, currency: str) -> str:
    """The compute statement as Markdown: a sentence for the paper, then the per-rule table."""
    total = table.filter(pl.col("rule") == "total").row(0, named=True)
    untimed = total["jobs"] - total["timed_jobs"]
    lines = [
        "# Compute",
        "",
        f"This run used **{total['gpu_hours']:.3f} GPU-hours** and **{total['cpu_core_hours']:.3f} CPU "
        f"core-hours** ({total['wall_hours']:.3f} job-hours of wall time), an estimated **{total['cost']:.2f} "
        f"{currency}** at {gpu_hour:g} {currency} per GPU-hour and {cpu_core_hour:g} {currency} per CPU "
        "core-hour.",
        "",
        "A GPU job is charged wall time x GPUs held; a CPU job wall time x cores held (`resources.threads`). "
        "Measured by Snakemake's `benchmark:` files (`results/benchmarks/`), last run of each model step only: "
        "interrupted attempts, light steps (tables, figures) and Snakemake's own overhead are not counted.",
        "",
    ]
    if untimed:
        lines += [
            f"{untimed} of {total['jobs']} planned jobs have no benchmark file (run before timing was "
            "recorded, or not run); they count as zero.",
            "",
        ]
    lines += ["| rule | jobs | wall h | GPU h | CPU core h | peak RSS MB | cost |", "|---|---|---|---|---|---|---|"]
    for row in table.iter_rows(named=True):
        rss = "" if row["peak_rss_mb"] is None else f"{row['peak_rss_mb']:.0f}"
        lines.append(
            f"| {row['rule']} | {row['timed_jobs']}/{row['jobs']} | {row['wall_hours']:.4f} | "
            f"{row['gpu_hours']:.4f} | {row['cpu_core_hours']:.4f} | {rss} | {row['cost']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def write_report(
    jobs: list[TimedJob],
    csv_path: str | os.PathLike,
    md_path: str | os.PathLike,
    *,
    gpu_hour: float,
    cpu_core_hour: float,
    currency: str,
) -> pl.DataFrame:
    """Write cost.csv (per rule) and cost.md (the statement); returns the per-rule table."""
    table = per_rule(job_table(jobs), gpu_hour=gpu_hour, cpu_core_hour=cpu_core_hour)
    with atomic_path(csv_path) as tmp:
        table.write_csv(tmp)
    with atomic_path(md_path) as tmp:
        tmp.write_text(statement(table, gpu_hour=gpu_hour, cpu_core_hour=cpu_core_hour, currency=currency))
    return table
