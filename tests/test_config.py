"""Config validation, schema defaults, the pre-registration hash, deviations, and the Snakemake parse-time check."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml
from helpers import SNAKEMAKE, TINY, rerun_readers, snakemake
from snakemake.utils import update_config

from replaynoise.config import (
    DEFAULT_CONFIG_PATH,
    ConfigError,
    analysis_hash,
    check_config_file,
    deviations,
    load_schema,
    validate_config,
)
from replaynoise.engines.vllm.build import invariant_llm_kwargs, llm_kwargs
from replaynoise.machine import job_gpus
from replaynoise.overlays import configfiles, load_campaign

REPO = Path(__file__).resolve().parents[1]
SNAKEFILE = REPO / "Snakefile"
CONFIG_NAME = "smollm2-bf16"


@pytest.fixture
def committed() -> dict:
    return yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())


def with_value(config: dict, dotted: str, value) -> dict:
    """A deep copy of ``config`` with the key at ``dotted`` (a.b.c) set to ``value``."""
    config = copy.deepcopy(config)
    *parents, last = dotted.split(".")
    node = config
    for key in parents:
        node = node[key]
    node[last] = value
    return config


def leaf_differences(a, b, path: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else key
            if key not in a or key not in b:
                out.append(f"{sub}: only in {'schema defaults' if key in a else 'config.yaml'}")
            else:
                out += leaf_differences(a[key], b[key], sub)
        return out
    return [] if a == b else [f"{path}: schema default {a!r} != config.yaml {b!r}"]


# --- the committed config and the schema defaults -------------------------------------------------------------


def test_committed_config_validates_and_is_complete(committed):
    validated = validate_config(committed)
    # Every key is spelled out in config.yaml, so filling defaults adds nothing.
    assert validated == committed
    assert validate_config(validated) == validated


CAMPAIGNS = (
    sorted((REPO / "config" / "campaigns").glob("*.yaml"))
    + sorted((REPO / "config" / "campaigns" / "gpu").glob("*.yaml"))
    + sorted((REPO / "config" / "campaigns" / "gpu-vllm").glob("*.yaml"))
    + sorted((REPO / "config" / "campaigns" / "gpu-vllm" / "ladder").glob("*.yaml"))
    + sorted((REPO / "config" / "campaigns" / "gpu-sglang").glob("*.yaml"))
)


@pytest.mark.parametrize(
    "path",
    CAMPAIGNS + sorted((REPO / "config" / "campaigns" / "paper-variants").glob("*.yaml")) + [DEFAULT_CONFIG_PATH],
    ids=lambda p: f"{p.parent.name}/{p.stem}",
)
def test_every_campaign_file_passes_the_duplicate_key_check_and_validates(path):
    """The files use merge keys (``<<: *gpu``) with overrides: neither is a duplicate."""
    check_config_file(path)
    assert validate_config(load_campaign(path))["configs"]  # an overlay merged over its base


#: reference/<folder>/<name> (gpu: the HF engine's; gpu-vllm: vLLM's, its ladder one level down; gpu-sglang:
#: SGLang's), each finished run made by config/campaigns/<folder>/<name>.yaml
GPU_REFERENCES = sorted(
    p.parent.relative_to(REPO / "reference").as_posix() for p in (REPO / "reference").glob("gpu*/**/provenance.json")
)


def test_every_gpu_reference_has_its_campaign_file():
    assert sum(ref.startswith("gpu/") for ref in GPU_REFERENCES) >= 7
    assert {
        "gpu-vllm/paper-qwen",
        "gpu-vllm/paper-qwen-k8",
        "gpu-vllm/paper-qwen-engines",
        "gpu-vllm/paper-smollm2",
        "gpu-vllm/ladder/qwen-1.5b",
        "gpu-sglang/qwen-1.5b-vllm-problems",
    } <= set(GPU_REFERENCES)
    assert all((REPO / "config" / "campaigns" / f"{ref}.yaml").is_file() for ref in GPU_REFERENCES)


@pytest.mark.parametrize("ref", GPU_REFERENCES)
def test_committed_gpu_reference_was_made_by_its_campaign_file(ref):
    """reference/<folder>/<name> must describe config/campaigns/<folder>/<name>.yaml as committed: an edit to the
    file without a new run would leave a reference that no rerun of the file reproduces."""
    campaign = validate_config(load_campaign(REPO / "config" / "campaigns" / f"{ref}.yaml"))
    provenance = json.loads((REPO / "reference" / ref / "provenance.json").read_text())
    assert provenance["config"] == campaign
    assert provenance["analysis_hash"] == analysis_hash(campaign)


#: partial reference folders (a run cut short, or stopped by its comparison), each with the campaign file that made it
PARTIAL_REFERENCES = sorted(
    p.parent.relative_to(REPO / "reference").as_posix() for p in (REPO / "reference").glob("gpu-*/**/partial.json")
)


def test_the_partial_references_are_found():
    assert {"gpu-sglang/qwen-0.5b", "gpu-sglang/qwen-0.5b-deterministic"} <= set(PARTIAL_REFERENCES)


#: an earlier lease's folder kept beside a later, finished run of the same file: the file's name and the lease's date
EARLIER_LEASE = re.compile(r"-\d{4}-\d{2}-\d{2}$")


@pytest.mark.parametrize("ref", PARTIAL_REFERENCES)
def test_a_partial_reference_was_made_by_its_campaign_file(ref):
    record = json.loads((REPO / "reference" / ref / "partial.json").read_text())
    assert record["campaign"] == f"config/campaigns/{EARLIER_LEASE.sub('', ref)}.yaml"
    assert record["config"] == validate_config(load_campaign(REPO / record["campaign"]))


#: campaign variants written as overlays of their base (overlay_of, rename_configs)
OVERLAYS = sorted(p for p in CAMPAIGNS if "overlay_of" in yaml.safe_load(p.read_text()))


def test_the_campaign_variants_are_overlays_and_each_runs_with_its_base_first():
    assert {p.stem for p in OVERLAYS} >= {
        "qwen-k8",
        "qwen-k16",
        "qwen-fp16",
        "qwen-greedy",
        "qwen-invariant",
        "controls-fp32",
    }
    for path in OVERLAYS:
        base = path.parent / yaml.safe_load(path.read_text())["overlay_of"]
        assert configfiles(path) == [base, path]
        assert len(path.read_text().splitlines()) < len(base.read_text().splitlines()) // 2
        # what a run sees: Snakemake's own merge of --configfile BASE OVERLAY
        theirs = {}
        for file in (base, path):
            update_config(theirs, yaml.safe_load(file.read_text()))
        assert load_campaign(path) == theirs


def test_an_overlay_runs_renamed_after_its_base_and_is_refused_before_or_without_it(tiny_model, tmp_path):
    """Snakemake merges whatever --configfile files it is given, in order: the workflow itself refuses an overlay
    whose base is missing or comes after it, naming the base, and runs the base's configuration renamed."""
    base, overlay = tmp_path / "base.yaml", tmp_path / "k1.yaml"
    base.write_text(yaml.safe_dump(TINY))
    overlay.write_text("overlay_of: base.yaml\nrename_configs: {tiny: tiny-k1}\nreplay: {k: 1}\n")
    dry = [*SNAKEMAKE, "--directory", str(tmp_path), "-n", "--replace-workflow-config", "--configfile"]
    for files in ([overlay], [overlay, base]):
        proc = subprocess.run(dry + [str(f) for f in files], capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0
        assert f"k1.yaml is an overlay of {base}" in proc.stderr + proc.stdout
    proc = subprocess.run(dry + [str(base), str(overlay)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "results/analysis/tiny-k1/comparison.json" in proc.stdout
    assert "results/analysis/tiny/" not in proc.stdout


def test_a_rename_onto_a_kept_configuration_or_two_onto_one_is_refused(committed):
    two = {"configs": {"a": {"model": "smollm2-135m"}, "b": {"model": "smollm2-135m"}}}
    with pytest.raises(ConfigError, match=r"rename_configs\.a: 'b' is already a configuration"):
        validate_config({**two, "rename_configs": {"a": "b"}})
    with pytest.raises(ConfigError, match="two configurations renamed to one name"):
        validate_config({**two, "rename_configs": {"a": "c", "b": "c"}})
    swapped = validate_config({**two, "rename_configs": {"a": "b", "b": "a"}})
    assert sorted(swapped["configs"]) == ["a", "b"] and "rename_configs" not in swapped


def test_validate_does_not_mutate_its_argument(committed):
    minimal = {"configs": {"x": {"model": "smollm2-135m"}}}
    snapshot = copy.deepcopy(minimal)
    validate_config(minimal)
    assert minimal == snapshot


def test_schema_defaults_equal_committed_values(committed):
    """A near-empty config gets every section filled, with exactly the committed values."""
    filled = validate_config({"configs": {"x": {"model": "smollm2-135m"}}})
    # a section whose absence is its default (x-absent-default: the regime probe's) is neither filled nor committed
    filled_sections = {key for key, sub in load_schema()["properties"].items() if "x-absent-default" not in sub}
    assert set(filled) == filled_sections == set(committed)
    # The one named configuration gets every per-config default; compare it with the committed one.
    filled["configs"] = {CONFIG_NAME: filled["configs"]["x"]}
    assert filled["configs"][CONFIG_NAME]["model"] == committed["configs"][CONFIG_NAME]["model"]
    problems = leaf_differences(filled, committed)
    assert not problems, "config/schema.yaml and config/config.yaml disagree:\n" + "\n".join(problems)


def test_every_schema_property_documents_a_default_or_is_required():
    schema = load_schema()
    missing = []

    def walk(node: dict, path: str) -> None:
        required = set(node.get("required", []))
        for key, sub in node.get("properties", {}).items():
            sub_path = f"{path}.{key}" if path else key
            # x-derived-default: filled in by validation where it applies (the invariant decoder's shape);
            # x-absent-default: absence is the default (added keys that leave every existing configuration's
            # settings, and so its analysis hash, as they were)
            if not {"default", "x-derived-default", "x-absent-default"} & set(sub) and key not in required:
                missing.append(sub_path)
            walk(sub, sub_path)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            walk(extra, f"{path}.<name>")

    walk(schema, "")
    assert not missing, f"schema properties without a default: {missing}"


# --- bad values fail by name ----------------------------------------------------------------------------------

BAD_VALUES = {
    "k-zero": ("replay.k", 0, ["replay.k", "minimum of 1"]),
    "unknown-pass": (
        "replay.passes",
        ["exact", "replica", "refeed", "bogus"],
        [
            "replay.passes",
            "'bogus'",
            "allowed values: exact, replica, refeed, selector, refeed_text, refeed_cached, "
            "replica_fresh, refeed_replica, serial, transplant_decode",
            "transplant_refeed_lo<L>",
        ],
    ),
    "passes-without-refeed": ("replay.passes", ["exact", "replica", "selector"], ["replay.passes", "'refeed'"]),
    "unknown-source": (
        "dataset.source",
        "mnist",
        [
            "dataset.source",
            "'mnist'",
            "allowed values: simple_addsub, gsm8k, gsm8k_train, svamp, "
            "mawps_addsub, mawps_singleop, mawps_multiarith, mawps_singleeq, file",
        ],
    ),
    "bad-dtype": (
        f"configs.{CONFIG_NAME}.dtype",
        "int8",
        [f"configs.{CONFIG_NAME}.dtype", "'int8'", "allowed values: bfloat16, float16, float32"],
    ),
    "n-problems-string": ("dataset.n_problems", "12", ["dataset.n_problems", "not of type 'integer'"]),
    "unknown-top-level": ("bogus_section", {"a": 1}, ["(top level)", "bogus_section", "allowed keys:", "replay"]),
    "unknown-model": (
        f"configs.{CONFIG_NAME}.model",
        "no-such-model-xyz",
        [f"configs.{CONFIG_NAME}.model", "no-such-model-xyz", "smollm2-135m"],
    ),
    "unknown-nested-key": ("pivots.max_margn", 0.1, ["pivots", "max_margn", "allowed keys:", "max_margin"]),
    "bad-device": (f"configs.{CONFIG_NAME}.device", "gpu", [f"configs.{CONFIG_NAME}.device", "'gpu'"]),
}


@pytest.mark.parametrize("key,value,expected", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_bad_value_fails_naming_the_key(committed, key, value, expected):
    with pytest.raises(ConfigError) as info:
        validate_config(with_value(committed, key, value))
    message = str(info.value)
    for text in expected:
        assert text in message, f"{text!r} not in {message!r}"


def test_passes_missing_two_required_names_reports_both(committed):
    config = with_value(committed, "replay.passes", ["exact", "selector", "refeed_text"])
    with pytest.raises(ConfigError) as info:
        validate_config(config)
    assert "'replica'" in str(info.value) and "'refeed'" in str(info.value)
    assert "must include 'exact'" not in str(info.value)


def test_file_source_without_path_fails(committed):
    config = with_value(committed, "dataset.source", "file")
    with pytest.raises(ConfigError, match=r"dataset\.path: required when dataset\.source is 'file'"):
        validate_config(config)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"sample": "listed"}, r"dataset\.ids: required when dataset\.sample is 'listed'"),
        ({"ids": ["svamp-0001"]}, r"dataset\.ids: given with dataset\.sample 'random', which does not read it"),
        ({"sample": "listed", "ids": ["a", "b"], "n_problems": 3}, r"2 ids listed, but n_problems is 3"),
        ({"sample": "listed", "ids": ["a", "a"], "n_problems": 2}, r"dataset\.ids"),  # the schema: unique items
    ],
)
def test_a_listed_sample_needs_its_ids_and_nothing_else_takes_them(committed, given, message):
    config = with_value(committed, "dataset", {**committed["dataset"], **given})
    with pytest.raises(ConfigError, match=message):
        validate_config(config)


def listed(*ids: str) -> dict:
    return {
        "configs": {"c": {"model": "smollm2-135m"}},
        "dataset": {"source": "simple_addsub", "sample": "listed", "n_problems": len(ids), "ids": list(ids)},
    }


def test_a_listed_sample_is_hashed_by_its_ids_in_any_order_and_absent_elsewhere():
    one = validate_config(listed("simple_addsub-1", "simple_addsub-7"))
    assert one["dataset"]["ids"] == ["simple_addsub-1", "simple_addsub-7"]
    assert analysis_hash(validate_config(listed("simple_addsub-7", "simple_addsub-1"))) == analysis_hash(one)
    assert analysis_hash(validate_config(listed("simple_addsub-1", "simple_addsub-8"))) != analysis_hash(one)
    assert "ids" not in validate_config({"configs": {"c": {"model": "smollm2-135m"}}})["dataset"]


def test_a_listed_sample_runs_its_problems_and_only_other_ids_rerun_it(tmp_path):
    """The ids reach sample_problems as a param: the step takes exactly those problems, other ids rerun it (for
    that reason), the same ids in another order do not."""
    target = "results/problems/simple_addsub.parquet"
    snakemake(tmp_path, listed("simple_addsub-9", "simple_addsub-2", "simple_addsub-4"), target)
    taken = pl.read_parquet(tmp_path / target)["problem_id"].to_list()
    assert taken == ["simple_addsub-2", "simple_addsub-4", "simple_addsub-9"]
    assert rerun_readers(tmp_path, listed("simple_addsub-4", "simple_addsub-9", "simple_addsub-2")) == set()
    assert rerun_readers(tmp_path, listed("simple_addsub-9", "simple_addsub-2", "simple_addsub-5")) >= {
        "sample_problems"
    }


def test_file_source_with_missing_file_fails(committed, tmp_path):
    missing = tmp_path / "nope.jsonl"
    config = with_value(with_value(committed, "dataset.source", "file"), "dataset.path", str(missing))
    with pytest.raises(ConfigError, match=r"dataset\.path: file not found") as info:
        validate_config(config)
    assert str(missing) in str(info.value)


def test_file_source_with_existing_file_and_local_model_dir_validate(committed, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):  # only their presence is checked here
        (model_dir / name).write_text("{}")
    config = with_value(with_value(committed, "dataset.source", "file"), "dataset.path", str(data))
    config = with_value(config, f"configs.{CONFIG_NAME}.model", str(model_dir))
    validated = validate_config(config)
    assert validated["dataset"]["path"] == str(data)
    # A path that is a file, not a directory, is not a model.
    with pytest.raises(ConfigError, match=rf"configs\.{re.escape(CONFIG_NAME)}\.model"):
        validate_config(with_value(config, f"configs.{CONFIG_NAME}.model", str(data)))


@pytest.mark.parametrize(
    "missing, message",
    [
        ("tokenizer.json", "no tokenizer"),
        ("model.safetensors", "no \\*.safetensors"),
        ("config.json", "no config.json"),
    ],
)
def test_local_model_dir_missing_a_part_fails_at_validation(committed, tmp_path, missing, message):
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    for name in {"config.json", "model.safetensors", "tokenizer.json"} - {missing}:
        (model_dir / name).write_text("{}")
    with pytest.raises(ConfigError, match=rf"configs\.{re.escape(CONFIG_NAME)}\.model: .*{message}") as info:
        validate_config(with_value(committed, f"configs.{CONFIG_NAME}.model", str(model_dir)))
    assert str(model_dir) in str(info.value)


def test_configs_must_be_non_empty_and_well_named(committed):
    with pytest.raises(ConfigError, match=r"config key configs: \{\} should be non-empty"):
        validate_config(with_value(committed, "configs", {}))
    with pytest.raises(ConfigError, match=r"config key configs: 'bad name!' does not match"):
        validate_config({"configs": {"bad name!": {"model": "smollm2-135m"}}})
    with pytest.raises(ConfigError, match=r"config key configs\.x: 'model' is a required property"):
        validate_config({"configs": {"x": {"dtype": "float32"}}})


# --- the pre-registration hash and deviations -----------------------------------------------------------------

PROTOCOL_CHANGES = {
    "seed": 1,
    "dataset.n_problems": 13,
    "prompt.style": "plain",
    f"configs.{CONFIG_NAME}.temperature": 1.0,
    "pivots.max_margin": 0.1,
    "pivots.choose": "lowest_margin",
    "replay.k": 8,
    "replay.passes": ["exact", "replica", "refeed", "selector"],
    "analysis.theta": 0.25,
    "analysis.min_verified": 0.5,
}


@pytest.mark.parametrize("key,value", PROTOCOL_CHANGES.items(), ids=PROTOCOL_CHANGES.keys())
def test_analysis_hash_changes_with_a_protocol_value(committed, key, value):
    base = validate_config(committed)
    changed = validate_config(with_value(committed, key, value))
    assert analysis_hash(changed) != analysis_hash(base)
    assert re.fullmatch(r"[0-9a-f]{16}", analysis_hash(changed))


@pytest.mark.parametrize(
    "key,value", [("figures.conditioning", "none"), ("figures.margin_bins", 9), ("resources.threads", 16)]
)
def test_analysis_hash_ignores_figures_and_resources(committed, key, value):
    base = validate_config(committed)
    changed = validate_config(with_value(committed, key, value))
    assert changed != base
    assert analysis_hash(changed) == analysis_hash(base)
    assert deviations(changed) == []


def test_min_verified_written_at_its_absent_value_changes_no_hash_and_out_of_range_is_refused(committed):
    base = validate_config(committed)
    written = validate_config(with_value(committed, "analysis.min_verified", 0.99))
    assert "min_verified" not in written["analysis"] and analysis_hash(written) == analysis_hash(base)
    for bad in (0, 1.5, "all"):
        with pytest.raises(ConfigError, match="min_verified"):
            validate_config(with_value(committed, "analysis.min_verified", bad))


def test_analysis_hash_independent_of_key_order(committed):
    reordered = {key: committed[key] for key in reversed(list(committed))}
    reordered["replay"] = {key: committed["replay"][key] for key in reversed(list(committed["replay"]))}
    assert analysis_hash(validate_config(reordered)) == analysis_hash(validate_config(committed))


def test_no_deviations_for_the_committed_config(committed):
    assert deviations(validate_config(committed)) == []


def test_deviations_list_exactly_the_changed_keys(committed):
    config = with_value(committed, "replay.k", 8)
    config = with_value(config, f"configs.{CONFIG_NAME}.temperature", 1.0)
    config = with_value(config, "dataset.n_problems", 30)
    config = with_value(config, "figures.margin_bins", 3)  # not protocol: never a deviation
    found = deviations(validate_config(config))
    assert found == [
        {"key": f"configs.{CONFIG_NAME}.temperature", "value": 1.0, "default": 0.7},
        {"key": "dataset.n_problems", "value": 30, "default": 48},
        {"key": "replay.k", "value": 8, "default": 4},
    ]


def test_deviations_against_explicit_defaults(committed):
    defaults = validate_config(committed)
    config = with_value(defaults, "analysis.ci", 0.9)
    assert [d["key"] for d in deviations(config, defaults)] == ["analysis.ci"]
    assert deviations(defaults, defaults) == []


# --- Snakemake: the check runs at parse time, before any job ---------------------------------------------------


def snakemake_exe() -> str:
    beside = Path(sys.executable).with_name("snakemake")
    exe = str(beside) if beside.exists() else shutil.which("snakemake")
    if exe is None:
        pytest.skip("snakemake is not installed")
    return exe


def dry_run(workdir: Path, *configfiles: Path) -> subprocess.CompletedProcess:
    # Name the committed config explicitly: a relative ``configfile:`` in the Snakefile would be looked up in the
    # working directory (the empty tmp dir), and extra configfiles are merged over it key by key.
    cmd = [
        snakemake_exe(),
        "-n",
        "--cores",
        "1",
        "--directory",
        str(workdir),
        "-s",
        str(SNAKEFILE),
        "--configfile",
        str(DEFAULT_CONFIG_PATH),
        *map(str, configfiles),
    ]
    return subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, timeout=180)


def job_counts(output: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run, as rule -> count."""
    table = output.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.MULTILINE)}


@pytest.mark.parametrize(
    "override,key",
    [({"replay": {"k": 0}}, "replay.k"), ({"dataset": {"source": "mnist"}}, "dataset.source")],
    ids=["k-zero", "unknown-source"],
)
def test_snakemake_refuses_a_bad_config_before_any_job(tmp_path, override, key):
    workdir = tmp_path / "work"
    workdir.mkdir()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(override))  # merged over the default config by Snakemake
    proc = dry_run(workdir, bad)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert f"config key {key}" in output, output
    assert not (workdir / "results").exists()


def test_snakemake_dry_run_lists_the_whole_pipeline(tmp_path):
    proc = dry_run(tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    jobs = job_counts(output)
    expected = {
        "sample_problems",
        "prepare_model",
        "generate_rollouts",
        "select_pivots",
        "replay_exact",
        "replay_replica",
        "replay_refeed",
        "compute_credit",
        "compare_passes",
        "compare_pooled",
        "headline_tables",
        "manifest",
        "all",
        "gather_rollouts",
        "gather_pass",
        "cost_report",
        "index_kv",
        "prefix_mismatch",
        "mechanism",
    }
    figures = {
        f"figure_{name}"
        for name in (
            "disagreement",
            "kinds_of_change",
            "jaccard_sweep",
            "diff_histogram",
            "disagreement_vs_margin",
            "channel_agreement",
            "mismatch_flips",
            "mechanism",
        )
    }
    assert set(jobs) == expected | figures, output
    assert jobs["compute_credit"] == jobs["gather_pass"] == 3  # one configuration x three passes
    assert jobs["generate_rollouts"] == 1 and jobs["replay_exact"] == 1  # 16 problems fit one shard of 50
    assert not (tmp_path / "results").exists()


def test_snakemake_dry_run_follows_the_configured_passes(tmp_path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    four = tmp_path / "four.yaml"
    four.write_text(yaml.safe_dump({"replay": {"passes": ["exact", "replica", "refeed", "selector"]}}))
    proc = dry_run(workdir, four)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    jobs = job_counts(output)
    assert {"replay_exact", "replay_replica", "replay_refeed", "replay_selector"} <= set(jobs)
    assert jobs["compute_credit"] == 4


# --- values the schema lets through ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value", [("replay.k", 4.0), ("rollouts.per_problem", 8.0), ("configs.smollm2-bf16.max_new_tokens", 40.0)]
)
def test_integer_keys_given_as_floats_are_refused_by_name(committed, key, value):
    with pytest.raises(
        ConfigError,
        match=rf"config key {re.escape(key)}: {value!r} is not an integer \(write "
        rf"{int(value)}\)",
    ):
        validate_config(with_value(committed, key, value))


def test_reordered_keys_give_the_same_validated_text(committed):
    """Snakemake compares params as text: a reordered file must not rerun every step."""
    reordered = {key: committed[key] for key in reversed(list(committed))}
    reordered["replay"] = {key: committed["replay"][key] for key in reversed(list(committed["replay"]))}
    assert repr(validate_config(reordered)) == repr(validate_config(committed))


def test_duplicate_yaml_key_is_refused_naming_the_key_and_both_lines(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("seed: 1\nreplay:\n  k: 4\n  batch_size: 8\n  k: 8\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:5: key 'k' given twice in one mapping \(first at line 3\)"):
        check_config_file(path)
    path.write_text("seed: 1\nreplay:\n  k: 4\n")
    check_config_file(path)


def test_reserved_configuration_name_is_refused(committed):
    config = with_value(committed, "configs", {"pooled": committed["configs"][CONFIG_NAME]})
    with pytest.raises(ConfigError, match=r"configs\.pooled: the name 'pooled' is reserved"):
        validate_config(config)


def test_budgets_beyond_the_models_context_are_refused_by_name(committed):
    with pytest.raises(
        ConfigError,
        match=r"configs\.smollm2-bf16\.max_new_tokens \+ replay\.max_new_tokens: .*"
        r"10000040, beyond the 8192 positions smollm2-135m",
    ):
        validate_config(with_value(committed, "replay.max_new_tokens", 10_000_000))
    validate_config(with_value(committed, "replay.max_new_tokens", 4000))


def test_report_captions_substitute_nothing_by_accident():
    """Captions are reStructuredText inside a Jinja template: ``|A|`` is an RST substitution reference (the
    report logs "Undefined substitution referenced") and a lone brace is read by the template."""
    for caption in (REPO / "workflow" / "report").glob("*.rst"):
        text = re.sub(r"\{\{.*?\}\}", "", caption.read_text())
        assert not re.search(r"\|[^|\s][^|]*\|", text), caption.name
        assert "{" not in text and "}" not in text, caption.name


# ------------------------------------------------------------------------------------------ vLLM settings


def _vllm(committed: dict, **settings) -> dict:
    config = copy.deepcopy(committed)
    config["configs"]["smollm2-bf16"].update({"engine": "vllm", **settings})
    return config


def test_vllm_settings_default_to_the_papers_regime_and_exist_only_for_vllm(committed):
    hf = validate_config(committed)["configs"]["smollm2-bf16"]
    assert "vllm" not in hf  # an hf configuration's settings, and so its analysis hash, are as before
    gpu = validate_config(_vllm(committed, device="cuda", block_size=16))["configs"]["smollm2-bf16"]["vllm"]
    assert gpu == {
        "eager": False,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "chunked_prefill": True,
        "async_scheduling": True,
        "max_model_len": 4096,
        "gpu_memory_utilization": 0.92,
    }
    cpu = validate_config(_vllm(committed))["configs"]["smollm2-bf16"]["vllm"]
    assert cpu["eager"] is True and cpu["async_scheduling"] is False  # CUDA graphs are a GPU's; so is async here
    with pytest.raises(ConfigError, match=r"vllm\.async_scheduling: true on device cpu"):
        validate_config(_vllm(committed, vllm={"async_scheduling": True}))
    assert validate_config(_vllm(committed, vllm={"eager": False}))["configs"]["smollm2-bf16"]["vllm"]["eager"] is False


def test_invariant_vllm_is_eager_and_refuses_compiled_mode_by_name(committed):
    inv = validate_config(_vllm(committed, device="cuda", block_size=16, kernels="invariant"))
    assert inv["configs"]["smollm2-bf16"]["vllm"]["eager"] is True
    assert inv["configs"]["smollm2-bf16"]["vllm"]["max_num_seqs"] == 256  # nothing else overridden
    with pytest.raises(ConfigError, match=r"configs\.smollm2-bf16\.vllm\.eager: false with kernels invariant"):
        validate_config(_vllm(committed, device="cuda", block_size=16, kernels="invariant", vllm={"eager": False}))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"vllm": {"max_model_len": 64}}, r"configs\.smollm2-bf16\.vllm\.max_model_len: 64 positions do not hold"),
        ({"vllm": {"max_model_len": 9000}}, r"configs\.smollm2-bf16\.vllm\.max_model_len: 9000 is beyond the 8192"),
        (
            {"vllm": {"chunked_prefill": False, "max_num_batched_tokens": 2048}},
            r"vllm\.max_num_batched_tokens: 2048 is below max_model_len 4096 with chunked_prefill false",
        ),
        (
            {"vllm": {"max_num_seqs": 512, "max_num_batched_tokens": 256}},
            r"vllm\.max_num_batched_tokens: 256 is below max_num_seqs 512",
        ),
        ({"vllm": {"gpu_memory_utilization": 1.5}}, r"vllm\.gpu_memory_utilization: 1\.5 is greater than the maximum"),
        ({"vllm": {"eagre": True}}, r"vllm: Additional properties are not allowed \('eagre' was unexpected\)"),
    ],
)
def test_bad_vllm_settings_are_refused_at_parse_time_by_key(committed, settings, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(_vllm(committed, **settings))


def test_a_vllm_block_on_an_hf_configuration_is_refused(committed):
    config = copy.deepcopy(committed)
    config["configs"]["smollm2-bf16"]["vllm"] = {"eager": True}
    with pytest.raises(ConfigError, match=r"configs\.smollm2-bf16\.vllm: settings of the vllm engine, but .* 'hf'"):
        validate_config(config)


def test_vllm_settings_enter_the_analysis_hash_unless_they_cannot_change_a_number(committed):
    base = analysis_hash(validate_config(_vllm(committed)))
    assert analysis_hash(validate_config(_vllm(committed, vllm={"max_num_seqs": 64}))) != base
    assert (
        analysis_hash(
            validate_config(_vllm(committed, vllm={"chunked_prefill": False, "max_num_batched_tokens": 4096}))
        )
        != base
    )
    assert analysis_hash(validate_config(_vllm(committed, vllm={"gpu_memory_utilization": 0.5}))) == base


def _tp(committed: dict, tp: int | None, gpus: int = 4, **settings) -> dict:
    config = _vllm(committed, **{"device": "cuda", "block_size": 16, **settings})
    if tp is not None:
        config["configs"]["smollm2-bf16"]["vllm"] = {"tensor_parallel_size": tp}
    config["resources"] = {**config.get("resources", {}), "gpus": gpus}
    return config


def test_tensor_parallelism_sets_the_gpus_a_job_holds_and_reaches_vllm(committed, monkeypatch):
    tp3 = validate_config(_tp(committed, 3))["configs"]["smollm2-bf16"]
    assert job_gpus(tp3) == 3 and llm_kwargs(tp3)["tensor_parallel_size"] == 3
    one = validate_config(_tp(committed, None))["configs"]["smollm2-bf16"]
    assert "tensor_parallel_size" not in one["vllm"]  # absent unless given: earlier runs' settings unchanged
    assert job_gpus(one) == 1 and "tensor_parallel_size" not in llm_kwargs(one)
    hf = validate_config(with_value(committed, "resources.gpus", 4))["configs"]["smollm2-bf16"]
    assert job_gpus(hf) == 0  # the committed configuration runs on the CPU
    assert job_gpus({**hf, "device": "cuda"}) == 1  # the HF engine holds one GPU, whatever resources.gpus allows
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert invariant_llm_kwargs()["disable_custom_all_reduce"] is True


def test_tensor_parallelism_is_hashed_only_above_one_gpu(committed):
    base = analysis_hash(validate_config(_tp(committed, None)))
    assert analysis_hash(validate_config(_tp(committed, 1))) == base
    assert analysis_hash(validate_config(_tp(committed, 3))) != base


@pytest.mark.parametrize(
    "tp, gpus, settings, message",
    [
        (3, 1, {}, r"vllm\.tensor_parallel_size: 3 GPUs per job, but resources\.gpus lets a job hold 1"),
        (2, 4, {}, r"vllm\.tensor_parallel_size: 2 does not divide the 9 attention heads of smollm2-135m"),
        (3, 4, {"device": "cpu", "block_size": 32}, r"vllm\.tensor_parallel_size: 3 on device cpu"),
        (3, 4, {"engine": "hf"}, r"smollm2-bf16\.vllm: settings of the vllm engine, but .* 'hf'.* runs on one GPU"),
    ],
)
def test_bad_tensor_parallelism_is_refused_at_parse_time_by_key(committed, tp, gpus, settings, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(_tp(committed, tp, gpus, **settings))


def test_serial_pivots_exists_only_where_the_serial_pass_runs(committed):
    assert "serial_pivots" not in validate_config(committed)["replay"]
    config = with_value(committed, "replay.passes", ["exact", "replica", "refeed", "serial"])
    assert validate_config(config)["replay"]["serial_pivots"] == 50
    config["replay"]["serial_pivots"] = 0
    with pytest.raises(ConfigError, match=r"replay\.serial_pivots: 0 is less than the minimum of 1"):
        validate_config(config)


def test_cross_scoring_names_two_configurations_of_one_model_and_leaves_the_hash_alone_when_absent():
    two = {
        "configs": {
            "a": {"model": "smollm2-135m"},
            "b": {"model": "smollm2-135m", "dtype": "float32"},
            "q": {"model": "qwen2.5-coder-0.5b"},
        }
    }
    assert "cross_scoring" not in validate_config(two)["analysis"]  # absent: no filled default, the hash as before
    pair = {"rollouts": "a", "scorer": "b"}
    given = validate_config({**two, "analysis": {"cross_scoring": [pair]}})
    assert given["analysis"]["cross_scoring"] == [pair]
    assert analysis_hash(given) != analysis_hash(validate_config(two))
    refused = (
        (("a", "c"), r"cross_scoring\[0\]\.scorer: 'c' is not a configuration"),
        (("a", "a"), r"cross_scoring\[0\]: the rollouts and the scorer are both"),
        (
            ("a", "q"),
            r"cross_scoring\[0\]: the rollouts' model 'smollm2-135m' and the scorer's "
            r"'qwen2.5-coder-0.5b' differ",
        ),
    )
    for (rollouts, scorer), message in refused:
        bad = {"rollouts": rollouts, "scorer": scorer}
        with pytest.raises(ConfigError, match=message):
            validate_config({**two, "analysis": {"cross_scoring": [bad]}})


@pytest.mark.parametrize("draws", [33, 1000, 10**9])
def test_replicates_past_their_bound_are_refused_by_key_before_any_plan(draws):
    """R = 1000 took over 180 s to plan and R = 10^9 ended in a MemoryError that named no key."""
    with pytest.raises(ConfigError, match=rf"replay\.replicates: {draws} is greater than the maximum of 32"):
        validate_config(_tiny(replay={"replicates": draws}))
    assert validate_config(_tiny(replay={"replicates": 32}))["replay"]["replicates"] == 32


def test_one_local_model_directory_however_spelled_is_one_model(tmp_path, monkeypatch):
    """A trailing slash, a link or a relative path to the same directory name one model: a cross-scoring pair of
    them was refused as of two models."""
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):  # only their presence is checked here
        (model_dir / name).write_text("{}")
    (tmp_path / "link").symlink_to(model_dir)
    monkeypatch.chdir(tmp_path)
    pair = {"rollouts": "a", "scorer": "b"}
    for other in (f"{model_dir}/", str(tmp_path / "link"), "my-model", "./link/"):
        two = {"configs": {"a": {"model": str(model_dir)}, "b": {"model": other}}}
        assert validate_config({**two, "analysis": {"cross_scoring": [pair]}})["analysis"]["cross_scoring"] == [pair]
    (tmp_path / "copy").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / "copy" / name).write_text("{}")
    two = {"configs": {"a": {"model": str(model_dir)}, "b": {"model": str(tmp_path / "copy")}}}
    with pytest.raises(ConfigError, match="differ"):
        validate_config({**two, "analysis": {"cross_scoring": [pair]}})


def test_a_cross_scoring_pair_plans_one_job_of_the_scorer_on_the_rollouts_pivots(tmp_path):
    """The scorer's model job reads the other configuration's rollouts and pivots; both its outputs are in the
    manifest; without the key the plan has no such job."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    overlay = tmp_path / "cross.yaml"
    two = {
        "configs": {
            "smollm2-bf16": {"model": "smollm2-135m"},
            "smollm2-fp32": {"model": "smollm2-135m", "dtype": "float32"},
        }
    }
    overlay.write_text(
        yaml.safe_dump({**two, "analysis": {"cross_scoring": [{"rollouts": "smollm2-bf16", "scorer": "smollm2-fp32"}]}})
    )
    proc = dry_run(workdir, overlay)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert job_counts(proc.stdout)["cross_score"] == 1
    job = proc.stdout.split("rule cross_score:", 1)[1].split("\n\n", 1)[0]
    assert (
        "input: results/models/smollm2-135m-float32, results/rollouts/smollm2-bf16/rollouts.parquet, "
        "results/pivots/smollm2-bf16.parquet"
    ) in job
    assert (
        "output: results/cross/smollm2-bf16/smollm2-fp32.parquet, results/cross/smollm2-bf16/smollm2-fp32.json"
    ) in job
    manifest = proc.stdout.split("rule manifest:", 1)[1].split("\n\n", 1)[0]
    assert "results/cross/smollm2-bf16/smollm2-fp32.json" in manifest
    overlay.write_text(yaml.safe_dump(two))
    assert "cross_score" not in job_counts(dry_run(workdir, overlay).stdout)


# ------------------------------------------------------------------------- one setting, one fingerprint


def _tiny(**sections):
    base = {"configs": {"c": {"model": "smollm2-135m"}}}
    for key, value in sections.items():
        base[key] = value
    return base


@pytest.mark.parametrize(
    "written",
    [
        {"rollouts": {"long_prompts": "refuse"}},
        {"analysis": {"cross_scoring": []}},
        {"configs": {"c": {"model": "smollm2-135m", "stop": []}}},
        {"prompt": {"shots": []}},
        {"replay": {"replicates": 1}},
        {"configs": {"c": {"model": "smollm2-135m", "cpu_threads": 2}}},
        {"replay": {"serial_pivots": 30}},  # no serial pass: no step reads it
    ],
    ids=lambda w: ".".join(str(k) for k in _path(w)),
)
def test_a_documented_default_written_out_validates_to_the_config_without_it(written):
    """The validated mapping is what the analysis hash and every rule's params read: equal mappings give equal
    fingerprints and rerun nothing (an audit found long_prompts: refuse rerunning the rollouts and every pass)."""
    assert validate_config(_tiny(**written)) == validate_config(_tiny())
    assert analysis_hash(validate_config(_tiny(**written))) == analysis_hash(validate_config(_tiny()))


def test_the_default_static_attention_written_out_fingerprints_as_its_absence(monkeypatch):
    """static_attention: gemm changed the hash and reran the rollouts and every pass, with identical tables; a
    variable that says otherwise than the key is refused when the configuration is read."""
    monkeypatch.delenv("REPLAYNOISE_STATIC_ATTENTION", raising=False)
    static = {"model": "smollm2-135m", "device": "cuda", "decode": "static"}
    plain = validate_config({"configs": {"c": static}})
    written = validate_config({"configs": {"c": {**static, "static_attention": "gemm"}}})
    assert written == plain and analysis_hash(written) == analysis_hash(plain)
    assert validate_config({"configs": {"c": {**static, "static_attention": "sdpa"}}}) != plain
    monkeypatch.setenv("REPLAYNOISE_STATIC_ATTENTION", "sdpa")
    with pytest.raises(ConfigError, match=r"configs\.c\.static_attention: gemm, and the run's REPLAYNOISE_STATIC"):
        validate_config({"configs": {"c": {**static, "static_attention": "gemm"}}})


def _path(mapping):
    key = next(iter(mapping))
    value = mapping[key]
    return [
        key,
        *(
            _path({k: v for k, v in value.items() if k != "model"})
            if isinstance(value, dict) and any(k != "model" for k in value)
            else []
        ),
    ]


def test_lists_that_are_sets_fingerprint_alike_in_any_order():
    a = _tiny(
        configs={"c": {"model": "smollm2-135m", "stop": ["\n", "Q:"]}},
        pivots={"align_to_block": True, "block_offsets": [2, 0, 1]},
    )
    b = _tiny(
        configs={"c": {"model": "smollm2-135m", "stop": ["Q:", "\n", "Q:"]}},
        pivots={"align_to_block": True, "block_offsets": [0, 1, 2]},
    )
    assert validate_config(a) == validate_config(b)


# ------------------------------------------------------------------- refused by key, never a crash, never late


@pytest.mark.parametrize("tp", ["2", None, [2], 2])
def test_a_vllm_block_on_an_hf_configuration_is_refused_by_key_whatever_it_holds(tp):
    config = {"configs": {"c": {"model": "smollm2-135m", "vllm": {"tensor_parallel_size": tp}}}}
    with pytest.raises(ConfigError, match=r"configs\.c\.vllm: settings of the vllm engine"):
        validate_config(config)


@pytest.mark.parametrize(
    "given, kernels, device, key",
    [
        ({"async_scheduling": "yes"}, "stock", "cpu", "async_scheduling"),
        ({"eager": "no"}, "invariant", "cuda", "eager"),
        ({"max_num_seqs": "256"}, "stock", "cuda", "max_num_seqs"),
    ],
)
def test_a_vllm_setting_of_the_wrong_type_is_refused_not_replaced(given, kernels, device, key):
    """A string "yes" was silently replaced by the CPU default (and "no" under invariant by true)."""
    config = {
        "configs": {
            "c": {
                "model": "smollm2-135m",
                "engine": "vllm",
                "kernels": kernels,
                "device": device,
                "block_size": 32,
                "vllm": given,
            }
        }
    }
    with pytest.raises(ConfigError, match=rf"configs\.c\.vllm\.{key}: .* is not of type"):
        validate_config(config)


def test_a_layer_transplant_beyond_the_model_is_refused_when_the_config_is_read():
    config = {
        "configs": {"c": {"model": "smollm2-135m"}},
        "replay": {"passes": ["exact", "replica", "refeed", "transplant_refeed_lo99"]},
    }
    with pytest.raises(
        ConfigError,
        match=r"'transplant_refeed_lo99' transplants at layer 99, but configs\.c's "
        r"model smollm2-135m has 30 layers",
    ):
        validate_config(config)
    config["replay"]["passes"][-1] = "transplant_refeed_hi30"
    validate_config(config)


def test_a_cross_scoring_pair_given_twice_is_refused():
    pair = {"rollouts": "a", "scorer": "b"}
    config = {
        "configs": {"a": {"model": "smollm2-135m"}, "b": {"model": "smollm2-135m", "dtype": "float16"}},
        "analysis": {"cross_scoring": [pair, {"rollouts": "b", "scorer": "a"}, dict(pair)]},
    }
    with pytest.raises(ConfigError, match=r"cross_scoring\[2\]: the pair .* is given twice .*\[0\]"):
        validate_config(config)


@pytest.mark.parametrize("path", sorted((REPO / "benchmarks" / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_benchmark_configuration_validates(path, tiny_model, tmp_path, monkeypatch):
    """The benchmark drivers run these files through the workflow on a lent GPU: one that no longer validates (five
    did, after the mixed screen became the default) costs a lease to find out. The 7B shape's model is a directory
    the driver makes on the GPU, relative to the run's folder: the tiny test model stands in, with the 7B's context."""
    shape = tmp_path / "shapes" / "qwen2.5-7b"
    shutil.copytree(tiny_model, shape)
    settings = json.loads((shape / "config.json").read_text())
    (shape / "config.json").write_text(json.dumps({**settings, "max_position_embeddings": 32768}))  # Qwen2.5-7B's
    monkeypatch.chdir(tmp_path)
    check_config_file(path)
    assert validate_config(load_campaign(path))["configs"]
