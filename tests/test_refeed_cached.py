"""The cached re-feed (``refeed_cached``), on a tiny random Llama on the CPU: the prompt's KV is a prefill of the
prompt alone, as a prefix cache serves it, and only the response is computed over it; under invariant kernels it is
the decode-time state bit for bit, and the serving engines refuse it by name."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_engine, interior_rows, keep_all
from test_engine_sglang import sglang_config
from tinymodel import Tokenizer, tiny_llama

from replaynoise.config import ConfigError, validate_config
from replaynoise.engines.base import PrefixSource, RolloutRequest, SamplingSettings
from replaynoise.generation.passes import PASSES, canonical_order, schedule_of

SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=12)
CACHED = PASSES["refeed_cached"].source


def requests(model, tmp_path, **options):
    """Rows at every interior position of three batched rollouts of different prompt lengths, each knowing where
    its response starts."""
    made = hf_engine(model, Tokenizer(), **options).generate_rollouts(
        [RolloutRequest(f"p{i}", tuple(range(1, 5 + 3 * i)), seed=10 + i) for i in range(3)],
        SamplingSettings(1.0, 1.0, 10),
        tmp_path,
        keep_all,
    )
    return interior_rows(made, response_start=lambda r, t, k: len(r.prompt_ids))


def test_the_prompt_comes_from_its_own_prefill_and_the_tail_is_computed_over_it(tmp_path):
    """Float32: the prompt's positions are a prompt-alone prefill bit for bit, the whole prefix matches a cold
    one-shot prefill to float32 rounding (they differ only in how the sums are split), and so do the tokens' log-probs
    the two prefills give; a pivot's state built in a batch is the state it gets alone."""
    model = tiny_llama(torch.float32)
    reqs = requests(model, tmp_path, decode="dynamic")
    engine = hf_engine(model, Tokenizer(), decode="dynamic")
    cached = engine.prefix_states(reqs, CACHED)
    cold = engine.prefix_states(reqs, "refeed_ids")
    alone = [engine.prefix_state(req, CACHED) for req in reqs]
    for req, mine, theirs, single in zip(reqs, cached, cold, alone):
        n = req.response_start
        prompt, *_ = engine.forwards.batched_states([list(req.prefix_ids[:n])], [None])
        assert torch.equal(mine.kv[..., :n, :], prompt[0])
        assert mine.length == theirs.length == len(req.prefix_ids) and mine.cached == n and theirs.cached == 0
        assert torch.allclose(mine.kv, theirs.kv, atol=1e-5)
        assert torch.allclose(mine.kv, single.kv, atol=1e-5)
        assert mine.token_logprobs == pytest.approx(theirs.token_logprobs, abs=1e-4)
        assert len(mine.token_logprobs) == len(req.prefix_ids) - n
    results = engine.run_batch(reqs, CACHED, SAMPLING)
    assert [r.cached_tokens for r in results] == [req.response_start for req in reqs]


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_the_cached_refeed_decodes_as_the_refeed_does(tmp_path, decode):
    """bf16, both stock decoders: every row decodes from its cached state in the re-feed's way (the same seeds,
    branch tokens and lengths), and where the states agree so do the rows."""
    model = tiny_llama(torch.bfloat16)
    reqs = requests(model, tmp_path, decode=decode)
    engine = hf_engine(model, Tokenizer(), decode=decode)
    cached = engine.run_batch(reqs, CACHED, SAMPLING)
    refeed = engine.run_batch(reqs, "refeed_ids", SAMPLING)
    assert len(cached) == len(refeed) == len(reqs)
    assert all(c.prefix_len == r.prefix_len and c.verified for c, r in zip(cached, refeed))
    states = zip(engine.prefix_states(reqs, CACHED), engine.prefix_states(reqs, "refeed_ids"))
    for (mine, theirs), c, r in zip(states, cached, refeed):
        if torch.equal(mine.kv, theirs.kv):
            assert (c.token_ids, c.next_digest) == (r.token_ids, r.next_digest)


def test_under_invariant_kernels_the_cached_refeed_is_the_decode_time_state(tmp_path):
    """Every position computed alone: a prompt served from an earlier prefill holds the decode step's bits, so the
    cached re-feed's rows are exact's."""
    model = tiny_llama(torch.bfloat16)
    reqs = requests(model, tmp_path, kernels="invariant")
    engine = hf_engine(model, Tokenizer(), kernels="invariant")
    exact = engine.run_batch(reqs, "decode_kv", SAMPLING)
    cached = engine.run_batch(reqs, CACHED, SAMPLING)
    assert [(r.token_ids, r.next_digest) for r in cached] == [(r.token_ids, r.next_digest) for r in exact]


def test_the_pass_is_a_refeed_in_the_refeeds_batches_and_optional():
    assert schedule_of("refeed_cached") == "refeed" and CACHED.label == "refeed_ids+prompt:cached"
    assert canonical_order(["refeed_cached", "refeed", "replica", "exact"]) == [
        "exact",
        "replica",
        "refeed",
        "refeed_cached",
    ]
    with pytest.raises(ValueError, match="prompt_cached"):
        PrefixSource("decode_kv", prompt_cached=True)
    with pytest.raises(ValueError, match="prompt_cached"):
        PrefixSource("refeed_text", prompt_cached=True)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_serving_engines_refuse_it_by_key(engine):
    config = sglang_config()
    if engine == "vllm":
        config["configs"]["s"] = {"model": "smollm2-135m", "engine": "vllm", "kernels": "stock", "device": "cpu"}
    config["replay"] = {**config.get("replay", {}), "passes": ["exact", "replica", "refeed", "refeed_cached"]}
    with pytest.raises(ConfigError, match=rf"engine: {engine} keeps its KV.*\['refeed_cached'\].*HF engine only"):
        validate_config(config)
