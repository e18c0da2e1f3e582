"""Engines behind one interface (see base.py). The pipeline asks ``make_engine`` and never branches on which."""

from __future__ import annotations

from pathlib import Path

from replaynoise.engines.base import Engine

ENGINES = ("hf", "vllm")


def make_engine(settings: dict, model_dir: Path, *, topk: int, threads: int) -> Engine:
    """Build the engine a configuration names, with its model loaded offline.

    A platform that cannot do what the configuration asks (vLLM invariant mode off CUDA cc >= 8.0) stops here,
    before the model is loaded.
    """
    import torch

    torch.set_num_threads(threads)
    if settings["engine"] == "hf":
        from replaynoise.engines.hf import HFEngine
        from replaynoise.models import load_model, stop_token_ids

        model, tokenizer = load_model(model_dir, settings["dtype"], settings["device"])
        return HFEngine(model, tokenizer, kernels=settings["kernels"], topk=topk,
                        decode=settings.get("decode", "auto"), cpu_matmul=settings.get("cpu_matmul", "fp32"),
                        stop_ids=stop_token_ids(tokenizer, settings.get("stop", [])),
                        **{key: settings[key] for key in ("invariant_rows", "invariant_context") if key in settings})
    if settings["engine"] == "vllm":
        from replaynoise.engines.vllm import VLLMEngine, build_llm, check_invariant_platform
        from replaynoise.models import eos_ids, load_tokenizer, model_weights_dir, stop_token_ids

        if settings["kernels"] == "invariant":
            check_invariant_platform(settings["device"])
        weights = model_weights_dir(Path(model_dir))
        tokenizer = load_tokenizer(weights)
        llm = build_llm(weights, settings, topk=topk, threads=threads)
        return VLLMEngine(llm, tokenizer, eos_ids(weights, tokenizer), topk=topk,
                          block_size=settings["block_size"],
                          stop_ids=stop_token_ids(tokenizer, settings.get("stop", [])))
    raise ValueError(f"engine must be one of {ENGINES}, got {settings['engine']!r}")
