"""The cache-transplant and precision controls (method.md §7), on a tiny random Llama on the CPU.

In bfloat16 a re-fed prefix's KV differs from the decode-time KV (a batched prefill against one token per step),
so exact and refeed continuations differ; a transplant must then follow its donor bit for bit wherever the rest
of the path is the same, and a transplant of a cache into its own pass must change nothing.
"""

from __future__ import annotations

import polars as pl
import pytest
import torch
from helpers import hf_engine, interior_rows, keep_all
from tinymodel import Tokenizer, tiny_llama

from replaynoise.analysis import controls
from replaynoise.config import ConfigError, validate_config
from replaynoise.engines.base import ContinuationRequest, PrefixSource, RolloutRequest, SamplingSettings
from replaynoise.generation import continuations, replay
from replaynoise.generation.passes import PASSES, pass_spec, schedule_of

SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=20)


def continuation_requests(model, tmp_path, decode: str) -> list[ContinuationRequest]:
    """Two rows per pivot (two seeds) at every position of four batched rollouts."""
    made = hf_engine(model, Tokenizer(), decode=decode).generate_rollouts(
        [RolloutRequest(f"p{i}", tuple(range(1, 5 + 3 * i)), seed=10 + i) for i in range(4)],
        SamplingSettings(1.0, 1.0, 16),
        tmp_path,
        keep_all,
    )
    return interior_rows(made, seed=lambda t, k: 100 * t + k)


def outputs(results) -> list[tuple]:
    return [(r.token_ids, r.next_topk_ids, r.next_topk_logprobs, r.next_digest) for r in results]


@pytest.fixture(scope="module")
def bf16():
    """A random model's next-token distribution is nearly flat, so cache drift moves no sampled token; a
    sharper head (logits x 30) lets it, as in a trained model."""
    model = tiny_llama(torch.bfloat16)
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    return model


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_transplants_follow_their_donor_bitwise_and_a_cache_into_its_own_pass_changes_nothing(bf16, tmp_path, decode):
    reqs = continuation_requests(bf16, tmp_path, decode)
    engine = hf_engine(bf16, Tokenizer(), decode=decode)
    exact = outputs(engine.run_batch(reqs, "decode_kv", SAMPLING))
    refeed = outputs(engine.run_batch(reqs, "refeed_ids", SAMPLING))
    assert sum(e[3] != r[3] for e, r in zip(exact, refeed)) > 10  # the caches do differ here
    if decode == "dynamic":  # and move sampled tokens (measured: 2 of 112 rows at 12 tokens)
        assert sum(e[0] != r[0] for e, r in zip(exact, refeed)) > 0
    # the decode-time KV in refeed's path reproduces exact; the re-fed KV in exact's path reproduces refeed
    assert outputs(engine.run_batch(reqs, PASSES["transplant_decode"].source, SAMPLING)) == exact
    assert outputs(engine.run_batch(reqs, PASSES["transplant_refeed"].source, SAMPLING)) == refeed
    # controls: a pass's own cache swapped in (every layer, or none) is the pass itself
    for kind, own in (("decode_kv", exact), ("refeed_ids", refeed)):
        assert outputs(engine.run_batch(reqs, PrefixSource(kind, donor=kind), SAMPLING)) == own
    assert outputs(engine.run_batch(reqs, pass_spec("transplant_refeed_lo0").source, SAMPLING)) == exact
    assert outputs(engine.run_batch(reqs, pass_spec("transplant_refeed_hi0").source, SAMPLING)) == refeed
    assert outputs(engine.run_batch(reqs, pass_spec("transplant_refeed_lo2").source, SAMPLING)) == refeed


def test_a_layer_range_swaps_those_layers_alone(bf16, tmp_path):
    """The drift from the decode-time KV of a per-layer transplant is exactly zero outside the swapped layers
    and the re-feed's inside them; a range beyond the model's layers is refused by number."""
    reqs = continuation_requests(bf16, tmp_path, "dynamic")[::2]
    engine = hf_engine(bf16, Tokenizer(), decode="dynamic")
    refeed = [s.kv_maxdiff for s in engine.prefix_states(reqs, "refeed_ids")]
    lower = [s.kv_maxdiff for s in engine.prefix_states(reqs, pass_spec("transplant_refeed_lo1").source)]
    upper = [s.kv_maxdiff for s in engine.prefix_states(reqs, pass_spec("transplant_refeed_hi1").source)]
    assert any(d[1] > 0 for d in refeed)  # (layer 0's KV is a per-token function of the embedding: equal)
    assert all(lo == [r[0], 0.0] and hi == [0.0, r[1]] for lo, hi, r in zip(lower, upper, refeed))
    states = engine.prefix_states(reqs, pass_spec("transplant_refeed_lo1").source)
    assert all(s.cached is None and s.restep_match is None for s in states)  # not the decode-time state
    with pytest.raises(ValueError, match=r"layers \[0, 3\) are outside this model's 2 layers"):
        engine.prefix_states(reqs, pass_spec("transplant_refeed_lo3").source)


def test_precision_arms_compute_the_prefix_or_the_continuation_in_float32(bf16, tmp_path):
    reqs = continuation_requests(bf16, tmp_path, "dynamic")
    engine = hf_engine(bf16, Tokenizer(), decode="dynamic")
    refeed = engine.prefix_states(reqs, "refeed_ids")
    fp32 = engine.prefix_states(reqs, PASSES["refeed_fp32"].source)
    assert all(s.kv.dtype == torch.bfloat16 for s in fp32)  # cast back to the model's dtype
    assert any(not torch.equal(a.kv, b.kv) for a, b in zip(refeed, fp32))
    assert all(s.kv_maxdiff is not None for s in fp32)
    exact = outputs(engine.run_batch(reqs, "decode_kv", SAMPLING))
    exact32 = outputs(engine.run_batch(reqs, PASSES["exact_fp32cont"].source, SAMPLING))
    assert any(a[2] != b[2] for a, b in zip(exact, exact32))  # first-step log-probs computed in float32
    assert next(engine.model.parameters()).dtype == torch.bfloat16  # the engine's own model is untouched

    # on a float32 model the float32 arms are the passes themselves, bit for bit
    model32 = tiny_llama(torch.float32)
    reqs32 = continuation_requests(model32, tmp_path / "fp32", "dynamic")
    engine32 = hf_engine(model32, Tokenizer(), decode="dynamic")
    assert outputs(engine32.run_batch(reqs32, PASSES["exact_fp32cont"].source, SAMPLING)) == outputs(
        engine32.run_batch(reqs32, "decode_kv", SAMPLING)
    )
    assert outputs(engine32.run_batch(reqs32, PASSES["refeed_fp32"].source, SAMPLING)) == outputs(
        engine32.run_batch(reqs32, "refeed_ids", SAMPLING)
    )


def test_control_passes_borrow_the_schedule_of_the_pass_they_vary():
    assert schedule_of("transplant_decode") == schedule_of("refeed_fp32") == "refeed"
    assert schedule_of("transplant_refeed") == schedule_of("transplant_refeed_hi12") == "exact"
    assert schedule_of("replica") == "replica"
    assert continuations.schedule_seed(1, "c", schedule_of("transplant_refeed")) == continuations.schedule_seed(
        1, "c", "exact"
    )
    with pytest.raises(ValueError, match="unknown pass 'transplant_exact'"):
        pass_spec("transplant_exact")
    with pytest.raises(ValueError, match="refeed_text re-tokenizes"):
        PrefixSource("refeed_text", donor="decode_kv")


def _config(passes, engine="hf"):
    return {"configs": {"c": {"model": "smollm2-135m", "engine": engine}}, "replay": {"passes": passes}}


def test_the_configuration_refuses_controls_it_cannot_run_by_name():
    validate_config(_config(["exact", "replica", "refeed", "transplant_refeed_lo8", "refeed_fp32"]))
    with pytest.raises(ConfigError, match=r"configs\.c\.engine: vllm .*\['transplant_decode'\]"):
        validate_config(_config(["exact", "replica", "refeed", "transplant_decode"], engine="vllm"))
    with pytest.raises(ConfigError, match="'refeed_fp32cont' is compared with 'exact_fp32cont'"):
        validate_config(_config(["exact", "replica", "refeed", "refeed_fp32cont"]))
    with pytest.raises(ConfigError, match="replay.passes"):
        validate_config(_config(["exact", "replica", "refeed", "transplant_sideways"]))


def _pass_rows(tokens: dict[str, list[int]]) -> pl.DataFrame:
    base = {c: None for c in replay.PASS_SCHEMA}
    return pl.DataFrame(
        [
            base
            | {
                "pivot_id": pivot,
                "problem_id": pivot[0],
                "branch": "orig",
                "k": 0,
                "token_ids": ids,
                "next_topk_ids": [ids[0]],
                "next_topk_logprobs": [-1.0],
                "kv_maxdiff": [0.0, 0.5],
            }
            for pivot, ids in tokens.items()
        ],
        schema=replay.PASS_SCHEMA,
    )


def test_the_transplant_summary_says_whom_a_continuation_follows_where_donor_and_recipient_differ():
    exact = _pass_rows({"a1": [1], "a2": [2], "b1": [3], "b2": [4]})
    refeed = _pass_rows({"a1": [1], "a2": [9], "b1": [8], "b2": [7]})  # differs from exact on 3 rows
    moved = _pass_rows({"a1": [1], "a2": [2], "b1": [3], "b2": [7]})  # follows exact (the donor) on 2 of 3
    out = controls.transplant_summary(
        {"exact": exact, "refeed": refeed, "transplant_decode": moved}, {}, n_boot=200, seed=1, ci=0.95
    )
    tokens = out["transplant_decode"]["channels"]["token_ids"]
    assert out["transplant_decode"]["donor"] == "exact" and out["transplant_decode"]["n_layers"] == 2
    assert tokens["donor_and_recipient_differ"] == 3
    assert tokens["with_donor"]["estimate"] == 0.75 and tokens["with_recipient"]["estimate"] == 0.5
    assert tokens["follows_donor_where_they_differ"]["n_same"] == 2
    assert tokens["follows_recipient_where_they_differ"]["n_same"] == 1
    assert "a_hat" not in out["transplant_decode"]["channels"]  # no credit frames given


# --------------------------------------------------------------------- the paper's two missing controls


def test_the_floors_table_is_planned_only_where_refeed_replica_or_serial_runs():
    from replaynoise.plan import control_outputs

    assert "floors" not in control_outputs(["exact", "replica", "refeed", "replica_fresh"])["tables"]
    assert control_outputs(["exact", "replica", "refeed", "serial"])["tables"] == ["floors"]
    assert control_outputs(["exact", "replica", "refeed", "refeed_replica", "refeed_fp32"])["tables"] == [
        "controls",
        "floors",
    ]


def test_the_floors_table_sets_each_floor_against_the_pass_it_replicates(tmp_path):
    from replaynoise.report.controls import floor_rows, write_floors_table

    def stat(est, n):
        return {"estimate": est, "ci_lo": est / 2, "ci_hi": est * 2, "n_disagree": n}

    block = {
        "available": True,
        "n": 40,
        "n_problems": 9,
        "disagreement": {"exact_vs_replica": stat(0.1, 4), "exact_vs_refeed": stat(0.3, 12)},
        "other_passes": {
            "refeed_replica": {"n": 40, "n_problems": 9, "vs_exact": stat(0.25, 10), "vs_refeed": stat(0.05, 2)},
            "serial": {"n": 12, "n_problems": 5, "vs_exact": stat(0.0, 0), "vs_refeed": stat(0.5, 6)},
        },
    }
    results = {"c": {"conditionings": {"main": block, "none": {"available": False}}}}
    rows = floor_rows(results)
    got = {r["pass"]: (r["compared_with"], r["disagreement"], r["n"]) for r in rows.iter_rows(named=True)}
    assert got == {
        "replica": ("exact", 0.1, 40),
        "refeed": ("exact", 0.3, 40),
        "refeed_replica": ("refeed", 0.05, 40),
        "serial": ("exact", 0.0, 12),
    }
    write_floors_table(results, "h", tmp_path / "f.csv", tmp_path / "f.md")
    md = (tmp_path / "f.md").read_text()
    assert "| c | main | refeed_replica | refeed | 40 (9) | 5.0 [2.5, 10.0] | 2 |" in md
    assert pl.read_csv(tmp_path / "f.csv", comment_prefix="#").height == 4


def test_a_pivot_sample_depends_on_the_seed_alone():
    pivots = pl.DataFrame({"pivot_id": [f"p{i:02d}" for i in range(30)], "t": list(range(30))})
    a, b = continuations.pivot_sample(pivots, 7, 11), continuations.pivot_sample(pivots.reverse(), 7, 11)
    assert a.height == 7 and sorted(a["pivot_id"]) == sorted(b["pivot_id"])
    assert sorted(continuations.pivot_sample(pivots, 7, 12)["pivot_id"]) != sorted(a["pivot_id"])
    assert continuations.pivot_sample(pivots, 50, 11).equals(pivots)


def test_the_new_controls_run_on_every_engine_and_replicate_the_right_pass():
    assert pass_spec("refeed_replica").source.plain and pass_spec("serial").source.plain  # vLLM can run them
    assert pass_spec("refeed_replica").reference == "refeed" and pass_spec("serial").reference == "exact"
    assert pass_spec("refeed_replica").source.label != pass_spec("refeed").source.label
    assert schedule_of("refeed_replica") == "refeed_replica" and pass_spec("serial").batch_rows == 1
    config = {
        "configs": {"v": {"model": "smollm2-135m", "engine": "vllm"}},
        "replay": {"passes": ["exact", "replica", "refeed", "refeed_replica", "serial"]},
    }
    assert validate_config(config)["replay"]["serial_pivots"] == 50
