"""Per-rule logs: a step's stderr, warnings and logging all go to the rule's log file.

With ``REPLAYNOISE_PROFILE=DIR`` in the environment every step also writes a cProfile of its main thread to
``DIR/<rule>.<wildcards>.prof`` (named after its log file) when it exits normally (a job killed by a signal
writes none), so a slow rule of a real run can be read with ``python -m pstats`` without changing the workflow.
cProfile does not see into compiled or CUDA work, which it charges to the call that waits for it;
``benchmarks/profile_pass.py`` profiles a pass's device work."""

from __future__ import annotations

import atexit
import cProfile
import logging
import os
import sys
from pathlib import Path


def log_to(path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    stream = open(path, "w", buffering=1)  # noqa: SIM115 - lives as long as the step's process
    sys.stderr = stream
    logging.basicConfig(
        stream=stream, level=logging.INFO, force=True, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.captureWarnings(True)
    if os.environ.get("REPLAYNOISE_PROFILE"):
        name = f"{Path(path).parent.name}.{Path(path).stem}.prof"
        profile_until_exit(Path(os.environ["REPLAYNOISE_PROFILE"]) / name)


def profile_until_exit(out: Path) -> cProfile.Profile:
    """Profile the rest of this process; the statistics are written to ``out`` when it exits."""
    out.parent.mkdir(parents=True, exist_ok=True)
    profiler = cProfile.Profile()
    profiler.enable()

    def dump() -> None:
        profiler.disable()
        profiler.dump_stats(str(out))

    atexit.register(dump)
    return profiler
