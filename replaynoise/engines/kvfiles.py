"""Stored decode-time KV: one safetensors file per rollout, written in the model's dtype with the token ids it was
computed from, and read back checked against the sha256 recorded at capture. The HF engine writes and reads
them; ``replay.kv_index`` and the benchmarks read them too."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from replaynoise.engines.base import VerificationError
from replaynoise.io import atomic_path

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


def stack_layers(layers: KVLayers) -> torch.Tensor | None:
    """Per-layer KV as one tensor [layers, 2, batch, kv_heads, positions, head_dim]; None where the layers'
    shapes differ (sliding-window layers that keep only their window)."""
    if any(k.shape != layers[0][0].shape or v.shape != k.shape for k, v in layers):
        return None
    return torch.stack([torch.stack((k, v)) for k, v in layers])


def save_kv(layers: KVLayers, keep: int, path: Path, ids: list[int] | None = None) -> str:
    """Store the first ``keep`` positions of a batch-1 cache in its native dtype, with the token ids they were
    computed from; return the file's sha256 (the content digest a resume checks), hashed from the bytes written
    rather than read back."""
    tensors = {}
    for i, (k, v) in enumerate(layers):
        tensors[f"k.{i}"] = k[..., :keep, :].contiguous().cpu()
        tensors[f"v.{i}"] = v[..., :keep, :].contiguous().cpu()
    if ids is not None:
        tensors["ids"] = torch.tensor(ids[:keep], dtype=torch.int64)
    # One metadata key only: safetensors writes metadata in hash-map order, so several keys would make equal
    # caches give different bytes (and different checksums) from run to run.
    data = save(tensors, metadata={"replaynoise-kv": f"format=1;positions={keep}"})
    with atomic_path(path) as tmp:
        Path(tmp).write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def load_kv(path: str | Path, expected_sha256: str | None = None, device: torch.device | str = "cpu") -> KVLayers:
    """Load a stored cache; a file whose checksum or structure is wrong raises an error naming it."""
    return load_kv_file(path, expected_sha256, device)[0]


def load_kv_file(path: str | Path, expected_sha256: str | None = None, device: torch.device | str = "cpu"
                 ) -> tuple[KVLayers, list[int] | None]:
    """A stored cache and the token ids it was computed from (None in files written before ids were stored)."""
    return parse_kv(read_kv_bytes(path, expected_sha256), path, device)[:2]


def read_kv_bytes(path: str | Path, expected_sha256: str | None = None) -> bytes:
    """A stored cache's bytes, read once and checked against the checksum recorded at capture."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise VerificationError(f"{path}: stored KV cannot be read ({exc})") from exc
    if expected_sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_sha256:
            raise VerificationError(
                f"{path}: stored KV is corrupt (sha256 {actual}, recorded {expected_sha256}); "
                "rerun the rollout step for this configuration")
    return data


def parse_kv(data: bytes, path: str | Path, device: torch.device | str = "cpu"
             ) -> tuple[KVLayers, list[int] | None, torch.Tensor | None]:
    """A stored cache from its bytes: per-layer (k, v) on ``device``, the ids, and the layers stacked
    ([layers, 2, 1, kv_heads, positions, head_dim], the per-layer tensors are its views; None where the layers
    differ in shape)."""
    try:
        tensors = load(data)
    except (SafetensorError, OSError, ValueError) as exc:
        raise VerificationError(f"{path}: stored KV cannot be read ({exc})") from exc
    ids = tensors.pop("ids", None)
    n_layers = len(tensors) // 2
    try:
        layers = [(tensors[f"k.{i}"], tensors[f"v.{i}"]) for i in range(n_layers)]
    except KeyError as exc:
        raise VerificationError(f"{path}: stored KV lacks tensor {exc}") from exc
    stacked = stack_layers(layers)  # one host-to-device copy per file where the layers allow it
    if stacked is not None:
        stacked = stacked.to(device)
        layers = [(stacked[i, 0], stacked[i, 1]) for i in range(n_layers)]
    else:
        layers = [(k.to(device), v.to(device)) for k, v in layers]
    return layers, None if ids is None else ids.tolist(), stacked
