"""Stored decode-time KV: one safetensors file per rollout, written in the model's dtype with the token ids it was
computed from, and read back checked against the sha256 recorded at capture. The HF engine writes and reads
them; ``continuations.kv_index`` and the benchmarks read them too."""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from replaynoise.engines.base import VerificationError
from replaynoise.io import atomic_path

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


def stack_layers(layers: KVLayers) -> torch.Tensor | None:
    """Per-layer KV as one tensor [layers, 2, batch, kv_heads, positions, head_dim]; None where the layers'
    shapes differ (sliding-window layers that keep only their window)."""
    if any(k.shape != layers[0][0].shape or v.shape != k.shape for k, v in layers):
        return None
    return torch.stack([torch.stack((k, v)) for k, v in layers])


#: safetensors' names of the dtypes a cache is stored in
_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


def save_kv(layers: KVLayers | torch.Tensor, keep: int, path: Path, ids: list[int] | None = None) -> str:
    """Store the first ``keep`` positions of a batch-1 cache in its native dtype, with the token ids they were
    computed from; return the file's sha256 (the content digest a resume checks), hashed from the bytes written
    rather than read back.

    ``layers``: per-layer (k, v), or one stacked tensor [layers, 2, 1, kv_heads, positions, head_dim]. The file
    is safetensors with one tensor per layer and kind (``k.0``, ``v.0``, ``k.1``, ...), its data laid out layer
    after layer, so that the whole cache is one contiguous block: written from one copy of the row, and read
    back as one view (``parse_kv``) instead of a copy per tensor and another to stack them (with a copy per
    tensor, storing is a large share of a small model's rollout loop)."""
    stacked = (
        layers
        if isinstance(layers, torch.Tensor)
        else stack_layers([(k[..., :keep, :], v[..., :keep, :]) for k, v in layers])
    )
    if stacked is not None:
        stacked = stacked[..., :keep, :]
        blocks = [stacked.contiguous().cpu()]
        shapes = [list(stacked.shape[2:])] * (2 * stacked.shape[0])
    else:  # layers of different shapes (sliding windows): a block per tensor
        blocks = [t[..., :keep, :].contiguous().cpu() for pair in layers for t in pair]
        shapes = [list(b.shape) for b in blocks]
    dtype = _DTYPES[blocks[0].dtype]
    header: dict = {}
    start = 0
    for i, shape in enumerate(shapes):
        size = blocks[0].element_size() * math.prod(shape)
        header[f"{'kv'[i % 2]}.{i // 2}"] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + size]}
        start += size
    if ids is not None:
        blocks.append(torch.tensor(ids[:keep], dtype=torch.int64))
        n_ids = len(ids[:keep])
        header["ids"] = {"dtype": "I64", "shape": [n_ids], "data_offsets": [start, start + 8 * n_ids]}
    # One metadata key only, and keys in a fixed order: equal caches must give equal bytes (the manifest and
    # the recorded checksum compare files by their bytes).
    header = {"__metadata__": {"replaynoise-kv": f"format=1;positions={keep}"}, **header}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    parts = [struct.pack("<Q", len(text)), text] + [memoryview(b.view(-1).view(torch.uint8).numpy()) for b in blocks]
    digest = hashlib.sha256()
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        for part in parts:
            fh.write(part)
            digest.update(part)
    return digest.hexdigest()


class PinnedRows:
    """Rows' kept KV copied from the GPU into one page-locked host buffer, allocated once per engine and grown as
    needed: the copies run back to back at the link's speed, with no pageable bounce and no device-side copy per
    file, and the files are then written from host memory. Pinning is paid once per job, not per batch (a
    batch's files are written before the next batch copies over them). Tensors off the GPU pass through."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def copy(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        if not views or views[0].device.type != "cuda":
            return views
        total, dtype = sum(v.numel() for v in views), views[0].dtype
        if self.buffer is None or self.buffer.dtype != dtype or self.buffer.numel() < total:
            self.buffer = None  # the old one freed before a larger one is pinned
            self.buffer = torch.empty(total, dtype=dtype, pin_memory=True)
        out, start = [], 0
        for view in views:
            host = self.buffer[start : start + view.numel()].view(view.shape)
            host.copy_(view, non_blocking=True)
            out.append(host)
            start += view.numel()
        torch.cuda.current_stream(views[0].device).synchronize()
        return out


def load_kv(path: str | Path, expected_sha256: str | None = None, *, device: torch.device | str) -> KVLayers:
    """Load a stored cache; a file whose checksum or structure is wrong raises an error naming it."""
    return load_kv_file(path, expected_sha256, device=device)[0]


def load_kv_file(
    path: str | Path, expected_sha256: str | None = None, *, device: torch.device | str
) -> tuple[KVLayers, list[int] | None]:
    """A stored cache and the token ids it was computed from (None in files written before ids were stored)."""
    return parse_kv(read_kv_bytes(path, expected_sha256), path, device)[:2]


def read_kv_bytes(path: str | Path, expected_sha256: str | None = None) -> bytearray:
    """A stored cache's bytes, read once and checked against the checksum recorded at capture."""
    try:
        with open(path, "rb") as fh:  # into a writable buffer: the cache is then a view of it (no copy)
            data = bytearray(os.fstat(fh.fileno()).st_size)
            fh.readinto(data)
    except OSError as exc:
        raise VerificationError(f"{path}: stored KV cannot be read ({exc})") from exc
    if expected_sha256 is not None:
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected_sha256:
            raise VerificationError(
                f"{path}: stored KV is corrupt (sha256 {actual}, recorded {expected_sha256}); "
                "rerun the rollout step for this configuration"
            )
    return data


def parse_kv(
    data: bytes | bytearray, path: str | Path, device: torch.device | str
) -> tuple[KVLayers, list[int] | None, torch.Tensor | None]:
    """A stored cache from its bytes: per-layer (k, v) on ``device``, the ids, and the layers stacked
    ([layers, 2, 1, kv_heads, positions, head_dim], the per-layer tensors are its views; None where the layers
    differ in shape)."""
    stacked = _stacked_view(data)
    if stacked is not None:  # the layout save_kv writes: one view of the bytes, one copy to the device
        stacked, ids = stacked
        stacked = stacked.to(device)
        return [(stacked[i, 0], stacked[i, 1]) for i in range(stacked.shape[0])], ids, stacked
    try:
        tensors = load(bytes(data))
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


def _stacked_view(data: bytes | bytearray) -> tuple[torch.Tensor, list[int] | None] | None:
    """The cache of a file in ``save_kv``'s layout, as one [layers, 2, 1, kv_heads, positions, head_dim] view of
    ``data`` (no copy), and its ids; None for any other layout (files of earlier versions, sliding-window layers,
    anything malformed), which the safetensors reader then parses or rejects."""
    try:
        return _stacked_layout(data)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, RuntimeError):
        return None


def _stacked_layout(data: bytes | bytearray) -> tuple[torch.Tensor, list[int] | None] | None:
    (size,) = struct.unpack_from("<Q", data)
    header = json.loads(bytes(data[8 : 8 + size]))
    header.pop("__metadata__", None)
    ids = header.pop("ids", None)
    n = len(header) // 2
    if not n or len(header) != 2 * n:
        return None
    entries = [header[f"{kind}.{i}"] for i in range(n) for kind in "kv"]
    first = entries[0]
    if first["dtype"] not in _TORCH_DTYPES or any(
        e["dtype"] != first["dtype"] or e["shape"] != first["shape"] for e in entries
    ):
        return None
    dtype = _TORCH_DTYPES[first["dtype"]]
    nbytes = dtype.itemsize * math.prod(first["shape"])
    if [e["data_offsets"] for e in entries] != [[i * nbytes, (i + 1) * nbytes] for i in range(2 * n)]:
        return None
    base, cache_end = 8 + size, 8 + size + 2 * n * nbytes
    end = cache_end if ids is None else cache_end + 8 * ids["shape"][0]
    if ids is not None and (ids["dtype"] != "I64" or ids["data_offsets"] != [2 * n * nbytes, end - base]):
        return None
    if end != len(data):
        return None
    buffer = memoryview(data)
    kv = torch.frombuffer(buffer[base:cache_end], dtype=torch.uint8).view(dtype).view(n, 2, *first["shape"])
    return kv, None if ids is None else torch.frombuffer(buffer[cache_end:end], dtype=torch.int64).tolist()
