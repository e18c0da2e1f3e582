"""The HF engine's prefix states and the KV layouts they move through: a pivot's state, the stored decode-time
KV kept on the device for a pass, a cache transplant, and the padded and bucketed batch layouts.

Kept apart from the engine (``engine.py``), which decides which state a pass builds and decodes from it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from replaynoise.engines.base import ContinuationRequest
from replaynoise.engines.hf.kvfiles import KVLayers, parse_kv, read_kv_bytes, stack_layers

#: threads that serialise, hash and write (or read and hash) stored KV files while the main thread goes on:
#: hashing and file I/O release the GIL
IO_THREADS = 8
#: rows of a batch whose re-fed KV is compared with the stored KV at once (``StoredKV.drift``)
DRIFT_ROWS = 64


@dataclass
class PrefixState:
    """The KV of one pivot's prefix (batch 1) and what we know about how faithful it is."""

    #: per-layer (k, v), or None where ``kv`` holds them all (``per_layer`` gives the views)
    layers: KVLayers | None
    length: int
    #: the state is the decode-time state (decode_kv: the recorded file, computed from these ids); re-feed: True
    verified: bool
    kv_maxdiff: list[float] | None
    #: prefix positions taken from stored KV (decode_kv: all of them; a re-feed prefills all: 0)
    cached: int | None = 0
    expected: int | None = None
    restep_match: bool | None = None
    #: the same KV stacked, [layers, 2, 1, kv_heads, length, head_dim] (None where layers differ in shape):
    #: batches are assembled with one copy per row instead of one per row and layer
    kv: torch.Tensor | None = None
    #: a built prefix's tokens' log-probs from its own prefill (``ContinuationResult.prefix_logprobs``)
    token_logprobs: list[float] | None = None

    def per_layer(self) -> KVLayers:
        return self.layers if self.layers is not None else [(kv[0], kv[1]) for kv in self.kv]

    def stacked(self) -> torch.Tensor:
        """The KV as one [layers, 2, 1, kv_heads, length, head_dim] tensor (what the invariant decoder loads)."""
        return self.kv if self.kv is not None else stack_layers(self.per_layer())


class StoredKV:
    """The rollouts' stored KV files, loaded (and their checksums checked) once and kept on the device for a
    pass within a byte budget, least recently used first out: a pivot's rows are spread over many batches by the
    schedule, and loading is exact, so keeping them changes no number."""

    def __init__(self, device: torch.device, budget: int) -> None:
        self.device, self.budget = device, budget
        self._files: OrderedDict[str, tuple[tuple[KVLayers, list[int] | None, torch.Tensor | None], int]] = (
            OrderedDict()
        )

    def clear(self) -> None:
        self._files.clear()

    def load_ahead(self, requests: list[ContinuationRequest]) -> None:
        """Read (and hash) the batch's stored KV files not yet on the device, in parallel threads, a few at a
        time (at most ``IO_THREADS`` files' bytes in host memory at once) and no more than the device budget
        holds (the rest load one by one as their states are built)."""
        missing = list({req.kv_file: req.kv_sha256 for req in requests if req.kv_file not in self._files}.items())
        room, ahead = self.budget, []
        for item in missing:
            room -= os.path.getsize(item[0]) if os.path.exists(item[0]) else 0
            if room < 0:
                break
            ahead.append(item)
        if not ahead:
            return
        with ThreadPoolExecutor(IO_THREADS) as pool:
            for start in range(0, len(ahead), IO_THREADS):
                chunk = ahead[start : start + IO_THREADS]
                for (kv_file, _), data in zip(chunk, pool.map(lambda item: read_kv_bytes(*item), chunk)):
                    self.get(kv_file, data=data)

    @staticmethod
    def _remember(cache: OrderedDict, key, value, nbytes: int, budget: int) -> None:
        """Keep ``value`` in a least-recently-used cache bounded by bytes (at least the newest entry stays)."""
        cache[key] = (value, nbytes)
        total = sum(size for _, size in cache.values())
        while total > budget and len(cache) > 1:
            _, (_, size) = cache.popitem(last=False)
            total -= size

    def get(
        self, kv_file: str, expected_sha256: str | None = None, data: bytes | None = None
    ) -> tuple[KVLayers, list[int] | None, torch.Tensor | None]:
        """A rollout's stored KV (per layer, the ids it was computed from, and stacked where the layers allow),
        loaded (and its checksum checked) once, then kept on the device for the pass. ``data``: the file's bytes,
        already read and checked."""
        if kv_file not in self._files:
            if data is None:
                data = read_kv_bytes(kv_file, expected_sha256)
            layers, ids, stacked = parse_kv(data, kv_file, device=self.device)
            nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
            self._remember(self._files, kv_file, (layers, ids, stacked), nbytes, self.budget)
        self._files.move_to_end(kv_file)
        return self._files[kv_file][0]

    def drift(
        self, requests: list[ContinuationRequest], states: list[PrefixState], whole: torch.Tensor | None = None
    ) -> list[PrefixState]:
        """Record in each state how far its KV is from the stored decode-time KV of the same prefix (max |dKV| per
        layer), where both are at hand.

        ``whole``: the states' KV as one left-padded tensor [layers, 2, rows, kv_heads, longest, head_dim], row i
        state i, padding zero (a batched prefill). Then the stored KV is laid out alike, ``DRIFT_ROWS`` rows at a
        time, and compared in three kernels per chunk instead of five per state: a re-feed pass measures every
        pivot of every batch (about 690 per batch of 1,024 rows), and kernels per state would add host time to
        every batch. That time is saved where the GPU is not the bound; where the GPU is busy through the
        prefills, it is hidden behind them."""
        stored = [self._stored_prefix(req, state) for req, state in zip(requests, states)]
        diffs: list[torch.Tensor | None] = [None] * len(states)
        if whole is None:
            for i, (state, ref) in enumerate(zip(states, stored)):
                if ref is not None:
                    diffs[i] = (state.kv - ref).abs().flatten(1).amax(-1).float()  # per layer
        else:
            longest = whole.shape[-2]
            for start in range(0, len(states), DRIFT_ROWS):
                rows = [i for i in range(start, min(start + DRIFT_ROWS, len(states))) if stored[i] is not None]
                if not rows:
                    continue
                part = whole[:, :, start : start + DRIFT_ROWS]
                ref = torch.zeros_like(part)
                for i in rows:
                    ref[:, :, i - start, :, longest - states[i].length :] = stored[i][:, :, 0]
                per_row = (part - ref).abs_().amax(dim=(1, 3, 4, 5)).float().T  # [rows, layers]; padding: 0 - 0
                for i in rows:
                    diffs[i] = per_row[i - start]
        measured = [i for i, d in enumerate(diffs) if d is not None]
        if measured:  # one host copy for all
            for i, values in zip(measured, torch.stack([diffs[i] for i in measured]).tolist()):
                states[i].kv_maxdiff = values
        return states

    def _stored_prefix(self, req: ContinuationRequest, state: PrefixState) -> torch.Tensor | None:
        """The stored decode-time KV of ``state``'s prefix, stacked, where there is one to compare with."""
        if req.kv_file is None or state.kv is None or state.length != len(req.prefix_ids):
            return None
        stored = self.get(req.kv_file, req.kv_sha256)[2]
        if stored is None or stored.shape[-2] < state.length:
            return None
        return stored[..., : state.length, :]


def transplant(
    req: ContinuationRequest, mine: PrefixState, theirs: PrefixState, layers: tuple[int, int | None]
) -> PrefixState:
    """``mine`` with the KV of layers [lo, hi) replaced by ``theirs`` (the same prefix, built another way). It is
    the decode-time state only where both parts are verified; no prefix position counts as read from a cache."""
    if mine.kv is None or theirs.kv is None:
        raise ValueError(
            f"pivot {req.pivot_id}: a cache transplant needs every layer's KV in one shape; this "
            "model's layers differ (a sliding-window layer keeps only its window)"
        )
    if mine.length != theirs.length:
        raise ValueError(
            f"pivot {req.pivot_id}: donor and recipient prefixes differ in length ({theirs.length} and {mine.length})"
        )
    n = mine.kv.shape[0]
    lo, hi = layers[0], n if layers[1] is None else layers[1]
    if not 0 <= lo <= hi <= n:
        raise ValueError(f"transplant layers [{lo}, {hi}) are outside this model's {n} layers")
    kv = torch.cat([mine.kv[:lo], theirs.kv[lo:hi], mine.kv[hi:]])
    return PrefixState(None, mine.length, mine.verified and theirs.verified, None, cached=None, expected=None, kv=kv)


def row_bucket(rows: int) -> int:
    """Static decoder rows: the next power of two, so a pass's short last batch shares the full batches'
    decoder (one compilation and graph capture per pass) whenever the batch size is a power of two."""
    return 1 << max(0, rows - 1).bit_length()


def bucket(length: int, step: int = 64) -> int:
    """Static cache lengths rounded up to a multiple of ``step``, so that the batches of a pass share a decoder
    and its captured graph (a batch's longest prefix is nearly the pass's longest). Not coarser: the stock
    decoders' attention (two GEMMs, ``fast.STATIC_ATTENTION``) reads every slot of the buffer, masked or not, at
    every step. (cuDNN's kernel, the previous default, works in tiles: 192 and 256 slots cost it the same.)"""
    return -(-length // step) * step


def left_padded_cache(states: list[PrefixState]) -> tuple[DynamicCache, torch.Tensor]:
    """One cache for rows of different prefix lengths: each row right-aligned, padding masked out."""
    longest = max(s.length for s in states)
    mask = torch.zeros(len(states), longest, dtype=torch.long)
    if all(s.kv is not None for s in states):  # one copy per row into one buffer, views per layer
        first = states[0].kv
        buffer = first.new_zeros(first.shape[0], 2, len(states), first.shape[3], longest, first.shape[5])
        for row, state in enumerate(states):
            buffer[:, :, row, :, longest - state.length :] = state.kv[:, :, 0]
            mask[row, longest - state.length :] = 1
        return DynamicCache(ddp_cache_data=[(buffer[i, 0], buffer[i, 1]) for i in range(buffer.shape[0])]), mask
    layers = []
    per_layer = [state.per_layer() for state in states]
    for layer in range(len(per_layer[0])):
        keys, values = [], []
        for row, state in enumerate(states):
            k, v = per_layer[row][layer]
            pad = longest - state.length
            keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            if layer == 0:
                mask[row, pad:] = 1
        layers.append((torch.cat(keys), torch.cat(values)))
    return DynamicCache(ddp_cache_data=layers), mask


def cache_layers(cache: DynamicCache) -> KVLayers:
    return [(layer.keys, layer.values) for layer in cache.layers]


def left_padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [rows, longest] left-padded with 0, the padding mask and the positions of a batched prefill."""
    longest = max(map(len, seqs))
    ids = torch.zeros(len(seqs), longest, dtype=torch.int64)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, longest - len(seq) :] = torch.tensor(seq)
        mask[row, longest - len(seq) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def zero_padding(cache: DynamicCache, mask: torch.Tensor, device: torch.device) -> None:
    """Padding's KV is masked out, but 0 * NaN would not be: make it zero."""
    padding = (mask == 0).to(device)[:, None, :, None]
    for layer in cache.layers:
        if layer.keys.shape[-2] != padding.shape[2]:
            continue  # a sliding-window layer that kept only its window
        layer.keys.masked_fill_(padding, 0)
        layer.values.masked_fill_(padding, 0)
