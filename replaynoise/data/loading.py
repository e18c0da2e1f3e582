"""What the engines load at run time from a prepared model: its weights (checked against what was recorded when
it was prepared), its tokenizer and its end and stop tokens. Offline, from safetensors only, without remote code.

Apart from ``models``, which prepares the model directory: a job's start-up path never enters the preparation
code, and the preparation records what this module checks (``file_stamp``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from replaynoise.io import check_sha256, read_json


def check_local_model_dir(path: Path) -> None:
    """Fail early, naming what is missing, rather than deep inside transformers."""
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a HF model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path}: no *.safetensors weights (pickle checkpoints are refused)")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ValueError(f"{path}: no tokenizer (tokenizer.json / tokenizer.model / tokenizer_config.json)")


def vocabulary_texts(tokenizer) -> list[str]:
    """The text of every token id on its own, special tokens included (index = id)."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)


def file_stamp(path: Path) -> list[int]:
    """Size, mtime, ctime and inode: any write changes the ctime, which no user call can set back, so an equal
    stamp means the bytes hashed when the model was prepared are still there."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def model_weights_dir(model_dir: Path) -> Path:
    """The directory holding the weights: the prepared directory, or the user's directory it points at. A user's
    weights must be those recorded when the model was prepared: results made with other weights must never be
    extended with these (an edit that kept the file's mtime escapes Snakemake). A file whose stamp is unchanged
    is not hashed again (hashing a 7B model's 15 GB would take most of every job's start-up); any other is, against its
    recorded sha256. ``snakemake verify`` hashes them all."""
    info = read_json(Path(model_dir) / "replaynoise-model.json")
    if info["origin"]["kind"] != "local":
        return Path(model_dir)
    weights = Path(info["origin"]["path"])
    recorded = info["origin"]["weights_sha256"]
    stamps = info["origin"].get("weights_stamp", {})
    found = {p.name: p for p in sorted(weights.glob("*.safetensors"))}
    if set(found) != set(recorded):
        raise ModelChangedError(
            f"{weights}: weights files {sorted(found)} differ from {sorted(recorded)}, recorded "
            f"when {model_dir} was prepared; rerun from prepare_model (snakemake --forcerun "
            f"prepare_model)"
        )
    for name, path in found.items():
        if stamps.get(name) != file_stamp(path):
            check_sha256(
                path,
                recorded[name],
                label=f"{path} (changed since {model_dir} was prepared from it; "
                f"rerun from prepare_model: snakemake --forcerun prepare_model)",
            )
    return weights


class ModelChangedError(ValueError):
    """A local model directory no longer holds the weights its prepared model was made from."""


def load_tokenizer(weights: Path):
    """The tokenizer of a weights directory, offline and without remote code."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(weights, local_files_only=True, trust_remote_code=False)


def eos_token_ids(generation_config, tokenizer) -> set[int]:
    """End-of-sequence ids: the generation config's, plus the tokenizer's (every engine stops on the same set)."""
    ids = generation_config.eos_token_id if generation_config is not None else None
    if ids is None:
        ids = tokenizer.eos_token_id
    ids = {ids} if isinstance(ids, int) else set(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model defines no end-of-sequence token")
    return ids


def stop_token_ids(tokenizer, stops: Sequence[str]) -> set[int]:
    """Every vocabulary token whose own text contains one of ``stops``: the stop set of ``configs.X.stop``.

    Token ids, not text matching, so that every engine stops at the same sampled token without detokenizing, and
    a stop text that arrives inside a longer token (".\\n") stops too. A stop no token contains is refused by
    value: it would silently never stop anything."""
    if not stops:
        return set()
    texts, ids = vocabulary_texts(tokenizer), set()
    for stop in stops:
        holding = {i for i, text in enumerate(texts) if stop in text}
        if not holding:
            raise ValueError(f"configs stop text {stop!r} is in no token of the model's vocabulary")
        ids |= holding
    return ids - set(tokenizer.all_special_ids)


def eos_ids(weights: Path, tokenizer) -> set[int]:
    """``eos_token_ids`` for a weights directory, without loading the model (engines that load it themselves)."""
    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(weights, local_files_only=True)
    except OSError:  # no generation_config.json: the tokenizer's eos alone
        config = None
    return eos_token_ids(config, tokenizer)


def load_model(model_dir: Path, dtype: str, device: str):
    """Load a prepared model offline, from safetensors only, without remote code."""
    return load_weights(model_weights_dir(Path(model_dir)), dtype, device)


def load_weights(weights: Path, dtype: str, device: str):
    """``load_model`` from a weights directory ``model_weights_dir`` has already checked (the engine factory
    times the check apart, and must not make it twice)."""
    import torch
    from transformers import AutoModelForCausalLM

    check_local_model_dir(weights)
    tokenizer = load_tokenizer(weights)
    # Straight onto the device: staging a 7B model's 15 GB through host memory first costs seconds in every job.
    placement = {} if device == "cpu" else {"device_map": device}
    model = AutoModelForCausalLM.from_pretrained(
        weights,
        dtype=getattr(torch, dtype),
        local_files_only=True,
        trust_remote_code=False,
        use_safetensors=True,
        **placement,
    )
    return model.to(device).eval(), tokenizer
