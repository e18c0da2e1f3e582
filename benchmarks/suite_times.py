"""How long does the test suite take here, where does its time go, and how busy are the cores while it runs?

    .venv/bin/python benchmarks/suite_times.py OUT_JSON [--durations FILE] [PYTEST_ARGS ...]   # default: -n auto

Runs ``python -m pytest PYTEST_ARGS`` from the project's root with this file loaded as a pytest plugin (in
every xdist worker), which records when each test starts and ends. Beside it, the cores' busy share is read
from /proc/stat every 5 s: ``/usr/bin/time`` counts only the processes pytest waited for, not a killed
Snakemake's orphaned jobs nor what Slurm runs, so it understates how busy the cores were. Prints the summary
and writes OUT_JSON: commit, command, exit status, wall seconds, the pytest summary line, the cores' mean busy
share, when each worker finished, and every test that took 20 s or more (start, end, worker).

With ``--durations FILE`` (right after OUT_JSON) a run that passed also writes the seconds of every test that
took ``DURATION_S`` or more: the file ``tests/conftest.py`` reads to hand the longest tests out first
(``tests/durations.json``). Give it the whole suite: a test the run left out drops to the back of the order.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from replaynoise.provenance import git_commit

REPO = Path(__file__).resolve().parents[1]
#: Where the plugin writes its per-worker records (set by the driver below, read in the workers).
RECORD_DIR = "SUITE_TIMES_DIR"
LONG_S = 20.0
#: The shortest test ``--durations`` records: the rest keep their collected order behind the recorded ones.
DURATION_S = 5.0


def _record(kind: str, nodeid: str) -> None:
    folder = os.environ.get(RECORD_DIR)
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(folder) / f"{worker}.tsv", "a") as f:
            f.write(f"{time.time():.3f}\t{kind}\t{nodeid}\n")


def pytest_runtest_logstart(nodeid, location):
    _record("start", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _record("end", nodeid)


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _sample_busy(shares: list[float], done: threading.Event, every: float = 5.0) -> None:
    before = _cpu_ticks()
    while not done.wait(every):
        now = _cpu_ticks()
        if now[1] > before[1]:
            shares.append((now[0] - before[0]) / (now[1] - before[1]))
        before = now


def _timeline(folder: Path, started: float) -> tuple[dict[str, float], list[dict]]:
    """When each worker finished (seconds after the start), and the tests that took ``DURATION_S`` or more."""
    finished, long_tests = {}, []
    # gw0, gw1, ... under -n (where xdist's controller writes main.tsv too, as the workers' reports arrive); main
    # alone without it
    for path in sorted(folder.glob("gw*.tsv")) or sorted(folder.glob("main.tsv")):
        worker, opened = path.stem, {}
        for line in path.read_text().splitlines():
            stamp, kind, nodeid = line.split("\t")
            if kind == "start":
                opened[nodeid] = float(stamp)
            elif nodeid in opened:
                begin, end = opened.pop(nodeid), float(stamp)
                finished[worker] = max(finished.get(worker, 0.0), round(end - started, 1))
                if end - begin >= DURATION_S:
                    long_tests.append(
                        {
                            "test": nodeid,
                            "worker": worker,
                            "start_s": round(begin - started, 1),
                            "end_s": round(end - started, 1),
                            "seconds": round(end - begin, 1),
                        }
                    )
    return finished, sorted(long_tests, key=lambda t: t["start_s"])


def durations_record(record: dict, long_tests: list[dict]) -> dict:
    """What ``tests/durations.json`` holds: where its seconds were measured, and each long test's seconds (a
    test a shared fixture was built in counts that build)."""
    return {
        "measured": {key: record[key] for key in ("commit", "dirty", "command", "cpu_count", "wall_s")},
        "seconds": {t["test"]: t["seconds"] for t in sorted(long_tests, key=lambda t: t["test"])},
    }


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out, args = Path(sys.argv[1]), sys.argv[2:]
    durations = None
    if args[:1] == ["--durations"]:
        if len(args) < 2 or args[1].startswith("-"):
            sys.exit("--durations needs the file to write (tests/durations.json), right after OUT_JSON")
        durations, args = Path(args[1]), args[2:]
    args = args or ["-n", "auto"]
    command = [sys.executable, "-m", "pytest", "-p", "suite_times", *args]
    with tempfile.TemporaryDirectory() as folder:
        paths = [str(REPO / "benchmarks"), os.environ.get("PYTHONPATH")]
        env = dict(os.environ, **{RECORD_DIR: folder}, PYTHONPATH=os.pathsep.join(filter(None, paths)))
        shares, done, tail = [], threading.Event(), []
        sampler = threading.Thread(target=_sample_busy, args=(shares, done), daemon=True)
        started = time.time()
        sampler.start()
        with subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as proc:
            for line in proc.stdout:  # pytest's own output, as it comes
                sys.stdout.write(line)
                tail = [*tail[-20:], line.rstrip("\n")]
        wall = time.time() - started
        done.set()
        finished, long_tests = _timeline(Path(folder), started)
    summary = next(
        (
            line.strip("= ")
            for line in reversed(tail)  # framed by "=" unless -q
            if re.search(r"\b(passed|failed|errors?|skipped)\b.* in [\d.]+s", line)
        ),
        "",
    )
    record = {
        **git_commit(REPO),
        "command": ["python", "-m", "pytest", *args],
        "exit_status": proc.returncode,
        "wall_s": round(wall, 1),
        "summary": summary,
        "cpu_count": os.cpu_count(),
        "cores_busy_share": round(sum(shares) / len(shares), 3) if shares else None,
        "workers_finished_s": finished,
        "tests_of_20_s_or_more": [t for t in long_tests if t["seconds"] >= LONG_S],
        "slurm_required": os.environ.get("REPLAYNOISE_REQUIRE_SLURM") == "1",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    if durations is not None and proc.returncode == 0:  # a failed run's seconds would reorder the suite by a fault
        durations.write_text(json.dumps(durations_record(record, long_tests), indent=1) + "\n")
    print(
        f"{summary}\nwall {wall:.0f} s ({wall // 60:.0f} min {wall % 60:.0f} s), cores busy "
        f"{record['cores_busy_share']}, workers finished at {finished} s; exit {proc.returncode}"
    )
    for t in record["tests_of_20_s_or_more"]:
        print(f"  {t['start_s']:7.1f} {t['end_s']:7.1f} {t['seconds']:6.1f} {t['worker']} {t['test']}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
