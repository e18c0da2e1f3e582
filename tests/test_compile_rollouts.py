"""``compile_rollouts``: the HF stock static rollout decoder's layers compiled, as the passes' are. It is a setting of
the rollouts' step alone, refused where it would change nothing, and it reaches the rollout decoder and no other;
the rollouts' kept KV goes through one pinned host buffer on a GPU (``PinnedRows``), which leaves CPU tensors as
they are. The compiled step itself runs on a GPU only (tests/test_engine_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import REPO, branch_requests, configuration, hf_engine
from tinymodel import EOS, tiny_llama

from replaynoise.engines.base import RolloutRequest, SamplingSettings
from replaynoise.engines.hf.kvfiles import PinnedRows, load_kv_file, save_kv
from replaynoise.settings import HF_ONLY_KEYS, PASS_ONLY_KEYS, ROLLOUT_ONLY_KEYS, ConfigError, EngineSettings


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float32)


def test_compile_rollouts_is_absent_unless_given_and_refused_where_it_would_change_nothing():
    assert "compile_rollouts" not in configuration()
    assert EngineSettings.of(configuration()).compile_rollouts is False
    given = configuration(device="cuda", compile_rollouts=True)  # auto decodes statically on a GPU
    assert given["compile_rollouts"] is True and EngineSettings.of(given).compile_rollouts is True
    assert configuration(device="cuda", decode="static", compile_rollouts=False)["compile_rollouts"] is False
    for refused in (
        dict(device="cuda", decode="dynamic"),
        dict(device="cuda", kernels="invariant"),
        dict(decode="static"),  # the CPU: nothing is compiled there
        dict(decode="auto"),  # auto decodes dynamically on the CPU
        dict(device="cuda", engine="vllm"),
    ):
        with pytest.raises(ConfigError, match=r"configs\.c\.compile_rollouts"):
            configuration(compile_rollouts=True, **refused)
    with pytest.raises(ConfigError, match="compile_rollouts"):
        configuration(device="cuda", compile_rollouts="yes")


def test_compile_rollouts_belongs_to_the_rollouts_step_alone():
    """The rollouts' step is given it and the passes' steps are not (workflow/rules/common.smk's rollout_settings and
    pass_settings drop PASS_ONLY_KEYS and ROLLOUT_ONLY_KEYS), and another engine refuses it."""
    assert "compile_rollouts" in ROLLOUT_ONLY_KEYS and "compile_rollouts" in HF_ONLY_KEYS
    assert not set(ROLLOUT_ONLY_KEYS) & set(PASS_ONLY_KEYS)
    rules = REPO / "workflow" / "rules"
    assert "if key not in ROLLOUT_ONLY_KEYS" in (rules / "common.smk").read_text()
    for name in ("replay.smk", "analysis.smk"):  # the passes, and cross_score (a pass over another's rollouts)
        text = (rules / name).read_text()
        assert "settings=pass_settings" in text and "settings=settings," not in text, name
    assert "settings=rollout_settings" in (rules / "rollouts.smk").read_text()


def test_the_engine_refuses_it_off_the_stock_static_decoder_and_passes_it_to_the_rollout_decoder(model, tmp_path):
    tok = SimpleNamespace(eos_token_id=EOS)
    for given in (dict(decode="dynamic"), dict(decode="static", kernels="invariant")):
        with pytest.raises(ValueError, match="compile_rollouts"):
            hf_engine(model, tok, compile_rollouts=True, **given)
    requests = [RolloutRequest(f"p{i}", tuple(range(1 + i, 12 + 2 * i)), 7 + i) for i in range(3)]
    sampling, keep = SamplingSettings(1.0, 1.0, 12), (lambda ro: len(ro.prompt_ids) + len(ro.response_ids) - 1)
    out = {}
    for flag in (False, True):
        eng = hf_engine(model, tok, decode="static", graphs=False, compile_rollouts=flag)
        out[flag] = eng.generate_rollouts(requests, sampling, tmp_path / str(flag), keep)
        ((_, rows, _, compiled),) = eng.forwards.decoders
        assert (rows, compiled) == (3, flag)
        # off CUDA the decoder runs eagerly whatever it was asked (the configuration refuses the key there)
        assert not next(iter(eng.forwards.decoders.values())).compiled
        continuations = eng.run_batch(branch_requests(out[flag][0], [2, 5], 2), "decode_kv", sampling)
        assert len(continuations) == 8 and all(c.verified for c in continuations)
        # the passes' decoders are asked for compiled layers whatever the rollouts' setting
        assert [key[3] for key in eng.forwards.decoders if key[1] == 8] == [True]
    for a, b in zip(out[False], out[True]):
        assert a.response_ids == b.response_ids and a.kv_sha256 == b.kv_sha256


def test_pinned_rows_leave_cpu_tensors_as_they_are():
    views = [torch.arange(12.0).view(3, 4)[:, :2], torch.ones(2, 2)]
    assert PinnedRows().copy(views) is views
    assert PinnedRows().copy([]) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_rows_copy_each_view_bitwise_and_reuse_their_buffer(tmp_path):
    kv = torch.randn(4, 2, 3, 2, 50, 8, device="cuda", dtype=torch.bfloat16)
    pinned = PinnedRows()
    views = [kv[:, :, r : r + 1, :, 5 : 5 + 10 * (r + 1)] for r in range(3)]
    hosts = pinned.copy(views)
    assert pinned.buffer is not None and pinned.buffer.is_pinned()
    for view, host in zip(views, hosts):
        assert host.is_contiguous() and torch.equal(host, view.cpu())
    first = pinned.buffer.data_ptr()
    assert torch.equal(pinned.copy(views[:1])[0], views[0].cpu()) and pinned.buffer.data_ptr() == first
    wider = [kv[:, :, r : r + 1] for r in range(3)]
    assert all(torch.equal(h, v.cpu()) for h, v in zip(pinned.copy(wider), wider))
    assert pinned.buffer.numel() == sum(v.numel() for v in wider)
    path = tmp_path / "r.safetensors"
    save_kv(hosts[1], hosts[1].shape[-2], path, ids=list(range(20)))
    layers, ids = load_kv_file(path, device="cpu")
    assert ids == list(range(20)) and torch.equal(layers[0][0], views[1][0, 0].cpu())
