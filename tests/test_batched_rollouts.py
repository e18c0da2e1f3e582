"""Batched rollouts with decode-time KV capture, on a tiny random Llama on the CPU.

A batch-1 run and a batched run of the same rollouts differ in the last bits of float32 GEMMs (other kernel
blockings), so the slicing of padded, batched KV is checked where they agree: in float64, whose rounding to
float32 the batch composition does not reach. There, each row's stored KV (rounded to float32) must equal the
batch-1 run's bit for bit; a wrong offset or padding slice would differ by O(1).
"""

from __future__ import annotations

import os
from dataclasses import replace

import polars as pl
import pytest
import torch
from helpers import hf_engine, interior_rows, keep_all
from tinymodel import Tokenizer, tiny_llama

from replaynoise.engines.base import ContinuationRequest, RolloutRequest, SamplingSettings
from replaynoise.engines.hf.kvfiles import load_kv_file
from replaynoise.generation import replay, rollouts
from replaynoise.generation.passes import BRANCHES
from replaynoise.io import keyed_scratch

SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=14)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float64)


def requests() -> list[RolloutRequest]:
    # prompts of different lengths, so every row but the longest is left-padded
    return [RolloutRequest(f"p{i}", tuple(range(1, 4 + 3 * i)), seed=100 + i, rollout=i % 2) for i in range(5)]


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_batched_rollouts_store_each_rows_own_unpadded_kv(model, tmp_path, decode):
    engine = hf_engine(model, Tokenizer(), decode=decode)
    batched = engine.generate_rollouts(requests(), SAMPLING, tmp_path / "batched", keep_all)
    single = [
        hf_engine(model, Tokenizer(), decode=decode).generate_rollouts([req], SAMPLING, tmp_path / "single", keep_all)[
            0
        ]
        for req in requests()
    ]
    assert [r.rollout for r in batched] == [req.rollout for req in requests()]
    for b, s in zip(batched, single):
        assert b.response_ids == s.response_ids and b.logits_digests == s.logits_digests
        assert b.kv_file.endswith(f"{b.problem_id}.r{b.rollout}.safetensors")
        layers_b, ids_b = load_kv_file(b.kv_file, device="cpu")
        layers_s, ids_s = load_kv_file(s.kv_file, device="cpu")
        assert ids_b == ids_s == (b.prompt_ids + b.response_ids)[: b.kv_len]
        for (kb, vb), (ks, vs) in zip(layers_b, layers_s):
            assert kb.shape == ks.shape == (1, 2, b.kv_len, 16)
            assert torch.equal(kb.float(), ks.float()) and torch.equal(vb.float(), vs.float())


def pivot_requests(rollouts) -> list[ContinuationRequest]:
    return interior_rows(rollouts, ks=(0,), seed=lambda t, k: 1, name="{r.problem_id}.r{r.rollout}@{t}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_states_pass_the_gate_and_a_batch1_restep_reproduces_a_batch1_rollout(model, tmp_path, dtype):
    """Where the composition matches (a rollout made alone, re-stepped alone) the re-step reproduces the
    rollout's logits and KV bitwise at every pivot, in float32 as in float64."""
    model = model.to(dtype)
    try:
        for req in requests()[:3]:
            (rollout,) = hf_engine(model, Tokenizer(), decode="dynamic").generate_rollouts(
                [req], SAMPLING, tmp_path, keep_all
            )
            engine = hf_engine(model, Tokenizer(), decode="dynamic")
            states = [engine.prefix_state(r, "decode_kv") for r in pivot_requests([rollout])]
            assert states and all(s.verified and s.restep_match for s in states)
    finally:
        model.to(torch.float64)


def test_restep_of_batched_rollouts_is_a_measured_channel_not_a_gate(model, tmp_path):
    """Rollouts made in a batch, re-stepped all together: the state used is still the decode-time state
    (verified at every pivot), while the re-step reproduces only where the other batch layout happens not to
    reach the last bits (float64 here: most pivots, not all)."""
    made = hf_engine(model, Tokenizer(), decode="dynamic").generate_rollouts(requests(), SAMPLING, tmp_path, keep_all)
    states = hf_engine(model, Tokenizer(), decode="dynamic").prefix_states(pivot_requests(made), "decode_kv")
    assert len(states) > 20 and all(s.verified for s in states)
    assert all(s.restep_match is not None for s in states)
    assert sum(s.restep_match for s in states) > len(states) / 2


def test_probe_rows_fold_into_the_k0_rows_of_their_branch():
    base = {c: None for c in replay.PASS_SCHEMA}
    rows = [
        base | {"pivot_id": "a", "branch": b, "k": k, "token_ids": [1, 2], "next_topk_logprobs": [-0.5]}
        for b in BRANCHES
        for k in (0, 1)
    ]
    probes = [
        base
        | {
            "pivot_id": "a",
            "branch": b,
            "k": replay.PROBE_K,
            "token_ids": [7, 8, 9],
            "next_topk_logprobs": [-0.25 if b == "orig" else -2.0, -3.0],
        }
        for b in BRANCHES
    ]
    shards = [
        pl.DataFrame(rows[:2] + probes[1:], schema=replay.PASS_SCHEMA),
        pl.DataFrame(rows[2:] + probes[:1], schema=replay.PASS_SCHEMA),
    ]
    out = replay.gather(shards)
    assert out.height == 4 and (out["k"] >= 0).all()
    k0 = out.filter(pl.col("k") == 0)
    assert k0["probe_ids"].to_list() == [[7, 8, 9], [7, 8, 9]]
    assert k0["probe_logprob"].to_list() == [-0.25, -2.0]
    assert out.filter(pl.col("k") == 1)["probe_logprob"].null_count() == 2
    assert replay.gather([out]).equals(out)  # gathering again changes nothing


def test_stale_scratch_from_other_settings_is_discarded(tmp_path, capsys):
    work = keyed_scratch(tmp_path / "w", "aaaa")
    (work / "batch_00000.parquet").write_text("made with settings aaaa")
    assert (keyed_scratch(tmp_path / "w", "aaaa") / "batch_00000.parquet").exists()  # same settings: resumed
    work = keyed_scratch(tmp_path / "w", "bbbb")
    assert not (work / "batch_00000.parquet").exists()
    assert "discarding scratch work left by a run with other settings" in capsys.readouterr().err


def test_kv_outputs_are_hard_links_of_the_scratch_files_where_the_file_system_allows(tmp_path, monkeypatch):
    source = tmp_path / "a.safetensors"
    source.write_bytes(b"kv" * 1000)
    rollouts.link_or_copy(str(source), str(tmp_path / "linked"))
    assert (tmp_path / "linked").stat().st_ino == source.stat().st_ino  # no second gigabyte written

    def refuse(*_):
        raise OSError("cross-device link")

    monkeypatch.setattr(os, "link", refuse)
    rollouts.link_or_copy(str(source), str(tmp_path / "copied"))
    copied = tmp_path / "copied"
    assert copied.stat().st_ino != source.stat().st_ino and copied.read_bytes() == source.read_bytes()


def test_a_short_batch_decodes_in_a_shape_of_its_own_whatever_ran_before(model, tmp_path):
    """A resumed pass may start at its short last batch: its static decode must not depend on which decoders
    the process built before (it used to borrow the full batches' rows), or a resume could change numbers."""
    made = hf_engine(model, Tokenizer(), decode="static").generate_rollouts(requests(), SAMPLING, tmp_path, keep_all)
    rows = [replace(r, seed=i) for i, r in enumerate(pivot_requests(made))]
    full, short = rows[:16], rows[16:21]
    warm = hf_engine(model, Tokenizer(), decode="static")
    warm.run_batch(full, "decode_kv", SAMPLING)
    after_full = warm.run_batch(short, "decode_kv", SAMPLING)
    cold = hf_engine(model, Tokenizer(), decode="static")
    alone = cold.run_batch(short, "decode_kv", SAMPLING)
    assert [r.token_ids for r in after_full] == [r.token_ids for r in alone]
    assert [r.next_digest for r in after_full] == [r.next_digest for r in alone]
    assert sorted(rows for _, rows, _, _ in cold.forwards.decoders) == [8]  # 5 rows: the next power of two
