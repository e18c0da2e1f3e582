"""Per-request seeds for SGLang's stock kernels: a hook that SGLang applies in each of its processes, the scheduler's
included. Each of them imports this module first (the engine names it their main module while it starts them:
``launch.children_import_plugin``), and where replaynoise is installed SGLang's plugin loader also finds it by its
entry point (group ``sglang.srt.plugins``, pyproject.toml); registered twice, the hook acts once.

SGLang 0.5.16 builds a batch's per-request ``sampling_seed`` tensor only under ``enable_deterministic_inference``
(``SamplingBatchInfo.from_schedule_batch``); otherwise every draw comes from the scheduler's one generator, so a rollout
cannot be regenerated and two passes share no random numbers (reference/gpu-sglang/sglang-source-reading.md, "The
obstacle"). Given that tensor, its own sampler draws each row by a Gumbel-max hashed from (seed, position, token id),
whatever the kernels: this plugin builds the tensor in stock mode too, and touches nothing else (the model's kernels
stay stock). It acts only where the engine asks for it (``SEEDED``), so an environment that has replaynoise installed
serves others as SGLang would.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

try:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
except ImportError:  # replaynoise without SGLang (CI, the other engines): only SGLang's own processes register the hook
    HookRegistry = HookType = None

log = logging.getLogger(__name__)

#: set to "1" in the environment of the SGLang processes whose stock sampling should draw from per-request seeds
SEEDED = "REPLAYNOISE_SGLANG_SEEDED_SAMPLING"
#: what the hook wraps: the one place a batch's sampling tensors are built (filter and merge keep the seed tensor)
TARGET = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.from_schedule_batch"


def seed_tensor(info: Any, batch: Any, *_: Any, **__: Any) -> Any:
    """SGLang's after-hook on ``from_schedule_batch``: the batch's sampling info with one seed per request, as SGLang
    builds it in its deterministic mode. A request without a seed (the engine's prefix-scoring requests, greedy) gets
    SGLang's own default there, 42."""
    if info.sampling_seed is None:
        seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
        info.sampling_seed = torch.tensor([42 if s is None else s for s in seeds], dtype=torch.int64).to(batch.device)
    return info


def register(registry: Any = None, after: Any = None) -> bool:
    """SGLang's plugin loader calls this in each process it starts; it hooks ``TARGET`` where ``SEEDED`` asks for it.
    ``registry``/``after``: SGLang's ``HookRegistry`` and ``HookType.AFTER`` (given by tests). Returns whether it
    hooked."""
    if os.environ.get(SEEDED) != "1":
        return False
    if registry is None:
        registry, after = HookRegistry, HookType.AFTER
    registry.register(TARGET, _after_hook, after)
    log.info("replaynoise: per-request sampling seeds in stock mode (%s)", TARGET)
    return True


def _after_hook(info: Any, cls: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """The hook as SGLang calls an AFTER hook of a classmethod: (result, cls, *arguments)."""
    return seed_tensor(info, batch, *args, **kwargs)


if __name__ == "__mp_main__":  # imported first by a process SGLang spawned (launch.children_import_plugin)
    register()
