"""Batched batch-invariant decode (kernels: invariant with static decode), on a tiny random Llama on the CPU.

Under invariant execution every pass must reproduce every other bit for bit: a row's numbers may depend on its
own tokens only, not on its batch-mates, its row index, how many rows the batch has, or whether its prefix was
re-fed or resumed from the decode-time KV. bf16 is where stock batching moves the last bits most (the control
below shows it does here), so that is where the invariant decoder is held to it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import hf_engine, interior_rows, keep_all
from tinymodel import Tokenizer, tiny_llama

from replaynoise.config import ConfigError, validate_config
from replaynoise.engines.base import ContinuationRequest, RolloutRequest, SamplingSettings
from replaynoise.engines.hf.engine import HFEngine
from replaynoise.engines.hf.kvfiles import load_kv_file

ROLLOUT = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=14)
CONTINUE = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=10)
SHAPE = dict(invariant_rows=4, invariant_context=64)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.bfloat16)


def engine(model, kernels="invariant") -> HFEngine:
    return hf_engine(model, Tokenizer(), kernels=kernels, decode="static", **SHAPE)


def requests() -> list[RolloutRequest]:
    # prompts of different lengths (1 to 19 tokens), more requests than the decoder has rows
    return [RolloutRequest(f"p{i}", tuple(range(1, 2 + 3 * i)), seed=100 + i, rollout=i % 2) for i in range(7)]


def continuation_rows(rollouts) -> list[ContinuationRequest]:
    """Two rows (other seeds) at every interior position of every rollout: a pivot's rows share its prefix."""
    return interior_rows(rollouts, name="{r.problem_id}.r{r.rollout}@{t}")


def channels(results) -> list[tuple]:
    return [(r.token_ids, r.next_topk_ids, r.next_topk_logprobs, r.next_digest) for r in results]


def run(eng: HFEngine, rows: list[ContinuationRequest], source: str, batch: int) -> dict:
    """The rows in batches of ``batch``, results by (pivot, k)."""
    out = {}
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        for req, res in zip(chunk, eng.run_batch(chunk, source, CONTINUE)):
            out[(req.pivot_id, req.k)] = res
    return out


@pytest.fixture(scope="module")
def made(model, tmp_path_factory):
    return engine(model).generate_rollouts(requests(), ROLLOUT, tmp_path_factory.mktemp("kv"), keep_all)


def test_invariant_rollouts_do_not_depend_on_their_batch(model, made, tmp_path):
    alone = [engine(model).generate_rollouts([req], ROLLOUT, tmp_path, keep_all)[0] for req in requests()[::-1]]
    for a, b in zip(made, alone[::-1]):
        assert a.response_ids == b.response_ids and a.logits_digests == b.logits_digests
        layers_a, ids_a = load_kv_file(a.kv_file, device="cpu")
        layers_b, ids_b = load_kv_file(b.kv_file, device="cpu")
        assert ids_a == ids_b == (a.prompt_ids + a.response_ids)[: a.kv_len]
        assert all(torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(layers_a, layers_b))


def test_exact_replica_and_refeed_agree_bitwise_on_every_channel(model, made):
    rows = continuation_rows(made)
    assert len(rows) > 60
    exact = run(engine(model), rows, "decode_kv", batch=6)
    # the replica: other batch-mates, other row slots, other batch sizes (and several decoder chunks per batch)
    replica = run(engine(model), rows[::-1], "decode_kv", batch=11)
    refeed = run(engine(model), rows[3:] + rows[:3], "refeed_ids", batch=9)
    keys = sorted(exact)
    assert channels(exact[k] for k in keys) == channels(replica[k] for k in keys) == channels(refeed[k] for k in keys)
    assert all(r.verified for r in exact.values())
    assert all(r.kv_maxdiff is not None and max(r.kv_maxdiff) == 0.0 for r in refeed.values())
    # the re-step probe reproduces the rollout's logits and KV at every pivot: the rollout ran in the same shape
    probed = [r for r in exact.values() if r.restep_match is not None]
    assert probed and all(r.restep_match for r in probed)


def test_stock_batching_does_move_these_numbers(model, made):
    """The control: the same rows under stock kernels (left-padded prefill, shapes by batch) differ from the
    invariant decode's exact pass, so the test above can fail."""
    rows = continuation_rows(made)
    stock = hf_engine(model, Tokenizer(), kernels="stock", decode="static")
    refeed = run(stock, rows, "refeed_ids", batch=16)
    exact = run(engine(model), rows, "decode_kv", batch=16)
    keys = sorted(exact)
    assert channels(refeed[k] for k in keys) != channels(exact[k] for k in keys)
    assert any(max(r.kv_maxdiff) > 0 for r in refeed.values())


def test_a_prefix_that_does_not_fit_the_invariant_shape_is_refused_by_name(model, made):
    row = continuation_rows(made)[0]
    long = replace(row, prefix_ids=tuple(range(1, 60)), kv_file=None)
    with pytest.raises(ValueError, match="invariant_context"):
        engine(model).run_batch([long], "refeed_ids", CONTINUE)


def test_an_invariant_configuration_gets_its_one_decoder_shape_filled_in():
    config = validate_config(
        {
            "configs": {
                "inv": {"model": "smollm2-135m", "kernels": "invariant", "device": "cuda", "max_new_tokens": 100},
                "cpu": {"model": "smollm2-135m", "kernels": "invariant"},
                "static": {"model": "smollm2-135m", "kernels": "invariant", "decode": "static"},
                "stock": {"model": "smollm2-135m", "device": "cuda"},
            },
            "replay": {"max_new_tokens": 200},
        }
    )
    assert config["configs"]["inv"]["invariant_rows"] == 64
    assert config["configs"]["inv"]["invariant_context"] == 1024  # 100 + 200 + 512, rounded up to 256
    assert config["configs"]["static"]["invariant_context"] == 768  # 40 + 200 + 512
    # decoded dynamically (auto on a CPU) or stock: nothing added, so their analysis hash stays what it was
    assert "invariant_rows" not in config["configs"]["cpu"] and "invariant_rows" not in config["configs"]["stock"]
    given = validate_config(
        {
            "configs": {
                "inv": {
                    "model": "smollm2-135m",
                    "kernels": "invariant",
                    "device": "cuda",
                    "invariant_rows": 8,
                    "invariant_context": 320,
                }
            }
        }
    )
    assert (given["configs"]["inv"]["invariant_rows"], given["configs"]["inv"]["invariant_context"]) == (8, 320)
    with pytest.raises(ConfigError, match="configs.inv.invariant_context: 256 slots"):
        validate_config(
            {
                "configs": {
                    "inv": {
                        "model": "smollm2-135m",
                        "kernels": "invariant",
                        "decode": "static",
                        "max_new_tokens": 200,
                        "invariant_context": 256,
                    }
                },
                "replay": {"max_new_tokens": 100},
            }
        )
    with pytest.raises(ConfigError, match="invariant_rows"):
        validate_config({"configs": {"inv": {"model": "smollm2-135m", "kernels": "invariant", "invariant_rows": 0}}})


def test_prefill_refuses_more_rows_than_the_shape_or_an_empty_prefix_by_name(model):
    decoder = engine(model).mode.decoder()
    with pytest.raises(ValueError, match="1 to 4 non-empty"):
        decoder.prefill([[1, 2]] * 5)
    with pytest.raises(ValueError, match="1 to 4 non-empty"):
        decoder.prefill([[1, 2], []])


def test_the_invariant_decoder_keeps_the_attention_its_identity_was_verified_with(model, monkeypatch):
    """Stock static decoders attend with two GEMMs (faster on an H200); the invariant decoder keeps sdpa, with
    which its bitwise identity was verified on the GPU, unless the run's variable says otherwise."""
    monkeypatch.delenv("REPLAYNOISE_STATIC_ATTENTION", raising=False)
    assert engine(model, "stock").forwards.decoder(4, 64).attention == "gemm"
    assert engine(model).mode.decoder().attention == "sdpa"
    monkeypatch.setenv("REPLAYNOISE_STATIC_ATTENTION", "gemm")
    assert engine(model).mode.decoder().attention == "gemm"
