"""Engines behind one interface (see base.py). The pipeline asks ``make_engine`` and never branches on which."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from replaynoise.engines.base import Engine
from replaynoise.engines.registry import ENGINES
from replaynoise.progress import Phases, process_seconds
from replaynoise.settings import EngineSettings, compute_threads


def make_engine(settings: dict, model_dir: Path, *, topk: int, threads: int) -> Engine:
    """Build the engine a configuration names (``settings``: as validated), with its model loaded offline. On CPU it
    computes with the configuration's ``cpu_threads``, not the job's ``threads`` (``settings.compute_threads``).

    A platform that cannot do what the configuration asks (vLLM invariant mode off CUDA cc >= 8.0) stops here,
    before the model is loaded. The log gets one line of where the start-up went: a 7B job's fixed cost is
    otherwise invisible beside its loop.
    """
    s = EngineSettings.of(settings)
    threads = compute_threads(settings, threads)
    started = process_seconds()
    startup = Phases()
    with startup("imports"):
        import torch

    torch.set_num_threads(threads)
    if s.engine not in ENGINES:
        raise ValueError(f"engine must be one of {sorted(ENGINES)}, got {s.engine!r}")
    module, function = ENGINES[s.engine].build.split(":")
    with startup("imports"):  # the one lazy import: an engine's heavy dependencies load only when it is built
        build = getattr(importlib.import_module(module), function)
    engine = build(settings, Path(model_dir), topk=topk, threads=threads, startup=startup)
    before = "" if started is None else f"process before the engine {started:.2f} s, "
    print(f"engine start-up by phase: {before}{startup.summary()}", file=sys.stderr)
    return engine
