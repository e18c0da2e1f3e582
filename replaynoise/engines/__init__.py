"""Engines behind one interface (see base.py). The pipeline asks ``make_engine`` and never branches on which."""

from __future__ import annotations

from pathlib import Path

from replaynoise.engines.base import Engine

ENGINES = ("hf",)


def make_engine(settings: dict, model_dir: Path, *, topk: int, threads: int) -> Engine:
    """Build the engine a configuration names, with its model loaded offline."""
    import torch

    torch.set_num_threads(threads)
    if settings["engine"] == "hf":
        from replaynoise.engines.hf import HFEngine
        from replaynoise.models import load_model

        model, tokenizer = load_model(model_dir, settings["dtype"], settings["device"])
        return HFEngine(model, tokenizer, kernels=settings["kernels"], topk=topk)
    raise ValueError(f"engine must be one of {ENGINES}, got {settings['engine']!r}")
