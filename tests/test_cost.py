"""The compute statement: device-hours per rule from benchmark files, and their cost."""

from __future__ import annotations

import polars as pl
import pytest

from replaynoise.report.cost import TimedJob, read_benchmark, write_report

HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def benchmark(path, seconds, rss=512.0, cpu=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + f"{seconds}\t0:00:00\t{rss}\t0\t0\t0\t0\t0\t0\t{seconds * 2 if cpu is None else cpu}\n")
    return str(path)


def test_gpu_jobs_pay_gpu_hours_cpu_jobs_pay_core_hours(tmp_path):
    jobs = [
        TimedJob("prepare_model", benchmark(tmp_path / "prep.tsv", 360.0), gpus=0, threads=4),
        TimedJob("replay_exact", benchmark(tmp_path / "a.000.tsv", 1800.0, rss=900), gpus=1, threads=8),
        TimedJob("replay_exact", benchmark(tmp_path / "a.001.tsv", 3600.0), gpus=2, threads=8),
        TimedJob("replay_refeed", str(tmp_path / "never-ran.tsv"), gpus=1, threads=8),
    ]
    table = write_report(
        jobs, tmp_path / "cost.csv", tmp_path / "cost.md", gpu_hour=2.0, cpu_core_hour=0.5, currency="EUR"
    )
    rows = {r["rule"]: r for r in table.iter_rows(named=True)}
    assert rows["replay_exact"]["gpu_hours"] == pytest.approx(0.5 + 2.0)
    assert rows["replay_exact"]["cpu_core_hours"] == 0  # a GPU job is billed by its GPUs
    assert rows["replay_exact"]["peak_rss_mb"] == 900
    assert rows["prepare_model"]["cpu_core_hours"] == pytest.approx(0.1 * 4)
    assert rows["replay_refeed"]["timed_jobs"] == 0 and rows["replay_refeed"]["jobs"] == 1
    assert rows["total"]["cost"] == pytest.approx(2.5 * 2.0 + 0.4 * 0.5)
    assert pl.read_csv(tmp_path / "cost.csv").height == 4
    text = (tmp_path / "cost.md").read_text()
    assert "**2.500 GPU-hours**" in text and "**5.20 EUR**" in text
    assert "1 of 4 planned jobs have no benchmark file" in text


def test_a_benchmark_file_without_a_row_is_named(tmp_path):
    empty = tmp_path / "empty.tsv"
    empty.write_text(HEADER)
    with pytest.raises(ValueError, match="empty.tsv: benchmark file has no measurement row"):
        read_benchmark(empty)
    assert read_benchmark(tmp_path / "absent.tsv") is None
