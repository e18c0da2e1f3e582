"""Loading, validating and fingerprinting the workflow configuration.

Validation happens at parse time, before any job runs, so a bad value fails by name instead of hours later.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from replaynoise.datasets import packaged_rows
from replaynoise.io import stable_hash
from replaynoise.loading import check_local_model_dir
from replaynoise.models import (
    attention_heads,
    context_length,
    hidden_layers,
    model_source_files,
    resolve_model_spec,
)
from replaynoise.overlays import apply_overlay
from replaynoise.passes import LAYER_PASS, canonical_order, pass_spec, run_passes
from replaynoise.settings import INVARIANT_PROMPT, INVARIANT_ROWS, cross_scoring

REPO_ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO_ROOT / "config" / "schema.yaml"
DEFAULT_CONFIG_PATH = REPO_ROOT / "config" / "config.yaml"
#: Sections that define the measurement; a change in any of them changes the pre-registration hash.
PROTOCOL_SECTIONS = ("seed", "dataset", "prompt", "configs", "rollouts", "pivots", "replay", "analysis")
#: Configuration names the workflow uses for its own outputs (results/analysis/pooled, the pooled table rows).
RESERVED_CONFIG_NAMES = ("pooled",)
#: A configuration name, which names folders and files under results/. Matched whole (re.fullmatch): the schema's
#: pattern ends in ``$``, which also matches before a final newline.
CONFIG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
#: Characters no name that becomes a file name may hold: control characters (a newline splits a manifest line).
CONTROL_CHARACTERS = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())


def _fill_defaults(schema: dict, value: Any) -> Any:
    """Apply schema defaults recursively, including inside the named ``configs`` entries."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    for key, sub in schema.get("properties", {}).items():
        if key not in value and "default" in sub:
            value[key] = copy.deepcopy(sub["default"])
        if key in value:
            value[key] = _fill_defaults(sub, value[key])
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        for key in value:
            if key not in schema.get("properties", {}):
                value[key] = _fill_defaults(extra, value[key])
    return value


def _key_path(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def _describe(error: jsonschema.ValidationError) -> str:
    schema = error.schema if isinstance(error.schema, dict) else {}
    if error.validator == "enum":
        return f"{error.instance!r} is not allowed; allowed values: {', '.join(map(str, schema['enum']))}"
    if error.validator == "pattern" and "x-allowed" in schema:  # a family of names: say which, not the regex
        return f"{error.instance!r} is not allowed; allowed values: {schema['x-allowed']}"
    if error.validator == "additionalProperties":
        allowed = ", ".join(sorted(schema.get("properties", {})))
        return f"{error.message}; allowed keys: {allowed}"
    if error.validator == "contains":
        return f"must include {error.schema['contains'].get('const')!r} (got {error.instance})"
    return error.message


def validate_config(config: dict) -> dict:
    """Return a validated copy of ``config`` with defaults filled; raise ConfigError naming the bad key."""
    schema = load_schema()
    try:
        given = apply_overlay(copy.deepcopy(config))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    config = _fill_defaults(schema, copy.deepcopy(given))
    _fill_engine_settings(schema, config, given)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"config key {_key_path(e)}: {_describe(e)}" for e in _leaf_errors(errors)]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines))
    _check_integers(schema, config, "")
    _fill_invariant_shape(config)
    _check_semantics(config)
    config["replay"]["passes"] = canonical_order(config["replay"]["passes"])
    _drop_absent_values(schema, config)
    _normalize_sets(config)
    return _sorted_keys(config)


def _drop_absent_values(schema: dict, value: Any) -> None:
    """Remove every key written out at the value its absence means (``x-absent-value``: long_prompts: refuse,
    stop: [], replicates: 1, ...): a setting that means the same thing fingerprints the same and reruns nothing."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    for key in list(value):
        sub = props.get(key, extra if isinstance(extra, dict) else None)
        if not isinstance(sub, dict):
            continue
        if "x-absent-value" in sub and value[key] == sub["x-absent-value"]:
            del value[key]
        else:
            _drop_absent_values(sub, value[key])


def _normalize_sets(config: dict) -> None:
    """Lists that are sets in one order (their written order changes no result) and keys no step reads, removed,
    so that neither changes a fingerprint: block offsets, stop texts, cross-scoring pairs (a pair given twice is
    refused by ``_check_cross_scoring``), a serial sample size without the serial pass. (Block offsets without block
    alignment are read by no step but kept: reference/gpu/gemma's fingerprint was made with them.)"""
    config["pivots"]["block_offsets"] = sorted(config["pivots"]["block_offsets"])
    for settings in config["configs"].values():
        if "stop" in settings:
            settings["stop"] = sorted(set(settings["stop"]))
    if "cross_scoring" in config["analysis"]:
        config["analysis"]["cross_scoring"] = sorted(config["analysis"]["cross_scoring"],
                                                     key=lambda pair: (pair["rollouts"], pair["scorer"]))
    if "serial" not in config["replay"]["passes"]:
        config["replay"].pop("serial_pivots", None)


#: the serial pass's pivots where replay.serial_pivots is not given
SERIAL_PIVOTS = 50
#: vLLM settings that cannot change a number (how much of the GPU it may take), left out of the analysis hash
UNHASHED_VLLM_KEYS = ("gpu_memory_utilization",)


def _fill_engine_settings(schema: dict, config: dict, as_given: dict) -> None:
    """Settings that exist only where they apply, filled there: each vllm configuration's ``vllm`` block (every
    key its schema default) and ``replay.serial_pivots`` where the serial pass runs. Filling them everywhere
    would change the settings, and so the analysis hash and the rerun triggers, of every configuration that
    does not use them. ``as_given`` is the configuration before the schema's defaults were filled in: a
    derived default (eager, by device and kernels) must tell a value the user gave from a filled one."""
    vllm_schema = schema["properties"]["configs"]["additionalProperties"]["properties"]["vllm"]
    for name, settings in (config.get("configs") or {}).items():
        if not isinstance(settings, dict):
            continue  # the schema names it
        if settings.get("engine") == "vllm":
            given = ((as_given.get("configs") or {}).get(name) or {}).get("vllm", {})
            if not isinstance(given, dict):
                continue  # not a mapping: the schema names it
            # the values given, by type, before any is derived or replaced (a string "yes" is no boolean)
            _refuse_invalid(vllm_schema, given, f"configs.{name}.vllm")
            if settings.get("kernels") == "invariant":
                if given.get("eager") is False:
                    raise ConfigError(
                        f"config key configs.{name}.vllm.eager: false with kernels invariant - the engine's "
                        "row-invariant add-RMSNorm and top-k/top-p replace vLLM's custom-op path, which compiled "
                        "mode does not take (its norms are then compiled per batch shape); use eager: true (the "
                        "default under invariant)")
                given = {**given, "eager": True}
            if settings.get("device") == "cpu":
                if given.get("async_scheduling") is True:
                    raise ConfigError(f"config key configs.{name}.vllm.async_scheduling: true on device cpu, where "
                                      "vLLM's CPU backend always turns it off; remove it or set it false")
                # CUDA graphs are a GPU's; torch.compile of a model on a CPU costs minutes a job, for nothing here
                given = {"eager": True, **given, "async_scheduling": False}
            settings["vllm"] = _fill_defaults(vllm_schema, copy.deepcopy(given))
        elif "vllm" in settings:  # whatever it holds (a tensor_parallel_size of "2" once crashed the parse here)
            raise ConfigError(f"config key configs.{name}.vllm: settings of the vllm engine, but this configuration's "
                              f"engine is {settings.get('engine')!r}; remove the block (tensor parallelism too: the "
                              "HF engine runs on one GPU) or set engine: vllm")
    replay = config.get("replay")
    if isinstance(replay, dict) and "serial" in (replay.get("passes") or []):
        replay.setdefault("serial_pivots", SERIAL_PIVOTS)


def _refuse_invalid(schema: dict, value: Any, where: str) -> None:
    """Validate ``value`` against ``schema`` now, naming keys under ``where``."""
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"config key {where}{'.' + _key_path(e) if e.absolute_path else ''}: {_describe(e)}"
                 for e in _leaf_errors(errors)]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines))


def _fill_invariant_shape(config: dict) -> None:
    """The one decoder shape of an HF invariant configuration that decodes statically (``decode: static``, or
    ``auto`` off the CPU), filled in where not given, so that the rollouts and every pass (which all receive
    the configuration's settings) build the same one. Others are left as they are: their settings, and so the
    analysis hash of a committed run, stay what they were before the invariant decoder existed."""
    for name, settings in config["configs"].items():
        static = settings["decode"] == "static" or (settings["decode"] == "auto" and settings["device"] != "cpu")
        if settings["engine"] == "hf" and settings["kernels"] == "invariant" and static:
            settings.setdefault("invariant_rows", INVARIANT_ROWS)
            continuation = max(config["replay"]["max_new_tokens"], config["replay"]["probe_tokens"])
            budget = settings["max_new_tokens"] + continuation
            settings.setdefault("invariant_context", -(-(budget + INVARIANT_PROMPT) // 256) * 256)
            if settings["invariant_context"] <= budget:
                raise ConfigError(
                    f"config key configs.{name}.invariant_context: {settings['invariant_context']} slots do not hold "
                    f"a prompt plus {settings['max_new_tokens']} rollout and {continuation} continuation tokens")


def _check_integers(schema: dict, value: Any, path: str) -> None:
    """JSON Schema counts 4.0 as an integer; the code it reaches (range(k), slicing) does not, and would fail
    with a bare TypeError hours later, after Snakemake had deleted the step's previous output."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else (types or [])
    if isinstance(value, float) and "integer" in types and "number" not in types:
        raise ConfigError(f"config key {path}: {value!r} is not an integer (write {int(value)})"
                          if value.is_integer() else f"config key {path}: {value!r} is not an integer")
    if isinstance(value, dict):
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            sub_schema = schema.get("properties", {}).get(key, extra if isinstance(extra, dict) else {})
            _check_integers(sub_schema, sub, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            _check_integers(schema["items"], item, f"{path}[{index}]")


def _sorted_keys(value: Any) -> Any:
    """Mappings in key order, recursively: Snakemake compares a step's params as text, so two spellings of one
    configuration (keys reordered) must give the same text, or every step reruns."""
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (PyYAML keeps the last, silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` (the campaign files use it)
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"{self.name}:{key_node.start_mark.line + 1}: key {key!r} given twice in one "
                                  f"mapping (first at line {seen[key] + 1}); YAML would keep only the last value")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def check_config_file(path: str | Path) -> None:
    """Refuse a configuration file with a duplicate key, naming the key and both lines."""
    with open(path, encoding="utf-8") as fh:
        yaml.load(fh, Loader=_UniqueKeyLoader)


def _leaf_errors(errors: list[jsonschema.ValidationError]) -> list[jsonschema.ValidationError]:
    leaves = []
    for error in errors:
        if error.validator == "allOf" and error.context:
            leaves.extend(_leaf_errors(list(error.context)))
        else:
            leaves.append(error)
    return leaves


def _check_path_for_snakemake(key: str, path: str | Path) -> None:
    """Snakemake reads braces in a file name as wildcards, in the inputs and params of a rule alike, and stops with
    a WildcardError that names neither the key nor the file; a doubled brace is expanded twice in an input."""
    if "{" in str(path) or "}" in str(path):
        raise ConfigError(f"config key {key}: {str(path)!r} has a brace ({{ or }}), which Snakemake reads as a "
                          "wildcard; rename the file or folder")
    if CONTROL_CHARACTERS.search(str(path)):
        raise ConfigError(f"config key {key}: {str(path)!r} has a control character (a newline?) in its name; "
                          "rename the file or folder")


def _check_semantics(config: dict) -> None:
    """Checks JSON Schema cannot express: files that must exist, models that must resolve, names that become
    paths, settings that can give no pivot."""
    dataset = config["dataset"]
    if dataset["source"] == "file":
        if not dataset["path"]:
            raise ConfigError("config key dataset.path: required when dataset.source is 'file'")
        if not Path(dataset["path"]).is_file():
            raise ConfigError(f"config key dataset.path: file not found: {dataset['path']}")
        _check_path_for_snakemake("dataset.path", dataset["path"])
    _check_pivots_possible(config)
    for name, settings in config["configs"].items():
        if not CONFIG_NAME.fullmatch(name):
            raise ConfigError(f"config key configs.{name!r}: a configuration name names folders under results/, "
                              f"so it must be letters, digits, '_', '.' or '-' (and start with a letter or digit)")
        if name in RESERVED_CONFIG_NAMES:
            raise ConfigError(f"config key configs.{name}: the name {name!r} is reserved (the workflow writes its "
                              f"own results/analysis/{name}); choose another name")
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
                f"beyond the {context} positions {settings['model']} attends over (with the prompt)")
        _check_engine(name, settings, run_passes(config["replay"]))
        _check_training(name, settings, config["dataset"])
        _check_vllm_settings(name, settings, budget, context, heads, config["resources"]["gpus"])
    _check_passes(config["replay"]["passes"])
    _check_layer_passes(config)
    _check_cross_scoring(config)


def _check_training(name: str, settings: dict, dataset: dict) -> None:
    """A train block whose completions do not split into equal micro-batches would leave some unused (TRL
    refuses it deep inside its setup), and one whose train set cannot fill a step would train no step (a trainer
    ends quietly at step 0): said here, with the numbers, before any model is prepared."""
    train = settings.get("train")
    if train is None:
        return
    if settings["device"] not in ("cpu", "cuda", "cuda:0"):
        raise ConfigError(f"config key configs.{name}.device: {settings['device']!r} with a train block - training "
                          "runs on the first visible GPU; set device: cuda and choose the GPU with "
                          "CUDA_VISIBLE_DEVICES")
    per_step = train["prompts_per_step"]
    left = packaged_rows(train["dataset"]) - (dataset["n_problems"] if train["dataset"] == dataset["source"] else 0)
    if left < per_step:
        raise ConfigError(f"config keys configs.{name}.train.dataset and train.prompts_per_step: {train['dataset']} "
                          f"has {packaged_rows(train['dataset'])} problems, {left} once the evaluation's "
                          f"{dataset['n_problems']} (dataset.n_problems) are taken out, fewer than the "
                          f"{per_step} distinct prompts one step needs: no step could be taken")
    completions = per_step * train["generations"]
    if completions % train["micro_batch"]:
        raise ConfigError(f"config key configs.{name}.train.micro_batch: {train['micro_batch']} does not divide the "
                          f"{completions} completions of a step (prompts_per_step {train['prompts_per_step']} x "
                          f"generations {train['generations']}); choose a divisor of {completions}")


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
                raise ConfigError(f"config key replay.passes: {pass_name!r} transplants at layer {layer}, but "
                                  f"configs.{name}'s model {settings['model']} has {layers} layers; choose L from 0 "
                                  f"to {layers}")


def _check_cross_scoring(config: dict) -> None:
    """Each pair names two configurations of the run, different ones, of the same model: a scorer of another
    model would read the rollouts' token ids with another vocabulary."""
    configs = config["configs"]
    seen: dict[tuple[str, str], int] = {}
    for i, pair in enumerate(cross_scoring(config["analysis"])):
        key = f"analysis.cross_scoring[{i}]"
        if tuple(pair) in seen:
            raise ConfigError(f"config key {key}: the pair (rollouts {pair[0]!r}, scorer {pair[1]!r}) is given twice "
                              f"(first as analysis.cross_scoring[{seen[tuple(pair)]}]); give each pair once")
        seen[tuple(pair)] = i
        for role, name in zip(("rollouts", "scorer"), pair):
            if name not in configs:
                raise ConfigError(f"config key {key}.{role}: {name!r} is not a configuration of this run "
                                  f"({', '.join(sorted(configs))})")
        if pair[0] == pair[1]:
            raise ConfigError(f"config key {key}: the rollouts and the scorer are both {pair[1]!r}; a "
                              "configuration's own re-feed is its refeed pass's prefix mismatch already")
        models = configs[pair[0]]["model"], configs[pair[1]]["model"]
        if models[0] != models[1]:
            raise ConfigError(f"config key {key}: the rollouts' model {models[0]!r} and the scorer's {models[1]!r} "
                              "differ; a scorer must read the rollouts' token ids with the same vocabulary")


def _check_pivots_possible(config: dict) -> None:
    """Settings under which no pivot can ever be chosen: the run would spend every model step and end with an
    empty table and advice to raise n_problems."""
    screen, per_problem = config["rollouts"]["screen"], config["rollouts"]["per_problem"]
    if screen["rule"] == "mixed" and per_problem < 2:
        raise ConfigError(f"config keys rollouts.screen.rule and rollouts.per_problem: the 'mixed' screen keeps a "
                          f"problem whose rollouts are neither all right nor all wrong, which needs at least 2 "
                          f"rollouts per problem (per_problem is {per_problem})")
    pivots = config["pivots"]
    if not pivots["align_to_block"]:
        return
    for name, settings in config["configs"].items():
        beyond = [o for o in pivots["block_offsets"] if o >= settings["block_size"]]
        if beyond:
            raise ConfigError(f"config keys pivots.block_offsets and configs.{name}.block_size: offsets {beyond} are "
                              f"not below the block size {settings['block_size']}, so (prompt + t) mod "
                              f"{settings['block_size']} never equals them and they can give no pivot")


def _check_passes(passes: list[str]) -> None:
    """Each pass a precision arm is compared with must run too (its row of the table needs both)."""
    for name in passes:
        try:
            spec = pass_spec(name)
        except ValueError as exc:
            raise ConfigError(f"config key replay.passes: {exc}") from None
        if spec.precision is not None and spec.precision[1] not in passes:
            raise ConfigError(f"config key replay.passes: {name!r} is compared with {spec.precision[1]!r}, "
                              f"which is not listed; add it")


def _check_engine(name: str, settings: dict, passes: list[str]) -> None:
    """Engine/platform combinations that can be refused from the configuration alone (parse time)."""
    if settings["engine"] != "vllm":
        return
    controls = [p for p in passes if not _plain(p)]
    if controls:
        raise ConfigError(f"config key configs.{name}.engine: vllm keeps its KV inside vLLM, so it cannot run "
                          f"the transplant and precision passes {controls} of replay.passes; use engine: hf for "
                          "this configuration, or drop those passes")
    if settings["device"] == "cpu" and settings["block_size"] % 32:
        raise ConfigError(f"config key configs.{name}.block_size: {settings['block_size']} is not a multiple of "
                          "32, which vLLM's CPU attention backend needs")
    if settings["device"] == "cpu" and settings["kernels"] == "invariant":
        raise ConfigError(f"config key configs.{name}.kernels: 'invariant' with engine vllm needs an NVIDIA GPU "
                          "of compute capability >= 8.0 (VLLM_BATCH_INVARIANT); device is 'cpu', where vLLM has "
                          "no batch-invariant kernels. Use kernels: stock, or engine: hf")


def _check_vllm_settings(name: str, settings: dict, budget: int, context: int | None, heads: int | None,
                         gpus: int) -> None:
    """What vLLM would refuse only once the engine is built, minutes into a job, refused by key here (``context``
    and ``heads``: the model's positions and attention heads, as ``_check_semantics`` read them; ``gpus``: the
    most a job may hold)."""
    if settings["engine"] != "vllm":
        return
    v = settings["vllm"]
    tp = tensor_parallel_size(settings)
    if tp > 1 and settings["device"] == "cpu":
        raise ConfigError(f"config key configs.{name}.vllm.tensor_parallel_size: {tp} on device cpu; tensor "
                          "parallelism splits a model across GPUs (device: cuda), set it to 1")
    if tp > gpus:
        raise ConfigError(f"config key configs.{name}.vllm.tensor_parallel_size: {tp} GPUs per job, but "
                          f"resources.gpus lets a job hold {gpus}; raise resources.gpus to {tp} or lower it")
    if heads is not None and heads % tp:
        raise ConfigError(f"config key configs.{name}.vllm.tensor_parallel_size: {tp} does not divide the {heads} "
                          f"attention heads of {settings['model']}; use a divisor of {heads}")
    if v["max_model_len"] <= budget:
        raise ConfigError(f"config key configs.{name}.vllm.max_model_len: {v['max_model_len']} positions do not hold "
                          f"a prompt plus {budget} rollout and continuation tokens (configs.{name}.max_new_tokens + "
                          "replay.max_new_tokens); raise it")
    if context is not None and v["max_model_len"] > context:
        raise ConfigError(f"config key configs.{name}.vllm.max_model_len: {v['max_model_len']} is beyond the "
                          f"{context} positions {settings['model']} attends over; lower it")
    if not v["chunked_prefill"] and v["max_num_batched_tokens"] < v["max_model_len"]:
        raise ConfigError(f"config key configs.{name}.vllm.max_num_batched_tokens: {v['max_num_batched_tokens']} is "
                          f"below max_model_len {v['max_model_len']} with chunked_prefill false, so a long prompt "
                          "could never be scheduled; raise it or turn chunked_prefill on")
    if v["max_num_batched_tokens"] < v["max_num_seqs"]:
        raise ConfigError(f"config key configs.{name}.vllm.max_num_batched_tokens: {v['max_num_batched_tokens']} is "
                          f"below max_num_seqs {v['max_num_seqs']}: a decode step of that many sequences would not fit")


def tensor_parallel_size(settings: dict) -> int:
    """GPUs a configuration's model is split across: its vllm.tensor_parallel_size where given, else 1 (vLLM's
    default, and the HF engine's one GPU). The key is absent unless given: see the schema."""
    return (settings.get("vllm") or {}).get("tensor_parallel_size", 1)


def _plain(name: str) -> bool:
    try:
        return pass_spec(name).source.plain
    except ValueError:
        return True  # an unknown name is refused by _check_passes, by name


def protocol_settings(config: dict) -> dict:
    """The protocol sections, the pass list in its canonical order (its written order changes no result)."""
    settings = {key: config[key] for key in PROTOCOL_SECTIONS if key in config}
    if "passes" in settings.get("replay", {}):
        settings["replay"] = {**settings["replay"], "passes": canonical_order(settings["replay"]["passes"])}
    return settings


def analysis_hash(config: dict) -> str:
    """The pre-registration fingerprint: written into every table, so a later change of settings shows. Settings
    that cannot change a number (``UNHASHED_VLLM_KEYS``) are left out, and a tensor parallelism of 1, so that
    runs made before that key keep their fingerprint."""
    settings = copy.deepcopy(protocol_settings(config))
    for entry in (settings.get("configs") or {}).values():
        if isinstance(entry, dict) and isinstance(entry.get("vllm"), dict):
            for key in UNHASHED_VLLM_KEYS:
                entry["vllm"].pop(key, None)
            if entry["vllm"].get("tensor_parallel_size") == 1:  # one GPU: what every run before the key had
                entry["vllm"].pop("tensor_parallel_size")
    return stable_hash(settings)


def deviations(config: dict, defaults: dict | None = None) -> list[dict]:
    """Every protocol value that differs from the committed default config, as key paths."""
    if defaults is None:
        defaults = validate_config(yaml.safe_load(DEFAULT_CONFIG_PATH.read_text()))
    found: list[dict] = []

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key), b.get(key), f"{path}.{key}" if path else key)
        elif a != b:
            found.append({"key": path, "value": a, "default": b})

    walk(protocol_settings(config), protocol_settings(defaults), "")
    return found
