"""The vLLM engine's settings, read when a configuration is read (no vLLM or torch import): its ``vllm`` block filled
with the paper's regime (derived defaults by device and kernels), and what vLLM would refuse only once the engine
is built, minutes into a job, refused here by key."""

from __future__ import annotations

import copy
from collections.abc import Callable

from replaynoise.settings import ConfigError, refuse_hf_only_keys


def prepare(
    name: str, settings: dict, given: dict, *, schema: dict, validate: Callable, fill_defaults: Callable
) -> None:
    """Fill ``settings["vllm"]`` from the block as ``given``: the values given checked by type first (a string
    "yes" is no boolean), then the defaults a device or kernel mode derives, then the schema's."""
    validate(schema, given, f"configs.{name}.vllm")
    if settings.get("kernels") == "invariant":
        if given.get("eager") is False:
            raise ConfigError(
                f"config key configs.{name}.vllm.eager: false with kernels invariant - the engine's "
                "row-invariant add-RMSNorm and top-k/top-p replace vLLM's custom-op path, which compiled "
                "mode does not take (its norms are then compiled per batch shape); use eager: true (the "
                "default under invariant)"
            )
        given = {**given, "eager": True}
    if settings.get("device") == "cpu":
        if given.get("async_scheduling") is True:
            raise ConfigError(
                f"config key configs.{name}.vllm.async_scheduling: true on device cpu, where "
                "vLLM's CPU backend always turns it off; remove it or set it false"
            )
        # CUDA graphs are a GPU's; torch.compile of a model on a CPU costs minutes a job, for nothing here
        given = {"eager": True, **given, "async_scheduling": False}
    settings["vllm"] = fill_defaults(schema, copy.deepcopy(given))


def derive(name: str, settings: dict, replay: dict) -> None:
    """Nothing is derived once the block is filled (``prepare``)."""


def check(
    name: str, settings: dict, *, controls: list[str], budget: int, context: int | None, heads: int | None, gpus: int
) -> None:
    """A vllm configuration's settings against the control passes of the run (``controls``: transplants and
    precision arms, which need the KV in hand), its model (``context``: positions, ``heads``) and ``gpus`` (the
    most a job may hold)."""
    refuse_hf_only_keys(name, settings)
    _check_platform(name, settings, controls)
    _check_engine_settings(name, settings, budget, context, heads, gpus)


def _check_platform(name: str, settings: dict, controls: list[str]) -> None:
    """Engine/platform combinations that can be refused from the configuration alone (parse time)."""
    if controls:
        raise ConfigError(
            f"config key configs.{name}.engine: vllm keeps its KV inside vLLM, so it cannot run "
            f"the passes {controls} of replay.passes (transplants, precision arms and refeed_cached, whose "
            "prompt KV comes from a prefill of its own, are built by the HF engine only); use engine: hf for "
            "this configuration, or drop those passes"
        )
    if settings["device"] == "cpu" and settings["block_size"] % 32:
        raise ConfigError(
            f"config key configs.{name}.block_size: {settings['block_size']} is not a multiple of "
            "32, which vLLM's CPU attention backend needs"
        )
    if settings["device"] == "cpu" and settings["kernels"] == "invariant":
        raise ConfigError(
            f"config key configs.{name}.kernels: 'invariant' with engine vllm needs an NVIDIA GPU "
            "of compute capability >= 8.0 (VLLM_BATCH_INVARIANT); device is 'cpu', where vLLM has "
            "no batch-invariant kernels. Use kernels: stock, or engine: hf"
        )


def _check_engine_settings(
    name: str, settings: dict, budget: int, context: int | None, heads: int | None, gpus: int
) -> None:
    """What vLLM would refuse only once the engine is built, minutes into a job, refused by key here (``context``
    and ``heads``: the model's positions and attention heads, as ``_check_semantics`` read them; ``gpus``: the
    most a job may hold)."""
    v = settings["vllm"]
    tp = tensor_parallel_size(settings)
    if tp > 1 and settings["device"] == "cpu":
        raise ConfigError(
            f"config key configs.{name}.vllm.tensor_parallel_size: {tp} on device cpu; tensor "
            "parallelism splits a model across GPUs (device: cuda), set it to 1"
        )
    if tp > gpus:
        raise ConfigError(
            f"config key configs.{name}.vllm.tensor_parallel_size: {tp} GPUs per job, but "
            f"resources.gpus lets a job hold {gpus}; raise resources.gpus to {tp} or lower it"
        )
    if heads is not None and heads % tp:
        raise ConfigError(
            f"config key configs.{name}.vllm.tensor_parallel_size: {tp} does not divide the {heads} "
            f"attention heads of {settings['model']}; use a divisor of {heads}"
        )
    if v["max_model_len"] <= budget:
        raise ConfigError(
            f"config key configs.{name}.vllm.max_model_len: {v['max_model_len']} positions do not hold "
            f"a prompt plus {budget} rollout and continuation tokens (configs.{name}.max_new_tokens + "
            "replay.max_new_tokens); raise it"
        )
    if context is not None and v["max_model_len"] > context:
        raise ConfigError(
            f"config key configs.{name}.vllm.max_model_len: {v['max_model_len']} is beyond the "
            f"{context} positions {settings['model']} attends over; lower it"
        )
    if not v["chunked_prefill"] and v["max_num_batched_tokens"] < v["max_model_len"]:
        raise ConfigError(
            f"config key configs.{name}.vllm.max_num_batched_tokens: {v['max_num_batched_tokens']} is "
            f"below max_model_len {v['max_model_len']} with chunked_prefill false, so a long prompt "
            "could never be scheduled; raise it or turn chunked_prefill on"
        )
    if v["max_num_batched_tokens"] < v["max_num_seqs"]:
        raise ConfigError(
            f"config key configs.{name}.vllm.max_num_batched_tokens: {v['max_num_batched_tokens']} is "
            f"below max_num_seqs {v['max_num_seqs']}: a decode step of that many sequences would not fit"
        )


def tensor_parallel_size(settings: dict) -> int:
    """GPUs a configuration's model is split across: its vllm.tensor_parallel_size where given, else 1 (vLLM's
    default, and the HF engine's one GPU). The key is absent unless given: see the schema."""
    return (settings.get("vllm") or {}).get("tensor_parallel_size", 1)
