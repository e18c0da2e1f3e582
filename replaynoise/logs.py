"""Per-rule logs: a step's stderr, warnings and logging all go to the rule's log file."""

from __future__ import annotations

import logging
import sys
from pathlib import Path


def log_to(path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    stream = open(path, "w", buffering=1)  # noqa: SIM115 - lives as long as the step's process
    sys.stderr = stream
    logging.basicConfig(stream=stream, level=logging.INFO, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)
