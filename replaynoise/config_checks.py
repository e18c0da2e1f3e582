"""What a configuration must satisfy beyond its schema (``config.validate_config`` runs these after the schema
and the defaults): files that must exist, models that must resolve, names that become paths, settings that can
give no pivot or train no step, pairs and passes that must name each other. Each refusal names the key."""

from __future__ import annotations

import re
from pathlib import Path

from replaynoise.data.datasets import packaged_rows
from replaynoise.data.loading import check_local_model_dir
from replaynoise.data.models import (
    attention_heads,
    context_length,
    hidden_layers,
    model_identity,
    model_source_files,
    resolve_model_spec,
)
from replaynoise.engines.registry import ENGINES
from replaynoise.generation.passes import LAYER_PASS, pass_spec, run_passes
from replaynoise.settings import ConfigError, cross_scoring, replicates

#: Configuration names the workflow uses for its own outputs (results/analysis/pooled, the pooled table rows).
RESERVED_CONFIG_NAMES = ("pooled",)
#: A configuration name, which names folders and files under results/. Matched whole (re.fullmatch): the schema's
#: pattern ends in ``$``, which also matches before a final newline.
CONFIG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
#: Characters no name that becomes a file name may hold: control characters (a newline splits a manifest line).
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


def _check_path_for_snakemake(key: str, path: str | Path) -> None:
    """Snakemake reads braces in a file name as wildcards, in the inputs and params of a rule alike, and stops with
    a WildcardError that names neither the key nor the file; a doubled brace is expanded twice in an input."""
    if "{" in str(path) or "}" in str(path):
        raise ConfigError(
            f"config key {key}: {str(path)!r} has a brace ({{ or }}), which Snakemake reads as a "
            "wildcard; rename the file or folder"
        )
    if CONTROL_CHARACTERS.search(str(path)):
        raise ConfigError(
            f"config key {key}: {str(path)!r} has a control character (a newline?) in its name; "
            "rename the file or folder"
        )


def check_semantics(config: dict) -> None:
    """Checks JSON Schema cannot express: files that must exist, models that must resolve, names that become
    paths, settings that can give no pivot."""
    dataset = config["dataset"]
    if dataset["source"] == "file":
        if not dataset["path"]:
            raise ConfigError("config key dataset.path: required when dataset.source is 'file'")
        if not Path(dataset["path"]).is_file():
            raise ConfigError(f"config key dataset.path: file not found: {dataset['path']}")
        _check_path_for_snakemake("dataset.path", dataset["path"])
    _check_listed(dataset)
    _check_pivots_possible(config)
    for name, settings in config["configs"].items():
        _check_configuration(name, settings, config)
    _check_passes(config["replay"]["passes"])
    _check_stop(config["replay"])
    _check_layer_passes(config)
    _check_cross_scoring(config)


def _check_configuration(name: str, settings: dict, config: dict) -> None:
    """One configuration: its name, its model, its budgets against the model's context, its training and its
    engine's own settings (each engine checks its own: ``engines.registry``)."""
    if not CONFIG_NAME.fullmatch(name):
        raise ConfigError(
            f"config key configs.{name!r}: a configuration name names folders under results/, "
            f"so it must be letters, digits, '_', '.' or '-' (and start with a letter or digit)"
        )
    if name in RESERVED_CONFIG_NAMES:
        raise ConfigError(
            f"config key configs.{name}: the name {name!r} is reserved (the workflow writes its "
            f"own results/analysis/{name}); choose another name"
        )
    try:
        kind, source = resolve_model_spec(settings["model"])
        if kind == "local":
            check_local_model_dir(source)
            for file in model_source_files(settings["model"]):
                _check_path_for_snakemake(f"configs.{name}.model", file)
        context = context_length(settings["model"])
        heads = attention_heads(settings["model"])
    except ValueError as exc:
        raise ConfigError(f"config key configs.{name}.model: {exc}") from None
    budget = settings["max_new_tokens"] + config["replay"]["max_new_tokens"]
    if context is not None and budget >= context:
        raise ConfigError(
            f"config keys configs.{name}.max_new_tokens + replay.max_new_tokens: {settings['max_new_tokens']} "
            f"rollout tokens plus {config['replay']['max_new_tokens']} continuation tokens reach {budget}, "
            f"beyond the {context} positions {settings['model']} attends over (with the prompt)"
        )
    _check_training(name, settings, config["dataset"])
    controls = [p for p in run_passes(config["replay"]) if not _plain(p)]
    ENGINES[settings["engine"]].settings.check(
        name, settings, controls=controls, budget=budget, context=context, heads=heads, gpus=config["resources"]["gpus"]
    )


def _check_training(name: str, settings: dict, dataset: dict) -> None:
    """A train block whose completions do not split into equal micro-batches would leave some unused (TRL
    refuses it deep inside its setup), and one whose train set cannot fill a step would train no step (a trainer
    ends quietly at step 0): said here, with the numbers, before any model is prepared."""
    train = settings.get("train")
    if train is None:
        return
    if settings["device"] not in ("cpu", "cuda", "cuda:0"):
        raise ConfigError(
            f"config key configs.{name}.device: {settings['device']!r} with a train block - training "
            "runs on the first visible GPU; set device: cuda and choose the GPU with "
            "CUDA_VISIBLE_DEVICES"
        )
    per_step = train["prompts_per_step"]
    left = packaged_rows(train["dataset"]) - (dataset["n_problems"] if train["dataset"] == dataset["source"] else 0)
    if left < per_step:
        raise ConfigError(
            f"config keys configs.{name}.train.dataset and train.prompts_per_step: {train['dataset']} "
            f"has {packaged_rows(train['dataset'])} problems, {left} once the evaluation's "
            f"{dataset['n_problems']} (dataset.n_problems) are taken out, fewer than the "
            f"{per_step} distinct prompts one step needs: no step could be taken"
        )
    completions = per_step * train["generations"]
    if completions % train["micro_batch"]:
        raise ConfigError(
            f"config key configs.{name}.train.micro_batch: {train['micro_batch']} does not divide the "
            f"{completions} completions of a step (prompts_per_step {train['prompts_per_step']} x "
            f"generations {train['generations']}); choose a divisor of {completions}"
        )


def _check_layer_passes(config: dict) -> None:
    """A per-layer transplant's L must lie within each configuration's model (transplant_refeed_lo99 on a 2-layer
    model was refused only inside the pass, naming neither the key nor the pass)."""
    layer_passes = [(p, int(m.group(2))) for p in config["replay"]["passes"] if (m := LAYER_PASS.fullmatch(p))]
    if not layer_passes:
        return
    for name, settings in config["configs"].items():
        layers = hidden_layers(settings["model"])
        for pass_name, layer in layer_passes:
            if layers is not None and layer > layers:
                raise ConfigError(
                    f"config key replay.passes: {pass_name!r} transplants at layer {layer}, but "
                    f"configs.{name}'s model {settings['model']} has {layers} layers; choose L from 0 "
                    f"to {layers}"
                )


def _check_cross_scoring(config: dict) -> None:
    """Each pair names two configurations of the run, different ones, of the same model: a scorer of another
    model would read the rollouts' token ids with another vocabulary."""
    configs = config["configs"]
    seen: dict[tuple[str, str], int] = {}
    for i, pair in enumerate(cross_scoring(config["analysis"])):
        key = f"analysis.cross_scoring[{i}]"
        if tuple(pair) in seen:
            raise ConfigError(
                f"config key {key}: the pair (rollouts {pair[0]!r}, scorer {pair[1]!r}) is given twice "
                f"(first as analysis.cross_scoring[{seen[tuple(pair)]}]); give each pair once"
            )
        seen[tuple(pair)] = i
        for role, name in zip(("rollouts", "scorer"), pair):
            if name not in configs:
                raise ConfigError(
                    f"config key {key}.{role}: {name!r} is not a configuration of this run "
                    f"({', '.join(sorted(configs))})"
                )
        if pair[0] == pair[1]:
            raise ConfigError(
                f"config key {key}: the rollouts and the scorer are both {pair[1]!r}; a "
                "configuration's own re-feed is its refeed pass's prefix mismatch already"
            )
        models = configs[pair[0]]["model"], configs[pair[1]]["model"]
        if model_identity(models[0]) != model_identity(models[1]):
            raise ConfigError(
                f"config key {key}: the rollouts' model {models[0]!r} and the scorer's {models[1]!r} "
                "differ; a scorer must read the rollouts' token ids with the same vocabulary"
            )


def _check_listed(dataset: dict) -> None:
    """dataset.ids and sample listed go together, with n_problems ids (the shards and the screen count them)."""
    ids, listed = dataset.get("ids"), dataset["sample"] == "listed"
    if listed and not ids:
        raise ConfigError("config key dataset.ids: required when dataset.sample is 'listed' (the problem ids to take)")
    if ids and not listed:
        raise ConfigError(
            f"config key dataset.ids: given with dataset.sample {dataset['sample']!r}, which does not read it; "
            "set sample: listed, or remove ids"
        )
    if listed and len(ids) != dataset["n_problems"]:
        raise ConfigError(
            f"config keys dataset.ids and dataset.n_problems: {len(ids)} ids listed, but n_problems is "
            f"{dataset['n_problems']}; make them equal"
        )


def _check_pivots_possible(config: dict) -> None:
    """Settings under which no pivot can ever be chosen: the run would spend every model step and end with an
    empty table and advice to raise n_problems."""
    screen, per_problem = config["rollouts"]["screen"], config["rollouts"]["per_problem"]
    if screen["rule"] == "mixed" and per_problem < 2:
        raise ConfigError(
            f"config keys rollouts.screen.rule and rollouts.per_problem: the 'mixed' screen keeps a "
            f"problem whose rollouts are neither all right nor all wrong, which needs at least 2 "
            f"rollouts per problem (per_problem is {per_problem})"
        )
    pivots = config["pivots"]
    if not pivots["align_to_block"]:
        return
    for name, settings in config["configs"].items():
        beyond = [o for o in pivots["block_offsets"] if o >= settings["block_size"]]
        if beyond:
            raise ConfigError(
                f"config keys pivots.block_offsets and configs.{name}.block_size: offsets {beyond} are "
                f"not below the block size {settings['block_size']}, so (prompt + t) mod "
                f"{settings['block_size']} never equals them and they can give no pivot"
            )


def _check_stop(replay: dict) -> None:
    """``replay.stop`` looks at the run's own pairs: from min_pairs to max_pairs of them, all made."""
    stop = replay.get("stop")
    if stop is None:
        return
    if stop["min_pairs"] > stop["max_pairs"]:
        raise ConfigError(
            f"config key replay.stop.min_pairs: {stop['min_pairs']} is more than max_pairs ({stop['max_pairs']})"
        )
    if replicates(replay) != stop["max_pairs"]:
        raise ConfigError(
            f"config key replay.stop.max_pairs: {stop['max_pairs']}, but replay.replicates is "
            f"{replicates(replay)}; the run makes max_pairs pairs and the rule reads them in order, so set "
            "replicates to max_pairs"
        )


def _check_passes(passes: list[str]) -> None:
    """Each pass a precision arm is compared with must run too (its row of the table needs both)."""
    for name in passes:
        try:
            spec = pass_spec(name)
        except ValueError as exc:
            raise ConfigError(f"config key replay.passes: {exc}") from None
        if spec.precision is not None and spec.precision[1] not in passes:
            raise ConfigError(
                f"config key replay.passes: {name!r} is compared with {spec.precision[1]!r}, "
                f"which is not listed; add it"
            )


def _plain(name: str) -> bool:
    """Built the way a serving engine can: no transplant, no precision change, no prompt served from a prefill
    of its own."""
    try:
        source = pass_spec(name).source
        return source.plain and not source.prompt_cached
    except ValueError:
        return True  # an unknown name is refused by _check_passes, by name
