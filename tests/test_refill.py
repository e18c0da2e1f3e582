"""The refilled static decoder (``static_rows``): a replay batch of more continuations than the decoder has rows
runs through it, each row taking the next waiting continuation when its own has ended. Each continuation must come
out as HF's own decode gives it, whatever row and step it ran in, and a batch's numbers must not depend on the
batches the process ran before it (a resumed pass would differ from an uninterrupted one)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import branch_requests, configuration, hf_engine
from transformers import LlamaConfig, LlamaForCausalLM

from replaynoise.engines.base import RolloutRequest, SamplingSettings
from replaynoise.engines.hf.static import RefillDecoder
from replaynoise.settings import ConfigError

VOCAB = 512
#: one token in twenty ends a continuation, so that continuations end at many different steps, some at their budget
STOPS = frozenset(range(100, 126))
SAMPLING = SamplingSettings(1.0, 1.0, 40)


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """A random Llama, one stored rollout and 60 continuation requests from its prefixes (both branches, K = 3)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            eos_token_id=VOCAB - 1,
        )
    ).eval()
    tok = SimpleNamespace(eos_token_id=VOCAB - 1)
    (r,) = hf_engine(model, tok, decode="dynamic").generate_rollouts(
        [RolloutRequest("p", tuple(range(1, 30)), 5)],
        SamplingSettings(1.0, 1.0, 24),
        tmp_path_factory.mktemp("kv"),
        lambda ro: len(ro.prompt_ids) + len(ro.response_ids) - 1,
    )
    assert len(r.response_ids) == 24
    requests = branch_requests(r, range(2, 22, 2), k=3)
    return model, tok, requests


def refilled(model, tok, rows=4):
    return hf_engine(model, tok, decode="static", static_rows=rows, stop_ids=STOPS)


def test_each_refilled_continuation_is_what_hfs_own_decode_gives(batch):
    model, tok, requests = batch
    dynamic, static = hf_engine(model, tok, decode="dynamic", stop_ids=STOPS), refilled(model, tok)
    a, b = dynamic.run_batch(requests, "decode_kv", SAMPLING), static.run_batch(requests, "decode_kv", SAMPLING)
    (decoder,) = static.forwards.decoders.values()
    assert isinstance(decoder, RefillDecoder) and decoder.rows == 4 < len(requests)
    ends = {x.finish_reason for x in a}
    assert ends == {"eos", "length"}, ends  # rows ended at their stop tokens and at their budget
    assert all(x.verified for x in b)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    assert [x.finish_reason for x in a] == [y.finish_reason for y in b]
    for x, y in zip(a, b):
        assert x.next_topk_ids == y.next_topk_ids  # the digests hash the logits' bits, which other kernels move
        assert max(abs(u - v) for u, v in zip(x.next_topk_logprobs, y.next_topk_logprobs)) < 1e-4


def test_a_refilled_batch_does_not_depend_on_the_batches_before_it(batch):
    model, tok, requests = batch
    after = refilled(model, tok)
    after.run_batch(requests[30:], "decode_kv", SAMPLING)  # leaves its KV, masks and positions in the decoder
    alone = refilled(model, tok).run_batch(requests[:30], "decode_kv", SAMPLING)
    assert after.run_batch(requests[:30], "decode_kv", SAMPLING) == alone


def test_a_batch_no_larger_than_static_rows_decodes_as_without_it(batch):
    model, tok, requests = batch
    plain = hf_engine(model, tok, decode="static", stop_ids=STOPS).run_batch(requests[:4], "decode_kv", SAMPLING)
    static = refilled(model, tok)
    assert static.run_batch(requests[:4], "decode_kv", SAMPLING) == plain
    assert not any(isinstance(d, RefillDecoder) for d in static.forwards.decoders.values())


def test_a_short_budget_frees_its_rows_at_every_step_it_ends(batch):
    """A one-token continuation (cross-scoring, a short probe) holds its row for one step, not a 16-step window."""
    model, tok, requests = batch
    one = SamplingSettings(1.0, 1.0, 1)
    static = refilled(model, tok)
    got = static.run_batch(requests, "decode_kv", one)
    want = hf_engine(model, tok, decode="dynamic", stop_ids=STOPS).run_batch(requests, "decode_kv", one)
    assert [x.token_ids for x in got] == [y.token_ids for y in want] and all(len(x.token_ids) == 1 for x in got)
    assert static.phases.steps["decode"] == len(requests) // 4  # 60 continuations, 4 rows, one step each


def test_static_rows_bounds_an_unrefilled_batch_too(batch):
    """A batch of no more continuations than static_rows runs in at most that many rows (not the next power of
    two), and an engine whose decode is not the stock static one refuses the setting."""
    model, tok, requests = batch
    static = refilled(model, tok, rows=6)
    static.run_batch(requests[:5], "decode_kv", SAMPLING)
    assert [d.rows for d in static.forwards.decoders.values()] == [6]
    for given in (dict(decode="dynamic"), dict(decode="auto"), dict(decode="static", kernels="invariant")):
        with pytest.raises(ValueError, match="static_rows 4"):
            hf_engine(model, tok, static_rows=4, **given)


def test_static_rows_is_absent_unless_given_and_refused_where_it_would_change_nothing():
    assert "static_rows" not in configuration()
    assert configuration(decode="static", static_rows=256)["static_rows"] == 256
    assert configuration(device="cuda", static_rows=256)["static_rows"] == 256  # auto decodes statically on a GPU
    for given in (
        dict(decode="dynamic", device="cuda"),
        dict(decode="auto"),  # auto decodes dynamically on the CPU
        dict(decode="static", kernels="invariant"),
        dict(engine="vllm"),
    ):
        with pytest.raises(ConfigError, match=r"configs\.c\.static_rows"):
            configuration(static_rows=8, **given)
    with pytest.raises(ConfigError, match=r"configs\.c\.static_rows"):
        configuration(decode="static", static_rows=0)
