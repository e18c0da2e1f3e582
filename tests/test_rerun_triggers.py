"""Every setting reruns exactly the steps that read it: for each key of the schema, a changed value planned against
a finished run reruns (for that reason, not because an upstream output changed) the steps listed here, and the
steps downstream of them. An audit found rollouts.screen.keep rerunning the rollouts and every pass (only
select_pivots reads the screen), and serial_pivots without the serial pass rerunning every pass."""

from __future__ import annotations

import pytest
import yaml
from helpers import REPO, TINY, rerun_readers, with_setting

PASSES = {f"replay_{p}" for p in TINY["replay"]["passes"]}
ROLLOUTS = {"generate_rollouts"}
ANALYSIS = {"compare_passes", "compare_pooled", "mechanism"}
FIGURES = {
    f"figure_{f}"
    for f in (
        "diff_histogram",
        "disagreement",
        "disagreement_vs_margin",
        "jaccard_sweep",
        "kinds_of_change",
        "mismatch_flips",
    )
}
#: The prices are the cost statement's alone (the manifest records the configuration of the run that wrote it).
PRICES = {"cost_report"}

#: key (configs.* is the tiny configuration) -> (a changed value, the steps that read it)
READERS = {
    "seed": (12, {"sample_problems"}),
    "dataset.n_problems": (4, {"sample_problems"}),
    "dataset.sample": ("first", {"sample_problems"}),
    "prompt.style": ("plain", ROLLOUTS),
    "prompt.instruction": ("Answer briefly.", ROLLOUTS),
    "prompt.shots": ([{"question": "What is 1 plus 1?", "answer": "2"}], ROLLOUTS),
    "configs.*.dtype": ("bfloat16", ROLLOUTS),
    "configs.*.kernels": ("invariant", ROLLOUTS),
    "configs.*.block_size": (16, ROLLOUTS),
    "configs.*.kv_cache_gib": (2, ROLLOUTS),
    "configs.*.decode": ("dynamic", ROLLOUTS),
    "configs.*.cpu_matmul": ("native", ROLLOUTS),
    "configs.*.cpu_threads": (2, ROLLOUTS),
    "configs.*.temperature": (0.8, ROLLOUTS),
    "configs.*.top_p": (0.9, ROLLOUTS),
    "configs.*.max_new_tokens": (20, ROLLOUTS),
    "configs.*.stop": (["\n"], ROLLOUTS),
    "rollouts.per_problem": (2, ROLLOUTS),
    "rollouts.batch_size": (2, ROLLOUTS),
    "rollouts.screen.fixed": (1, {"select_pivots"}),
    "rollouts.screen.skip": (1, {"select_pivots"}),
    "rollouts.screen.keep": (2, {"select_pivots"}),
    "rollouts.long_prompts": ("skip", ROLLOUTS),
    # the pivot rules decide how much of each rollout's KV is kept, so the rollouts read them too
    "pivots.margin_metric": ("logprob_gap", ROLLOUTS),
    "pivots.max_margin": (0.25, ROLLOUTS),
    "pivots.per_rollout": (3, ROLLOUTS),
    "pivots.choose": ("earliest", ROLLOUTS),
    "pivots.substitute": ("best_other", ROLLOUTS),
    "pivots.exclude_special": ("substitute", ROLLOUTS),
    "pivots.exclude_answer_span": (True, ROLLOUTS),
    "pivots.min_position": (0, ROLLOUTS),
    "pivots.min_response_len": (2, ROLLOUTS),
    "pivots.topk": (6, ROLLOUTS),
    "pivots.align_to_block": (True, ROLLOUTS),
    # read only where pivots align to blocks, yet kept in the pivot rules the rollouts read even where they do not:
    # a committed reference's fingerprint (reference/gpu/gemma) was made with them (docs/reliability.md)
    "pivots.block_offsets": ([0, 1], ROLLOUTS),
    "replay.k": (3, PASSES),
    "replay.max_new_tokens": (10, PASSES),
    "replay.temperature": (0.5, PASSES),
    "replay.top_p": (0.9, PASSES),
    "replay.probe_tokens": (8, PASSES),
    "replay.batch_size": (8, PASSES),
    # more draws: new passes, and the steps that read every pass (no existing pass reruns)
    "replay.replicates": (
        2,
        {"compare_pooled", "prefix_mismatch", "figure_diff_histogram", "figure_disagreement_vs_margin"},
    ),
    "replay.serial_pivots": (7, set()),  # without the serial pass no step reads it
    "analysis.theta": (0.25, ANALYSIS),
    "analysis.n_boot": (60, ANALYSIS),
    "analysis.min_eligible": (2, ANALYSIS),
    "analysis.min_verified": (0.5, ANALYSIS),
    "analysis.ci": (0.9, ANALYSIS),
    "analysis.metric": ("value", ANALYSIS | {"figure_disagreement_vs_margin"}),
    "analysis.eligibility": ("finished", {"compute_credit"}),
    "analysis.margin_split": (0.2, ANALYSIS),
    "figures.conditioning": ("none", FIGURES),
    "figures.margin_bins": (4, {"figure_disagreement_vs_margin"}),
    "resources.shard_size": (3, ROLLOUTS),  # the shards' files are other files (tests/test_sharding.py: same numbers)
    # what a job may use moves no result: no step reruns, the manifest included; the cost statement prices each
    # job's declared threads and devices, so it alone follows them
    "resources.threads": (2, PRICES),
    "resources.mem_mb": (4000, set()),
    "resources.runtime": (60, set()),
    "resources.gpus": (2, set()),
    "cost.gpu_hour": (3.0, PRICES),
    "cost.cpu_core_hour": (0.03, PRICES),
    "cost.currency": ("EUR", PRICES),
    # the regime probe is no step of a campaign (snakemake regime; tests/test_mechanism.py checks its own reruns)
    "regime.problems": (2, set()),
    "regime.rollouts": (2, set()),
    "regime.pivots": (4, set()),
}

#: Keys a change of which the tiny finished run cannot plan, and where their readers are checked instead.
ELSEWHERE = {
    "dataset.source": "a dataset of other problems reruns everything (test_data.py)",
    "dataset.path": "a user's file: an input of sample_problems, its edit reruns it (test_bad_inputs.py)",
    "dataset.ids": "given with sample listed only (two keys); a param of sample_problems (test_config.py)",
    "configs.*.model": "another model: its prepared directory is an input of every model step (test_models.py)",
    "configs.*.engine": "the engine: in the settings of every model step, as every configs.* key above",
    "configs.*.device": "the device: in the settings of every model step, as every configs.* key above",
    "configs.*.invariant_rows": "derived for hf invariant static decode; in the settings of every model step",
    "configs.*.invariant_context": "derived for hf invariant static decode; in the settings of every model step",
    "configs.*.static_rows": "hf static decode only (refused on the tiny run's CPU, which decodes dynamically); in "
    "the settings of every pass, not of the rollouts (replaynoise.settings.PASS_ONLY_KEYS)",
    "configs.*.compile_rollouts": "hf static decode on CUDA only (refused on the tiny run's CPU); in the settings of "
    "the rollouts' step, not of the passes (replaynoise.settings.ROLLOUT_ONLY_KEYS, tests/test_compile_rollouts.py)",
    "configs.*.static_attention": "hf static decode only (refused on the tiny run's CPU, which decodes "
    "dynamically); in the settings of every model step, rollouts and passes (tests/test_flash_attention.py)",
    "configs.*.vllm": "a vllm configuration's engine settings, in the settings of its every model step",
    "configs.*.sglang": "an sglang configuration's engine settings, in the settings of its every model step",
    "configs.*.train": "the training recipe (test_training.py: a changed train setting retrains and remeasures)",
    "rollouts.screen.rule": "mixed needs 2 rollouts a problem; its siblings above show the screen is select_pivots'",
    "replay.passes": "a pass added runs alone (test_crossed.py, test_workflow.py's control passes)",
    "replay.stop.when": "no pass or table reads it: out of the analysis hash (test_stopping.py); needs max_pairs",
    "replay.stop.max_pairs": "no pass or table reads it: out of the analysis hash (test_stopping.py)",
    "replay.stop.min_pairs": "no pass or table reads it: out of the analysis hash (test_stopping.py)",
    "replay.stop.half_width_pp": "no pass or table reads it: out of the analysis hash (test_stopping.py)",
    "analysis.cross_scoring": "a pair needs two configurations of one model (test_prefix_mismatch.py)",
    "resources.rules": "per-stage resources, as resources.threads / mem_mb / runtime",
}


def schema_keys(schema: dict, path: str = "") -> list[str]:
    """Every leaf key of the schema, configs.* standing for any configuration, a block the table treats as one
    (vllm, sglang, train, resources.rules) as itself."""
    keys = []
    for key, sub in schema.get("properties", {}).items():
        here = f"{path}.{key}" if path else key
        if here in ("configs.*.vllm", "configs.*.sglang", "configs.*.train", "resources.rules"):
            keys.append(here)
        elif sub.get("type") == "object" and "properties" in sub:
            keys += schema_keys(sub, here)
        elif sub.get("type") == "object" and isinstance(sub.get("additionalProperties"), dict):
            keys += schema_keys(sub["additionalProperties"], f"{here}.*")
        else:
            keys.append(here)
    return keys


def test_every_schema_key_has_its_readers_checked():
    keys = schema_keys(yaml.safe_load((REPO / "config" / "schema.yaml").read_text()))
    assert sorted(keys) == sorted({*READERS, *ELSEWHERE})


@pytest.mark.parametrize("key", sorted(READERS))
def test_a_changed_setting_reruns_exactly_the_steps_that_read_it(tiny_run, key):
    value, readers = READERS[key]
    assert rerun_readers(tiny_run, with_setting(TINY, key.replace("*", "tiny"), value)) == readers


@pytest.mark.parametrize("value", ["sdpa", "gemm"])
def test_the_attention_variable_reruns_the_model_steps_where_it_changes_their_kernel(tiny_run, monkeypatch, value):
    """REPLAYNOISE_STATIC_ATTENTION=sdpa changed 29 result files of a finished gemm run, which reported nothing to
    do: a resumed run could mix kernels. Its value is in the model steps' settings where it changes the kernel."""
    monkeypatch.setenv("REPLAYNOISE_STATIC_ATTENTION", value)
    readers = rerun_readers(tiny_run, TINY)
    if value == "gemm":  # the default: nothing changes
        assert readers == set()
    else:
        assert readers >= ROLLOUTS and "manifest" not in readers  # the passes follow their changed rollouts
