"""Engines behind one interface (see base.py). The pipeline asks ``make_engine`` and never branches on which."""

from __future__ import annotations

import sys
from pathlib import Path

from replaynoise.engines.base import Engine
from replaynoise.progress import Phases, process_seconds
from replaynoise.settings import EngineSettings, compute_threads

ENGINES = ("hf", "vllm")


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
    if s.engine == "hf":
        with startup("imports"):
            from replaynoise.engines.hf import HFEngine
            from replaynoise.loading import load_weights, model_weights_dir, stop_token_ids
        with startup("weights check"):
            weights = model_weights_dir(Path(model_dir))
        with startup("model load"):
            model, tokenizer = load_weights(weights, s.dtype, s.device)
        with startup("engine build"):
            shape = {key: value for key, value in (("invariant_rows", s.invariant_rows),
                                                   ("invariant_context", s.invariant_context)) if value is not None}
            engine = HFEngine(model, tokenizer, kernels=s.kernels, topk=topk, decode=s.decode,
                              cpu_matmul=s.cpu_matmul, stop_ids=stop_token_ids(tokenizer, s.stop), **shape)
    elif s.engine == "vllm":
        with startup("imports"):
            from replaynoise.engines.vllm import VLLMEngine
            from replaynoise.engines.vllm_build import build_llm, check_invariant_platform
            from replaynoise.loading import eos_ids, load_tokenizer, model_weights_dir, stop_token_ids

        if s.kernels == "invariant":
            check_invariant_platform(s.device)
        with startup("weights check"):
            weights = model_weights_dir(Path(model_dir))
        with startup("engine build"):  # vLLM loads the weights, compiles and captures its graphs here
            tokenizer = load_tokenizer(weights)
            llm = build_llm(weights, settings, topk=topk, threads=threads)
            engine = VLLMEngine(llm, tokenizer, eos_ids(weights, tokenizer), topk=topk,
                                block_size=settings["block_size"],
                                stop_ids=stop_token_ids(tokenizer, s.stop))
    else:
        raise ValueError(f"engine must be one of {ENGINES}, got {s.engine!r}")
    before = "" if started is None else f"process before the engine {started:.2f} s, "
    print(f"engine start-up by phase: {before}{startup.summary()}", file=sys.stderr)
    return engine
