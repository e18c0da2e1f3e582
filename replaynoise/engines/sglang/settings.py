"""The SGLang engine's settings, read when a configuration is read (no SGLang or torch import): its ``sglang`` block
filled with SGLang's own defaults (null: SGLang decides, as its ``ServerArgs`` would), and what the engine cannot
measure faithfully, refused by key before any job (docs/sglang.md has the source reading behind each refusal)."""

from __future__ import annotations

import copy
from collections.abc import Callable

from replaynoise.settings import ConfigError, refuse_hf_only_keys

#: attention backends under which SGLang 0.5.16's deterministic mode keeps its radix cache on
#: (``arg_groups/overrides.py``; flashinfer turns it off, so an exact pass could not read the decode-time state)
DETERMINISTIC_RADIX_BACKENDS = ("fa3", "fa4", "triton")


def prepare(
    name: str, settings: dict, given: dict, *, schema: dict, validate: Callable, fill_defaults: Callable
) -> None:
    """Fill ``settings["sglang"]`` from the block as ``given``: the values given checked by type first, then the
    schema's defaults (SGLang's own)."""
    validate(schema, given, f"configs.{name}.sglang")
    settings["sglang"] = fill_defaults(schema, copy.deepcopy(given))


def derive(name: str, settings: dict, replay: dict) -> None:
    """Nothing is derived once the block is filled (``prepare``)."""


def check(
    name: str, settings: dict, *, controls: list[str], budget: int, context: int | None, heads: int | None, gpus: int
) -> None:
    """An sglang configuration against what the engine can do faithfully (``controls``: the transplant and
    precision passes of the run, which need the KV in hand)."""
    refuse_hf_only_keys(name, settings)
    s = settings["sglang"]
    if controls:
        raise ConfigError(
            f"config key configs.{name}.engine: sglang keeps its KV inside SGLang, so it cannot run the passes "
            f"{controls} of replay.passes (transplants, precision arms and refeed_cached, whose prompt KV comes "
            "from a prefill of its own, are built by the HF engine only); use engine: hf for this configuration, "
            "or drop those passes"
        )
    if not settings["device"].startswith("cuda"):
        raise ConfigError(
            f"config key configs.{name}.device: {settings['device']!r} with engine sglang, whose wheels run on "
            "NVIDIA GPUs only (no CPU backend); use device: cuda, or engine: vllm or hf on a CPU"
        )
    if s["disable_radix_cache"]:
        raise ConfigError(
            f"config key configs.{name}.sglang.disable_radix_cache: true, but the exact pass resumes from the "
            "decode-time KV that the radix cache keeps; remove it"
        )
    backend = s["attention_backend"]
    if settings["kernels"] == "invariant" and backend is not None and backend not in DETERMINISTIC_RADIX_BACKENDS:
        raise ConfigError(
            f"config key configs.{name}.sglang.attention_backend: {backend!r} with kernels invariant; SGLang's "
            f"deterministic mode keeps the radix cache only with {', '.join(DETERMINISTIC_RADIX_BACKENDS)} "
            "(the exact pass needs it), so use one of those or null (fa3 on Hopper)"
        )
    if context is not None and s["context_length"] is not None and s["context_length"] > context:
        raise ConfigError(
            f"config key configs.{name}.sglang.context_length: {s['context_length']} is beyond the {context} "
            f"positions {settings['model']} attends over; lower it or leave it null"
        )
    pool = s.get("max_total_tokens")
    if pool is not None and pool <= budget:
        raise ConfigError(
            f"config key configs.{name}.sglang.max_total_tokens: a KV pool of {pool} tokens cannot hold one request "
            f"of a prompt plus {budget} rollout and continuation tokens; raise it or remove it"
        )
    if s["context_length"] is not None and s["context_length"] <= budget:
        raise ConfigError(
            f"config key configs.{name}.sglang.context_length: {s['context_length']} positions do not hold a "
            f"prompt plus {budget} rollout and continuation tokens; raise it or leave it null"
        )
