"""What the steps read from a validated config (``config.validate_config``), typed and frozen, with the meaning of
every key that is absent unless given written here and nowhere else.

The validated mapping is what the analysis hash and the rerun triggers read. Keys the schema marks
``x-absent-default`` stay absent from it, so adding such a key to the schema changed no committed run's hash; a
step turns the mapping its rule passes (``params``) into these types, which resolve those keys once. Every other
key is filled by the validator, so a missing one here is an error, never a silent default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: rows of the invariant decoder shape, and the prompt tokens its derived length leaves room for (config.py fills
#: both into every HF invariant configuration that decodes statically)
INVARIANT_ROWS, INVARIANT_PROMPT = 64, 512
#: the invariant decoder's slots in an engine built without a configuration (a configuration's own are derived
#: from its budgets)
INVARIANT_CONTEXT = 1024
#: the intra-op threads a configuration's model steps compute with on CPU where it does not say (``cpu_threads``)
CPU_THREADS = 2


def compute_threads(settings: Mapping, threads: int) -> int:
    """The threads a model step computes with: on CPU the configuration's ``cpu_threads`` (absent: CPU_THREADS),
    whatever the job was given, since the CPU kernels sum in an order that follows their thread count and a run's
    numbers must not follow Snakemake's --cores or resources.threads; on a GPU, where the kernels do not, the
    job's own ``threads`` (host-side work)."""
    if str(settings["device"]).startswith("cuda"):
        return threads
    return int(settings.get("cpu_threads", CPU_THREADS))


#: what a small model's vLLM process holds on the GPU besides its KV cache (weights, activations, CUDA context):
#: a job of a cache of kv_cache_gib asks for that much more of the GPU (engines.vllm_build.gpu_memory_share)
GPU_HEADROOM_GIB = 8.0


def gpu_reservation_gib(settings: Mapping) -> int:
    """GiB of a GPU a model job of this configuration asks for at its start: a vLLM cache of kv_cache_gib (the
    share left null) and its headroom, rounded up; 0 where the job names no such amount (a share of whatever GPU
    it gets, the HF engine, CPU)."""
    vllm = settings.get("vllm") or {}
    if settings.get("engine") != "vllm" or not str(settings.get("device")).startswith("cuda") \
            or vllm.get("gpu_memory_utilization") is not None:
        return 0
    return int(-(-(settings["kv_cache_gib"] + GPU_HEADROOM_GIB) // 1))


@dataclass(frozen=True)
class EngineSettings:
    """What builds a configuration's engine (``engines.make_engine``)."""

    engine: str
    dtype: str
    device: str
    kernels: str
    decode: str
    cpu_matmul: str
    #: texts that end a response (``stop``; absent: none)
    stop: tuple[str, ...]
    #: the invariant decoder's shape where the configuration decodes with one (filled by config.py), else None
    invariant_rows: int | None
    invariant_context: int | None

    @classmethod
    def of(cls, settings: Mapping) -> EngineSettings:
        return cls(engine=settings["engine"], dtype=settings["dtype"], device=settings["device"],
                   kernels=settings["kernels"], decode=settings["decode"], cpu_matmul=settings["cpu_matmul"],
                   stop=tuple(stop_texts(settings)), invariant_rows=settings.get("invariant_rows"),
                   invariant_context=settings.get("invariant_context"))


@dataclass(frozen=True)
class PromptSettings:
    """How a problem becomes a prompt (``prompt``)."""

    style: str
    instruction: str
    #: worked examples put before the question (``prompt.shots``; absent: none)
    shots: tuple[Mapping, ...]

    @classmethod
    def of(cls, prompt: Mapping) -> PromptSettings:
        return cls(style=prompt["style"], instruction=prompt["instruction"], shots=tuple(prompt.get("shots", ())))


def long_prompts(rollouts: Mapping) -> str:
    """What the rollout step does with a prompt that leaves no room for its budgets (``rollouts.long_prompts``;
    absent: refuse)."""
    return rollouts.get("long_prompts", "refuse")


def stop_texts(settings: Mapping) -> list[str]:
    """A configuration's stop texts (``stop``; absent: none), as a trained model's recipe records them."""
    return list(settings.get("stop", []))


def cross_scoring(analysis: Mapping) -> list[tuple[str, str]]:
    """The (rollouts, scorer) configuration pairs of ``analysis.cross_scoring`` (absent: none)."""
    return [(pair["rollouts"], pair["scorer"]) for pair in analysis.get("cross_scoring", [])]
