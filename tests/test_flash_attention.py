"""``REPLAYNOISE_STATIC_ATTENTION=fa3``: the static decoders' step attends with FlashAttention 3 over each row's
live slots [first, end), which the decoders keep beside the mask the other attentions read. On the CPU (CI) the
bookkeeping is checked by standing in for the kernel with the ``gemm`` attention over a mask built from [first,
end): a run must then be bit for bit the ``gemm`` run, through left-padded static batches, refilled rows and
parked ones. The kernel itself is checked on a Hopper GPU (``tests/test_engine_gpu.py``)."""

from __future__ import annotations

import pytest
import torch
from helpers import branch_requests, configuration, hf_engine
from tinymodel import VOCAB, Tokenizer, tiny_llama

from replaynoise.engines.base import RolloutRequest, SamplingSettings
from replaynoise.engines.hf import static
from replaynoise.engines.hf.kernels import attend, static_attention
from replaynoise.engines.hf.static import RefillDecoder, StaticDecoder
from replaynoise.settings import HF_ONLY_KEYS, PASS_ONLY_KEYS, ROLLOUT_ONLY_KEYS, ConfigError, EngineSettings

SAMPLING = SamplingSettings(1.0, 1.0, 16)
STOPS = frozenset(range(100, 130))  # one token in ten ends a continuation: refills and parked rows


def ranged_attention(q, keys, values, first, end, scaling):
    """The ``gemm`` attention over the slots [first, end) of each row: what FA3 computes, in the CPU's kernels."""
    rows, kv_heads, slots, dim = keys.shape
    index = torch.arange(slots)
    mask = ((index[None, :] >= first[:, None].long()) & (index[None, :] < end[:, None].long()))[:, None, None, :]
    return attend(q, keys, values, mask, scaling, rows, kv_heads, q.shape[1] // kv_heads, dim)


def run(model, tmp_path, monkeypatch, attention: str, **given):
    """Rollouts of prompts of several lengths (a left-padded static batch), then a pass over their branches."""
    monkeypatch.setenv("REPLAYNOISE_STATIC_ATTENTION", attention)
    eng = hf_engine(model, Tokenizer(), decode="static", **given)
    gen = torch.Generator().manual_seed(4)
    prompts = [tuple(int(t) for t in torch.randint(1, VOCAB - 2, (6 + 5 * i,), generator=gen)) for i in range(3)]
    rollouts = eng.generate_rollouts(
        [RolloutRequest(f"p{i}", p, i) for i, p in enumerate(prompts)],
        SamplingSettings(1.0, 1.0, 20),
        tmp_path / attention,
        lambda ro: len(ro.prompt_ids) + len(ro.response_ids) - 1,
    )
    requests = [q for r in rollouts for q in branch_requests(r, range(1, len(r.response_ids) - 1, 6), k=2)]
    results = eng.run_batch(requests, "decode_kv", SAMPLING)
    decoders = list(eng.forwards.decoders.values())
    return [r.response_ids for r in rollouts], [(x.token_ids, x.next_digest) for x in results], decoders


@pytest.mark.parametrize("given", [{}, {"static_rows": 4, "stop_ids": STOPS}], ids=["left-padded", "refilled"])
def test_the_live_slots_fa3_reads_are_the_slots_the_mask_keeps(tmp_path, monkeypatch, given):
    monkeypatch.setattr(static, "attend_flash", ranged_attention)
    monkeypatch.setattr(static, "fa3_forward", lambda: None)
    model = tiny_llama(torch.float32)
    gemm = run(model, tmp_path, monkeypatch, "gemm", **given)
    fa3 = run(model, tmp_path, monkeypatch, "fa3", **given)
    assert [d.attention for d in fa3[2]] == ["fa3"] * len(fa3[2])
    if given:
        assert any(isinstance(d, RefillDecoder) for d in fa3[2])
    else:  # rows of several prefix lengths: left padding that [first, end) must skip
        assert any(int(d.first.max()) > 0 for d in fa3[2])
    assert fa3[:2] == gemm[:2]


def test_a_wrong_first_slot_would_change_the_run(tmp_path, monkeypatch):
    """The check above can fail: reading the left padding (first taken as 0) changes the tokens."""
    monkeypatch.setattr(
        static, "attend_flash", lambda q, k, v, first, end, s: ranged_attention(q, k, v, 0 * first, end, s)
    )
    monkeypatch.setattr(static, "fa3_forward", lambda: None)
    model = tiny_llama(torch.float32)
    assert run(model, tmp_path, monkeypatch, "fa3")[:2] != run(model, tmp_path, monkeypatch, "gemm")[:2]


def test_fa3_is_refused_by_name_where_it_cannot_run_and_by_the_invariant_decoder(monkeypatch):
    monkeypatch.setenv("REPLAYNOISE_STATIC_ATTENTION", "fa3")
    assert static_attention() == "fa3"
    with pytest.raises(ValueError, match="REPLAYNOISE_STATIC_ATTENTION='fa3': FlashAttention 3 is not verified"):
        static_attention(invariant=True)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("a Hopper GPU here: FA3 can run")
    with pytest.raises(RuntimeError, match="REPLAYNOISE_STATIC_ATTENTION=fa3"):
        StaticDecoder(tiny_llama(torch.float32), 2, 32, graphs=False, attention="fa3")


def test_static_attention_is_a_configuration_key_absent_unless_given_and_refused_where_it_changes_nothing():
    assert "static_attention" not in configuration() and EngineSettings.of(configuration()).static_attention is None
    given = configuration(device="cuda", static_attention="fa3")
    assert EngineSettings.of(given).static_attention == "fa3" and "static_attention" in HF_ONLY_KEYS
    assert not {"static_attention"} & {*PASS_ONLY_KEYS, *ROLLOUT_ONLY_KEYS}  # rollouts and passes both read it
    assert configuration(decode="static", static_attention="sdpa")["static_attention"] == "sdpa"  # a CPU may
    assert "static_attention" not in configuration(decode="static", static_attention="gemm")  # the default
    for refused in (
        dict(device="cuda", decode="dynamic"),
        dict(device="cuda", kernels="invariant"),
        dict(decode="static"),  # fa3 on the CPU
        dict(device="cuda", engine="vllm"),
    ):
        with pytest.raises(ConfigError, match=r"configs\.c\.static_attention"):
            configuration(static_attention="fa3", **refused)
    with pytest.raises(ConfigError, match="static_attention"):
        configuration(device="cuda", static_attention="flash")
    # PyTorch's memory-efficient kernel has no CPU form: refused there by name, not deep inside a step
    with pytest.raises(ConfigError, match="static_attention: efficient is a GPU kernel"):
        configuration(decode="static", static_attention="efficient")
    assert configuration(device="cuda", static_attention="efficient")["static_attention"] == "efficient"


def test_the_configuration_chooses_the_decoders_attention_and_a_disagreeing_variable_is_refused(monkeypatch):
    model = tiny_llama(torch.float32)
    monkeypatch.delenv("REPLAYNOISE_STATIC_ATTENTION", raising=False)
    eng = hf_engine(model, Tokenizer(), decode="static", static_attention="sdpa")
    assert eng.forwards.decoder(2, 32).attention == "sdpa"
    assert hf_engine(model, Tokenizer(), decode="static").forwards.decoder(2, 32).attention == "gemm"
    with pytest.raises(ValueError, match="static_attention sdpa: chooses the attention of"):
        hf_engine(model, Tokenizer(), decode="dynamic", static_attention="sdpa")
    monkeypatch.setenv("REPLAYNOISE_STATIC_ATTENTION", "sdpa")
    assert hf_engine(model, Tokenizer(), decode="static", static_attention="sdpa").forwards.attention == "sdpa"
    with pytest.raises(ValueError, match="REPLAYNOISE_STATIC_ATTENTION='sdpa' and the configuration's"):
        hf_engine(model, Tokenizer(), decode="static", static_attention="gemm")
