"""Model preparation: packaged GGUFs (sha256-pinned), local HF directories, and refusals."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import shutil

import pytest

from conftest import PACKAGES
from replaynoise.models import PACKAGED_MODELS, assemble_gguf, check_local_model_dir, load_model, prepare_model
from replaynoise.provenance import ChecksumError, sha256_file

pytestmark = pytest.mark.slow


def test_packaged_model_prepares_offline_with_chat_template(smollm2_dir):
    info = json.loads((smollm2_dir / "replaynoise-model.json").read_text())
    assert info["origin"]["gguf_sha256"] == PACKAGED_MODELS["smollm2-135m"].gguf_sha256
    assert list(smollm2_dir.glob("*.safetensors")) and not list(smollm2_dir.glob("*.bin"))
    model, tokenizer = load_model(smollm2_dir, "bfloat16")
    assert model.config.num_hidden_layers == 30
    assert "<|im_start|>" in tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False)


def test_conversion_parses_the_gguf_once_and_restores_the_gguf_module(smollm2_dir, tmp_path, monkeypatch):
    import gguf

    made = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            made.append(args)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    name_map = gguf.get_tensor_name_map
    prepare_model("smollm2-135m", "bfloat16", tmp_path / "again", PACKAGES)
    assert len(made) == 1  # tokenizer, config and weights share one parse (three without the cache)
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is name_map
    same = [(p.name, p.read_bytes() == (tmp_path / "again" / p.name).read_bytes()) for p in smollm2_dir.iterdir()]
    assert all(equal for _, equal in same), same


def test_gguf_with_a_wrong_checksum_is_refused_by_name(tmp_path):
    good = PACKAGED_MODELS["smollm2-135m"]
    bad = dataclasses.replace(good, gguf_sha256="0" * 64)
    shutil.copytree(PACKAGES / "wheels", tmp_path / "wheels")  # no second download
    with pytest.raises(ChecksumError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        assemble_gguf(bad, tmp_path)


def test_two_jobs_assembling_one_gguf_at_once_both_get_the_pinned_file(tmp_path):
    """Both dtypes of one model are prepared by parallel jobs; one used to check the other's half-written GGUF
    (checksum mismatch on the H200 run of issue 20)."""
    model = PACKAGED_MODELS["smollm2-135m"]
    shutil.copytree(PACKAGES / "wheels", tmp_path / "wheels", ignore=shutil.ignore_patterns("gemma*", "pandas*"))
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        done = list(pool.map(assemble_gguf, [model] * 2, [tmp_path] * 2))
    target = tmp_path / model.gguf_name
    assert done == [target] * 2 and sha256_file(target) == model.gguf_sha256
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_local_directory_is_used_as_is_and_fingerprinted(smollm2_dir, tmp_path):
    info = prepare_model(str(smollm2_dir), "bfloat16", tmp_path / "local", tmp_path / "cache")
    assert info["origin"]["kind"] == "local"
    assert set(info["origin"]["weights_sha256"]) == {p.name for p in smollm2_dir.glob("*.safetensors")}
    model, _ = load_model(tmp_path / "local", "bfloat16")
    assert model.config.num_hidden_layers == 30


def test_directory_without_tokenizer_or_safetensors_is_refused(smollm2_dir, tmp_path):
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for p in smollm2_dir.glob("*"):
        if "token" not in p.name and "chat_template" not in p.name:
            shutil.copy(p, no_tok / p.name)
    with pytest.raises(ValueError, match="no tokenizer"):
        check_local_model_dir(no_tok)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(smollm2_dir / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle checkpoints are refused"):
        prepare_model(str(pickled), "bfloat16", tmp_path / "out", tmp_path / "cache")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_gemma_base_model_prepares_and_resumes_bitwise(tmp_path):
    """The second packaged model: a base model (no chat template) with sliding-window layers."""
    from replaynoise.engines.base import ContinuationRequest, RolloutRequest, SamplingSettings
    from replaynoise.engines.hf import HFEngine
    from replaynoise.rollouts import prompt_ids

    out = tmp_path / "gemma"
    prepare_model("gemma3-270m", "bfloat16", out, PACKAGES)
    model, tokenizer = load_model(out, "bfloat16")
    assert not tokenizer.chat_template
    engine = HFEngine(model, tokenizer)
    ids = prompt_ids(tokenizer, "Tom has 3 apples and buys 4 more. How many apples does he have?", "plain", "")
    (rollout,) = engine.generate_rollouts([RolloutRequest("g", tuple(ids), 3)], SamplingSettings(0.7, 1.0, 12),
                                          tmp_path / "kv", lambda r: len(r.prompt_ids) + len(r.response_ids) - 1)
    assert len(rollout.response_ids) >= 2
    for t in range(1, len(rollout.response_ids)):
        req = ContinuationRequest(f"g@{t}", "orig", 0, 1, tuple(ids + rollout.response_ids[:t]),
                                  rollout.response_ids[t], rollout.kv_file, rollout.kv_sha256,
                                  rollout.logits_digests[t])
        assert engine.prefix_state(req, "decode_kv").verified, f"position {t}"
