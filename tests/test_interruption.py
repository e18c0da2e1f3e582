"""Killing the workflow at many points, then rerunning it, gives the results of an uninterrupted run.

The whole Snakemake process group (Snakemake and the step it runs) gets SIGKILL, so nothing is cleaned up:
no handler, no atexit, no flush. The rerun must then finish from what is on disk and produce a manifest equal,
byte for byte, to that of the uninterrupted reference run; long steps must pick up their kept shards instead of
starting again. Two schedules of kills: at named events (a file appearing mid-step or between steps) and at
seeded random delays until the run completes; both run the whole workflow many times, so they are slow. The
everyday tier kills one pass's path inside each long step.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import EXACT_PATH, EXACT_PATH_FILES, TINY, seed_model, snakemake, snakemake_command

from replaynoise.io import sha256_file

#: (where the kill lands, glob whose appearance triggers it, glob that shows the run is already past it). Steps
#: run in an order Snakemake picks, and scratch shards vanish when their step ends, hence the third column.
EVENT_KILLS = [
    ("sampling done, rollouts starting", "results/problems/*.parquet", "results/rollouts/tiny/rollouts.parquet"),
    (
        "mid-rollouts: first rollout kept",
        "results/work/tiny/rollouts/*/records/*.parquet",
        "results/rollouts/tiny/rollouts.parquet",
    ),
    (
        "a rollout shard written, its scratch not yet removed",
        "results/rollouts/tiny/shards/*.parquet",
        "results/rollouts/tiny/rollouts.parquet",
    ),
    ("rollouts gathered", "results/rollouts/tiny/rollouts.parquet", "results/pivots/tiny.parquet"),
    ("pivots written", "results/pivots/tiny.parquet", "results/passes/tiny/*.parquet"),
    # Snakemake interleaves the shards of different passes: a pass with a finished shard is past its first batch
    *[
        (
            f"mid-pass: first {name} batch kept",
            f"results/work/tiny/{name}/*/batch_*.parquet",
            f"results/passes/tiny/{name}/*.parquet",
        )
        for name in ("exact", "refeed", "replica", "selector")
    ],
    *[
        (f"a {name} shard written", f"results/passes/tiny/{name}/*.parquet", f"results/passes/tiny/{name}.parquet")
        for name in ("exact", "refeed")
    ],
    *[
        (f"{name} pass gathered", f"results/passes/tiny/{name}.parquet", f"results/credit/tiny/{name}.parquet")
        for name in ("exact", "refeed", "replica", "selector")
    ],
    ("credit computed", "results/credit/tiny/*.parquet", "results/analysis/tiny/comparison.json"),
    ("per-config analysis written", "results/analysis/tiny/comparison.json", "results/tables/headline.csv"),
    ("tables written", "results/tables/headline.csv", "results/MANIFEST.sha256"),
    ("a figure written", "results/figures/*.png", "results/MANIFEST.sha256"),
    ("manifest written", "results/MANIFEST.sha256", "results/cost/cost.md"),
]
RESUME_MARK = "resuming,"


#: The kills of the everyday tier, on one pass's path through the long steps (rollouts and a pass, both resumable
#: from kept shards).
EXACT_PATH_KILLS = [
    kill for kill in EVENT_KILLS if kill[0] in ("mid-rollouts: first rollout kept", "mid-pass: first exact batch kept")
]


def start(workdir: Path, *targets: str) -> subprocess.Popen:
    """Snakemake in a session of its own, so one killpg reaches every process of the run."""
    cmd = snakemake_command(workdir, TINY, *targets)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the group's other processes die asynchronously
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process group {proc.pid} survived SIGKILL")


def unlock(workdir: Path) -> None:
    """Snakemake's lock outlives a killed Snakemake: remove it, as ``snakemake --unlock`` does (the final
    rerun uses the command itself), without paying a Snakemake start per kill."""
    shutil.rmtree(workdir / ".snakemake" / "locks", ignore_errors=True)


def resumed_steps(workdir: Path) -> set[str]:
    """Steps whose current log says they resumed from kept shards."""
    logs = workdir / "results" / "logs"
    return {p.parent.name for p in logs.rglob("*.log") if RESUME_MARK in p.read_text(errors="replace")}


def run_with_kill_at(workdir: Path, pattern: str, *targets: str, timeout: float = 600) -> bool:
    """Run until ``pattern`` matches a file, then kill the group; False if the run ended first."""
    proc = start(workdir, *targets)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(workdir.glob(pattern)):
            kill_group(proc)
            return True
        if proc.poll() is not None:
            assert proc.returncode == 0, f"run failed (exit {proc.returncode}) before {pattern} appeared"
            return False
        time.sleep(0.02)
    kill_group(proc)
    raise AssertionError(f"{pattern} did not appear within {timeout} s")


def run_with_kill_after(workdir: Path, delay: float) -> bool:
    """Run and kill the group after ``delay`` seconds; False if the run finished first."""
    proc = start(workdir)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return True
    assert proc.returncode == 0, f"run failed (exit {proc.returncode})"
    return False


def finish_and_compare(workdir: Path, reference: Path) -> None:
    snakemake(workdir, TINY, "--unlock")
    snakemake(workdir, TINY)
    ours = (workdir / "results" / "MANIFEST.sha256").read_text()
    theirs = (reference / "results" / "MANIFEST.sha256").read_text()
    assert ours == theirs, "interrupted and uninterrupted runs differ"
    assert not list((workdir / "results").rglob("*.tmp")), "temporary files left behind"


def test_kills_inside_the_long_steps_resume_from_kept_shards_to_identical_files(tiny_run, tiny_prepared, tmp_path):
    seed_model(tmp_path, tiny_prepared)
    for label, pattern, _ in EXACT_PATH_KILLS:
        unlock(tmp_path)
        assert run_with_kill_at(tmp_path, pattern, EXACT_PATH), f"the run ended before the kill {label!r}"
    unlock(tmp_path)
    snakemake(tmp_path, TINY, EXACT_PATH)
    assert {"generate_rollouts", "replay_exact"} <= resumed_steps(tmp_path)
    for rel in EXACT_PATH_FILES:
        ours, theirs = tmp_path / "results" / rel, tiny_run / "results" / rel
        assert sha256_file(ours) == sha256_file(theirs), f"{rel}: interrupted and uninterrupted runs differ"
    assert not list((tmp_path / "results").rglob("*.tmp")), "temporary files left behind"


@pytest.mark.slow  # the whole workflow, killed and rerun some fifteen times
def test_kills_at_named_events_recover_identical_results(tiny_run, tiny_prepared, tmp_path):
    seed_model(tmp_path, tiny_prepared)
    tried, resumed = [], set()
    for label, pattern, past in EVENT_KILLS:
        if any(tmp_path.glob(pattern)) or any(tmp_path.glob(past)):
            continue  # the run got past this point before an earlier kill landed
        unlock(tmp_path)
        if run_with_kill_at(tmp_path, pattern):
            tried.append(label)
            resumed |= resumed_steps(tmp_path)
    finish_and_compare(tmp_path, tiny_run)
    resumed |= resumed_steps(tmp_path)
    print(f"\nevent kills: {len(tried)} tried, all recovered with an identical manifest: {tried}")
    print(f"steps that resumed from kept shards: {sorted(resumed)}")
    assert len(tried) >= 10, tried
    # the kills inside long steps left shards, and the reruns continued from them
    assert "generate_rollouts" in resumed and resumed & {"replay_exact", "replay_refeed", "replay_replica"}


@pytest.mark.slow  # the whole workflow, killed and rerun up to ten times
def test_kills_at_random_delays_recover_identical_results(tiny_run, tiny_prepared, tmp_path):
    seed_model(tmp_path, tiny_prepared)
    rng = random.Random(20260614)
    delays = []
    for _ in range(10):
        unlock(tmp_path)
        delay = rng.uniform(2.0, 12.0)  # the tiny run takes about half a minute, a start-up about 4 s of it
        if not run_with_kill_after(tmp_path, delay):
            break
        delays.append(round(delay, 1))
    finish_and_compare(tmp_path, tiny_run)
    print(f"\nrandom kills: {len(delays)} (after {delays} s), all recovered with an identical manifest")
    assert len(delays) >= 5, delays
