"""Loading, validating and fingerprinting the workflow configuration.

Validation happens at parse time, before any job runs, so a bad value fails by name instead of hours later.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from replaynoise.config_checks import check_semantics
from replaynoise.engines.registry import ENGINES
from replaynoise.engines.vllm.settings import tensor_parallel_size  # noqa: F401 (read here by the workflow)
from replaynoise.generation.passes import canonical_order
from replaynoise.io import stable_hash
from replaynoise.overlays import apply_overlay
from replaynoise.settings import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO_ROOT / "config" / "schema.yaml"
DEFAULT_CONFIG_PATH = REPO_ROOT / "config" / "config.yaml"
#: Sections that define the measurement; a change in any of them changes the pre-registration hash.
PROTOCOL_SECTIONS = ("seed", "dataset", "prompt", "configs", "rollouts", "pivots", "replay", "analysis")


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
    _derive_engine_settings(config)
    check_semantics(config)
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
    so that neither changes a fingerprint: block offsets, listed problem ids, stop texts, cross-scoring pairs (a pair
    given twice is refused by ``_check_cross_scoring``), a serial sample size without the serial pass. (Block offsets
    without block alignment are read by no step but kept: reference/gpu/gemma's fingerprint was made with them.)"""
    config["pivots"]["block_offsets"] = sorted(config["pivots"]["block_offsets"])
    if "ids" in config["dataset"]:  # a listed sample is taken in dataset order, whatever order lists it
        config["dataset"]["ids"] = sorted(config["dataset"]["ids"])
    for settings in config["configs"].values():
        if "stop" in settings:
            settings["stop"] = sorted(set(settings["stop"]))
    if "cross_scoring" in config["analysis"]:
        config["analysis"]["cross_scoring"] = sorted(
            config["analysis"]["cross_scoring"], key=lambda pair: (pair["rollouts"], pair["scorer"])
        )
    if "serial" not in config["replay"]["passes"]:
        config["replay"].pop("serial_pivots", None)


#: the serial pass's pivots where replay.serial_pivots is not given
SERIAL_PIVOTS = 50
#: vLLM settings that cannot change a number (how much of the GPU it may take), left out of the analysis hash
UNHASHED_VLLM_KEYS = ("gpu_memory_utilization",)


def _fill_engine_settings(schema: dict, config: dict, as_given: dict) -> None:
    """Settings that exist only where they apply, filled there by each configuration's engine
    (``engines.registry``: a vllm configuration's ``vllm`` block, an sglang one's ``sglang`` block, every key its
    schema default) and ``replay.serial_pivots`` where the serial pass runs. Filling them everywhere would change the
    settings, and so the analysis hash and the rerun triggers, of every configuration that does not use them. A
    block of another engine is refused, whatever it holds.
    ``as_given`` is the configuration before the schema's defaults were filled in: a derived default (eager, by
    device and kernels) must tell a value the user gave from a filled one."""
    blocks = schema["properties"]["configs"]["additionalProperties"]["properties"]
    for name, settings in (config.get("configs") or {}).items():
        if not isinstance(settings, dict) or settings.get("engine") not in ENGINES:
            continue  # the schema names it
        engine, entry = settings["engine"], ENGINES[settings["engine"]]
        for other, other_entry in ENGINES.items():
            if other_entry.block not in (None, entry.block) and other_entry.block in settings:
                raise ConfigError(
                    f"config key configs.{name}.{other_entry.block}: settings of the {other} engine, but this "
                    f"configuration's engine is {engine!r}; remove the block{entry.foreign_block_hint} or set "
                    f"engine: {other}"
                )
        given = ((as_given.get("configs") or {}).get(name) or {}).get(entry.block, {}) if entry.block else {}
        if not isinstance(given, dict):
            continue  # not a mapping: the schema names it
        entry.settings.prepare(
            name,
            settings,
            given,
            schema=blocks[entry.block] if entry.block else {},
            validate=_refuse_invalid,
            fill_defaults=_fill_defaults,
        )
    replay = config.get("replay")
    if isinstance(replay, dict) and "serial" in (replay.get("passes") or []):
        replay.setdefault("serial_pivots", SERIAL_PIVOTS)


def _refuse_invalid(schema: dict, value: Any, where: str) -> None:
    """Validate ``value`` against ``schema`` now, naming keys under ``where``."""
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [
            f"config key {where}{'.' + _key_path(e) if e.absolute_path else ''}: {_describe(e)}"
            for e in _leaf_errors(errors)
        ]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines))


def _derive_engine_settings(config: dict) -> None:
    """What each configuration's engine derives from the validated settings (the HF invariant decoder's shape)."""
    for name, settings in config["configs"].items():
        ENGINES[settings["engine"]].settings.derive(name, settings, config["replay"])


def _check_integers(schema: dict, value: Any, path: str) -> None:
    """JSON Schema counts 4.0 as an integer; the code it reaches (range(k), slicing) does not, and would fail
    with a bare TypeError hours later, after Snakemake had deleted the step's previous output."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else (types or [])
    if isinstance(value, float) and "integer" in types and "number" not in types:
        raise ConfigError(
            f"config key {path}: {value!r} is not an integer (write {int(value)})"
            if value.is_integer()
            else f"config key {path}: {value!r} is not an integer"
        )
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

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` (the campaign files use it)
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(
                    f"{self.name}:{key_node.start_mark.line + 1}: key {key!r} given twice in one "
                    f"mapping (first at line {seen[key] + 1}); YAML would keep only the last value"
                )
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


def protocol_settings(config: dict) -> dict:
    """The protocol sections, the pass list in its canonical order (its written order changes no result)."""
    settings = {key: config[key] for key in PROTOCOL_SECTIONS if key in config}
    if "passes" in settings.get("replay", {}):
        settings["replay"] = {**settings["replay"], "passes": canonical_order(settings["replay"]["passes"])}
    return settings


def analysis_hash(config: dict) -> str:
    """The pre-registration fingerprint: written into every table, so a later change of settings shows. Settings
    that cannot change a number (``UNHASHED_VLLM_KEYS``) are left out, and a tensor parallelism of 1, so that
    runs made before that key keep their fingerprint. ``replay.stop`` is read by no pass or table (the run makes every
    pair; ``python -m replaynoise.power stopping`` replays the rule), so it moves no number and no fingerprint."""
    settings = copy.deepcopy(protocol_settings(config))
    settings.get("replay", {}).pop("stop", None)
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
