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


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


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
#: a job of a cache of kv_cache_gib asks for that much more of the GPU (engines.vllm.build.gpu_memory_share)
GPU_HEADROOM_GIB = 8.0


def gpu_reservation_gib(settings: Mapping) -> int:
    """GiB of a GPU a model job of this configuration asks for at its start: a vLLM cache of kv_cache_gib (the
    share left null) and its headroom, rounded up; 0 where the job names no such amount (a share of whatever GPU
    it gets, the HF engine, CPU)."""
    vllm = settings.get("vllm") or {}
    if (
        settings.get("engine") != "vllm"
        or not str(settings.get("device")).startswith("cuda")
        or vllm.get("gpu_memory_utilization") is not None
    ):
        return 0
    return int(-(-(settings["kv_cache_gib"] + GPU_HEADROOM_GIB) // 1))


#: configuration keys that only the HF engine reads (absent unless given): another engine refuses them
HF_ONLY_KEYS = ("static_rows", "compile_rollouts", "static_attention")
#: configuration keys that only the passes read (the rollouts' step is not given them, so a change reruns the passes)
PASS_ONLY_KEYS = ("static_rows",)
#: configuration keys that only the rollouts' step reads (the passes' steps are not given them, so their settings
#: name what they read)
ROLLOUT_ONLY_KEYS = ("compile_rollouts",)


def refuse_hf_only_keys(name: str, settings: Mapping) -> None:
    """Another engine's configuration that gives a key only the HF engine reads, which would change nothing."""
    for key in HF_ONLY_KEYS:
        if key in settings:
            raise ConfigError(
                f"config key configs.{name}.{key}: read by the HF engine alone, and this configuration runs "
                f"engine {settings['engine']}; remove it"
            )


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
    #: the most rows of a stock static continuation decoder (``static_rows``; absent: a batch's own)
    static_rows: int | None = None
    #: the stock static rollout decoder's layers compiled by inductor (``compile_rollouts``; absent: eager)
    compile_rollouts: bool = False
    #: the stock static decoders' attention (``static_attention``; absent: the run's default)
    static_attention: str | None = None

    @classmethod
    def of(cls, settings: Mapping) -> EngineSettings:
        return cls(
            engine=settings["engine"],
            dtype=settings["dtype"],
            device=settings["device"],
            kernels=settings["kernels"],
            decode=settings["decode"],
            cpu_matmul=settings["cpu_matmul"],
            stop=tuple(stop_texts(settings)),
            invariant_rows=settings.get("invariant_rows"),
            invariant_context=settings.get("invariant_context"),
            static_rows=settings.get("static_rows"),
            compile_rollouts=bool(settings.get("compile_rollouts", False)),
            static_attention=settings.get("static_attention"),
        )


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


def stop_texts(settings: Mapping) -> list[str]:
    """A configuration's stop texts (``stop``; absent: none), as a trained model's recipe records them."""
    return list(settings.get("stop", []))


def cross_scoring(analysis: Mapping) -> list[tuple[str, str]]:
    """The (rollouts, scorer) configuration pairs of ``analysis.cross_scoring`` (absent: none)."""
    return [(pair["rollouts"], pair["scorer"]) for pair in analysis.get("cross_scoring", [])]


#: what the rollout step does with a prompt past the context where the configuration does not say
#: (``rollouts.long_prompts``, a key absent from the validated mapping unless given)
LONG_PROMPTS_ABSENT = "refuse"


@dataclass(frozen=True)
class RolloutSettings:
    """How the rollout step samples and batches (``rollouts``)."""

    per_problem: int
    batch_size: int
    #: what a prompt past the context does: "refuse" stops the step, "skip" leaves its problem out
    long_prompts: str

    @classmethod
    def of(cls, rollouts: Mapping) -> RolloutSettings:
        return cls(
            per_problem=rollouts["per_problem"],
            batch_size=rollouts["batch_size"],
            long_prompts=rollouts.get("long_prompts", LONG_PROMPTS_ABSENT),
        )


#: the least share of exact's pivots that must resume a verified decode-time state where ``analysis.min_verified``
#: is absent: exact's pivots that miss it are left out of every comparison, and where more than 1% miss it the
#: loss is more likely the replay failing than a sample of pivots
MIN_VERIFIED = 0.99


@dataclass(frozen=True)
class AnalysisSettings:
    """The section-4 comparison's settings (``analysis``, and the root ``seed`` its bootstraps draw from): one
    reading of the block, for the workflow's rules and a reference's rebuild alike, so that a rebuild cannot
    analyse otherwise than the run did."""

    theta: float
    n_boot: int
    min_eligible: int
    ci: float
    metric: str
    margin_split: float
    eligibility: str
    seed: int
    #: the critical-set thresholds swept (None: the lattice of the run's K values); not a configuration key
    theta_sweep: tuple[float, ...] | None = None
    #: the least share of exact's pivots that must resume a verified decode-time state (``min_verified``)
    min_verified: float = MIN_VERIFIED

    @classmethod
    def of(cls, analysis: Mapping, seed: int) -> AnalysisSettings:
        return cls(
            theta=analysis["theta"],
            n_boot=analysis["n_boot"],
            min_eligible=analysis["min_eligible"],
            ci=analysis["ci"],
            metric=analysis["metric"],
            margin_split=analysis["margin_split"],
            eligibility=analysis["eligibility"],
            seed=seed,
            min_verified=float(analysis.get("min_verified", MIN_VERIFIED)),
        )


#: the engine of a configuration recorded before configurations named theirs (provenance of the first runs)
ENGINE_BEFORE_THE_KEY = "hf"

#: the disagreement metric of a comparison written before comparisons named theirs (reference/cpu's first
#: three configurations): the sign metric, the only one there was
METRIC_BEFORE_THE_KEY = "sign"


def comparison_metric(comparison: Mapping) -> str:
    """The headline disagreement metric a written comparison (``compare_passes`` output) used."""
    return str(comparison.get("metric", METRIC_BEFORE_THE_KEY))


#: the re-feed and replica draws of a run whose provenance predates ``replay.replicates``: one of each
REPLICATES_BEFORE_THE_KEY = 1


def replicates(replay: Mapping) -> int:
    """The draws of each replayed pass a replay block asks for (``replay.replicates``): a validated block always
    names them; a committed run's provenance written before the key does not."""
    return int(replay.get("replicates", REPLICATES_BEFORE_THE_KEY))


@dataclass(frozen=True)
class ReplaySettings:
    """How a pass replays its pivots (``replay``)."""

    #: continuations per branch
    k: int
    #: continuation rows a batch (a pass whose spec fixes its rows runs with those)
    batch_size: int
    #: greedy tokens of each branch's probe (0: none)
    probe_tokens: int
    #: the pivots a pass that runs on a sample takes, by the key that sizes it (``replay.serial_pivots``; every
    #: such key names pivots); a key absent here was not given
    sample_sizes: Mapping[str, int]

    @classmethod
    def of(cls, replay: Mapping) -> ReplaySettings:
        return cls(
            k=replay["k"],
            batch_size=replay["batch_size"],
            probe_tokens=replay["probe_tokens"],
            sample_sizes={key: value for key, value in replay.items() if key.endswith("_pivots")},
        )
