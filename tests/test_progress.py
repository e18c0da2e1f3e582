"""Where a long step's time goes: phases, the closing log lines a benchmark reads, and per-rule profiles."""

from __future__ import annotations

import pstats
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replaynoise.progress import Phases, TokenProgress

REPO = Path(__file__).resolve().parents[1]


def test_phases_sum_each_name_and_wait_for_the_device_at_both_ends():
    waits = []
    phases = Phases(sync=lambda: waits.append(time.perf_counter()))
    for _ in range(2):
        with phases("prefill"):
            time.sleep(0.01)
    with phases("decode"):
        pass
    assert list(phases.seconds) == ["prefill", "decode"]
    assert phases.seconds["prefill"] >= 0.02 and phases.seconds["decode"] < phases.seconds["prefill"]
    assert len(waits) == 6  # before and after every phase: queued device work is charged where it was queued
    assert phases.summary().startswith("prefill 0.0") and ", decode 0.00 s" in phases.summary()


def test_a_phase_that_raises_is_still_counted():
    phases = Phases()
    with pytest.raises(RuntimeError), phases("load"):
        raise RuntimeError("boom")
    assert "load" in phases.seconds


def test_the_closing_lines_give_the_loop_rate_and_the_phases(capsys):
    progress = TokenProgress(4, "exact t")
    progress.rows(4, 40)
    engine, writer = Phases(), Phases()
    with engine("decode"):
        pass
    progress.close(engine, writer)  # a phase set with nothing in it adds nothing
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("exact t: done, 4 rows, 40 generated tokens in ") for line in err)
    assert [line for line in err if "time by phase" in line] == ["exact t: time by phase: decode 0.00 s"]


def test_replaynoise_profile_writes_one_readable_profile_per_step(tmp_path):
    log = tmp_path / "logs" / "replay_exact" / "tiny.000.log"
    code = f"from replaynoise.logs import log_to\nlog_to({str(log)!r})\nsum(i * i for i in range(10000))\n"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "REPLAYNOISE_PROFILE": str(tmp_path / "prof")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=tmp_path)
    written = tmp_path / "prof" / "replay_exact.tiny.000.prof"
    assert written.is_file()
    assert pstats.Stats(str(written)).total_calls > 0
    subprocess.run([sys.executable, "-c", code], check=True, env={**env, "REPLAYNOISE_PROFILE": ""}, cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "prof").iterdir()) == ["replay_exact.tiny.000.prof"]
