"""The HF transformers engine: the reference engine, on CPU or GPU.

Two kernel modes:
- ``stock``: the prompt is prefilled in one forward, continuation rows from many pivots share padded batches
  and finished rows leave the batch, as in a serving engine. Batch composition then moves the numbers.
- ``invariant``: every forward computes one token of one row, prompt included, so no result can depend on
  batching or on prefill versus decode: all passes must agree bitwise.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from replaynoise.engines.base import (
    ContinuationRequest, ContinuationResult, KeepLen, Rollout, RolloutRequest, SamplingSettings,
    VerificationError,
)
from replaynoise.engines.fast import StaticDecoder, static_decode_supported, use_fp32_matmul
from replaynoise.engines.sampling import RowSampler, logits_digest, sample_rows, topk_logprobs
from replaynoise.models import eos_token_ids
from replaynoise.provenance import atomic_path, sha256_file

log = logging.getLogger(__name__)

KERNEL_MODES = ("stock", "invariant")
#: ``dynamic``: HF forward with a DynamicCache, finished rows leave the batch; ``static``: preallocated KV and, on
#: CUDA, one captured graph per step with on-device sampling (rows stay until every row has finished);
#: ``auto``: static on CUDA for the model families it supports, dynamic otherwise.
DECODE_MODES = ("auto", "dynamic", "static")
#: On CPU, half-precision linear layers as float32 GEMMs (``fp32``) or with torch's own kernel (``native``).
CPU_MATMULS = ("fp32", "native")

KVLayers = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PrefixState:
    """The KV of one pivot's prefix (batch 1) and what we know about how faithful it is."""

    layers: KVLayers
    length: int
    verified: bool
    kv_maxdiff: list[float] | None
    #: prefix positions taken from stored KV (decode_kv: all of them; a re-feed prefills all: 0)
    cached: int = 0
    expected: int | None = None


class HFEngine:
    name = "hf"

    def __init__(self, model, tokenizer, *, kernels: str = "stock", topk: int = 5,
                 prefix_cache_size: int = 512, decode: str = "auto", cpu_matmul: str = "fp32") -> None:
        if kernels not in KERNEL_MODES:
            raise ValueError(f"kernels must be one of {KERNEL_MODES}, got {kernels!r}")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        if cpu_matmul not in CPU_MATMULS:
            raise ValueError(f"cpu_matmul must be one of {CPU_MATMULS}, got {cpu_matmul!r}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        if self.device.type == "cpu" and cpu_matmul == "fp32":
            use_fp32_matmul(self.model)
        self.invariant = kernels == "invariant"
        if decode == "auto":
            decode = "static" if self.device.type == "cuda" and static_decode_supported(model) else "dynamic"
        if decode == "static" and not static_decode_supported(model):
            raise ValueError(f"decode: static does not support model type {model.config.model_type!r}")
        self.static = decode == "static" and not self.invariant
        self._decoders: OrderedDict[tuple[int, int], StaticDecoder] = OrderedDict()
        self._graphs = True  # CUDA graphs for the static decode (tests turn them off to compare)
        self.attention = os.environ.get("REPLAYNOISE_STATIC_ATTENTION", "sdpa")  # sdpa | efficient | gemm
        self.topk = topk
        self.eos_ids = eos_token_ids(model.generation_config, tokenizer)
        self._states: OrderedDict[tuple, PrefixState] = OrderedDict()
        self._files: OrderedDict[str, KVLayers] = OrderedDict()
        self._state_cache_size = prefix_cache_size

    # ----------------------------------------------------------------------------------------- forwards
    @torch.inference_mode()
    def _step(self, ids: torch.Tensor, cache: DynamicCache, **kwargs) -> torch.Tensor:
        """One forward; returns float32 logits of the last position of every row, on the CPU, where sampling
        noise, digests and top-k are computed whatever the device."""
        out = self.model(input_ids=ids.to(self.device), past_key_values=cache, use_cache=True,
                         logits_to_keep=1, **kwargs)
        return out.logits[:, -1, :].to(torch.float32).cpu()

    def _prefill(self, ids: list[int]) -> tuple[DynamicCache, torch.Tensor]:
        """KV and last logits of a prompt: one forward in stock mode, one forward per token in invariant mode."""
        cache = DynamicCache()
        if self.invariant:
            logits = None
            for tok in ids:
                logits = self._step(torch.tensor([[tok]]), cache)
        else:
            logits = self._step(torch.tensor([ids]), cache)
        return cache, logits[0]

    # ----------------------------------------------------------------------------------------- rollouts
    def generate_rollouts(self, requests: list[RolloutRequest], sampling: SamplingSettings, kv_dir: Path,
                          keep_len: KeepLen) -> list[Rollout]:
        rollouts = []
        for req in requests:
            rollout, cache = self._generate_one(req, sampling)
            keep = min(keep_len(rollout), cache.get_seq_length())
            if keep > 0:
                path = Path(kv_dir) / f"{req.problem_id}.safetensors"
                rollout.kv_sha256 = save_kv(cache_layers(cache), keep, path)
                rollout.kv_file, rollout.kv_len = str(path), keep
            rollouts.append(rollout)
        return rollouts

    def _generate_one(self, req: RolloutRequest, sampling: SamplingSettings) -> tuple[Rollout, DynamicCache]:
        sampler = RowSampler(req.seed, sampling.temperature, sampling.top_p)
        cache, logits = self._prefill(list(req.prompt_ids))
        response, top_ids, top_lps, digests = [], [], [], []
        finish = "length"
        for step in range(sampling.max_new_tokens):
            ids, lps = topk_logprobs(logits, self.topk)
            top_ids.append(ids)
            top_lps.append(lps)
            digests.append(logits_digest(logits))
            token = sampler.sample(logits)
            response.append(token)
            if token in self.eos_ids:
                finish = "eos"
                break
            if step + 1 < sampling.max_new_tokens:
                logits = self._step(torch.tensor([[token]]), cache)[0]
        rollout = Rollout(req.problem_id, list(req.prompt_ids), response, top_ids, top_lps, digests, finish)
        return rollout, cache

    # ----------------------------------------------------------------------------------------- prefix states
    def prefix_state(self, req: ContinuationRequest, source: str) -> PrefixState:
        key = (req.pivot_id, source)
        if key in self._states:
            self._states.move_to_end(key)
            return self._states[key]
        if source == "decode_kv":
            state = self._decode_state(req)
        elif source == "refeed_ids":
            state = self._refeed_state(req, list(req.prefix_ids))
        elif source == "refeed_text":
            state = self._refeed_state(req, list(req.text_prefix_ids or req.prefix_ids))
        else:
            raise ValueError(f"unknown prefix source {source!r}")
        self._states[key] = state
        if len(self._states) > self._state_cache_size:
            self._states.popitem(last=False)
        return state

    def _stored_layers(self, kv_file: str, expected_sha256: str | None = None) -> KVLayers:
        if kv_file not in self._files:
            self._files[kv_file] = load_kv(kv_file, expected_sha256, device=self.device)
            if len(self._files) > 8:
                self._files.popitem(last=False)
        return self._files[kv_file]

    def _decode_state(self, req: ContinuationRequest) -> PrefixState:
        """Crop the stored decode-time KV to the pivot and check it reproduces the rollout's step bitwise."""
        if req.kv_file is None:
            raise VerificationError(f"pivot {req.pivot_id}: no stored KV to resume from")
        stored = self._stored_layers(req.kv_file, req.kv_sha256)
        length = len(req.prefix_ids)
        if stored[0][0].shape[-2] < length:
            raise VerificationError(
                f"{req.kv_file}: holds {stored[0][0].shape[-2]} positions, pivot {req.pivot_id} needs {length}")
        layers = [(k[..., :length, :], v[..., :length, :]) for k, v in stored]
        # Replay the last prefix step over the first length-1 positions: logits and the new KV must match.
        probe = DynamicCache(ddp_cache_data=[(k[..., :-1, :].clone(), v[..., :-1, :].clone()) for k, v in layers])
        logits = self._step(torch.tensor([[req.prefix_ids[-1]]]), probe)[0]
        same_logits = logits_digest(logits) == req.expected_digest
        same_kv = all(torch.equal(pk[..., -1:, :], k[..., -1:, :]) and torch.equal(pv[..., -1:, :], v[..., -1:, :])
                      for (pk, pv), (k, v) in zip(cache_layers(probe), layers))
        if not (same_logits and same_kv):
            log.warning("pivot %s: stored KV in %s does not reproduce the rollout (logits %s, kv %s)",
                        req.pivot_id, req.kv_file, same_logits, same_kv)
        return PrefixState(layers, length, same_logits and same_kv, None, cached=length, expected=length)

    def _refeed_state(self, req: ContinuationRequest, ids: list[int]) -> PrefixState:
        """Recompute the prefix as a fresh prompt; where the decode KV is stored, record how far it moved."""
        cache, _ = self._prefill(ids)
        layers = cache_layers(cache)
        maxdiff = None
        if req.kv_file is not None and len(ids) == len(req.prefix_ids):
            stored = self._stored_layers(req.kv_file, req.kv_sha256)
            if stored[0][0].shape[-2] >= len(ids):
                maxdiff = [max(float((k - sk[..., :len(ids), :]).abs().max()),
                               float((v - sv[..., :len(ids), :]).abs().max()))
                           for (k, v), (sk, sv) in zip(layers, stored)]
        return PrefixState(layers, len(ids), True, maxdiff)

    # ----------------------------------------------------------------------------------------- continuations
    def run_batch(self, requests: list[ContinuationRequest], source: str,
                  sampling: SamplingSettings) -> list[ContinuationResult]:
        states = [self.prefix_state(req, source) for req in requests]
        if self.invariant:
            return [self._continue(reqs, sts, sampling)[0] for reqs, sts in
                    (([r], [s]) for r, s in zip(requests, states))]
        if self.static:
            return self._continue_static(requests, states, sampling)
        return self._continue(requests, states, sampling)

    def _continue(self, requests: list[ContinuationRequest], states: list[PrefixState],
                  sampling: SamplingSettings) -> list[ContinuationResult]:
        """Decode all rows together from their prefix states; finished rows leave the batch."""
        n = len(requests)
        cache, mask = _left_padded_cache(states)
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64)
        positions = torch.tensor([s.length for s in states])
        tokens = torch.tensor([r.branch_token for r in requests])
        active = list(range(n))  # original row index of every row still in the batch
        generated: list[list[int]] = [[] for _ in range(n)]
        finish = ["length"] * n
        first: list[tuple] = [None] * n
        for step in range(sampling.max_new_tokens):
            mask = torch.cat([mask, torch.ones(len(active), 1, dtype=mask.dtype)], dim=1)
            kwargs = {} if self.invariant else {
                "attention_mask": mask.to(self.device), "position_ids": positions[:, None].to(self.device)}
            logits = self._step(tokens[:, None], cache, **kwargs)
            keep = []
            sampled = sample_rows(logits, seeds[active], torch.full((len(active),), step, dtype=torch.int64),
                                  sampling.temperature, sampling.top_p).tolist()
            for slot, row in enumerate(active):
                if step == 0:
                    first[row] = self._first_step(logits[slot])
                token = sampled[slot]
                generated[row].append(token)
                if token in self.eos_ids:
                    finish[row] = "eos"
                else:
                    keep.append(slot)
            if not keep or step + 1 == sampling.max_new_tokens:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep)
                cache.batch_select_indices(index.to(self.device))
                mask, positions = mask[index], positions[index]
                active = [active[i] for i in keep]
            tokens = torch.tensor([generated[row][-1] for row in active])
            positions = positions + 1
        return [ContinuationResult(generated[i], finish[i], states[i].verified, states[i].length,
                                   first[i][0], first[i][1], first[i][2], states[i].kv_maxdiff,
                                   cached_tokens=states[i].cached, expected_cached_tokens=states[i].expected)
                for i in range(n)]

    def _first_step(self, logits: torch.Tensor) -> tuple[list[int], list[float], str]:
        """Top-k and digest of a row's first continuation step (float32 logits on the CPU)."""
        return (*topk_logprobs(logits, self.topk), logits_digest(logits))

    def _decoder(self, rows: int, length: int) -> StaticDecoder:
        key = (rows, length)
        if key not in self._decoders:
            if len(self._decoders) >= 2:
                self._decoders.popitem(last=False)
                torch.cuda.empty_cache() if self.device.type == "cuda" else None
            self._decoders[key] = StaticDecoder(self.model, rows, length, graphs=self._graphs,
                                                attention=self.attention)
        self._decoders.move_to_end(key)
        return self._decoders[key]

    def _continue_static(self, requests: list[ContinuationRequest], states: list[PrefixState],
                         sampling: SamplingSettings) -> list[ContinuationResult]:
        """Decode all rows together in a static cache (one graph replay per step); a row's tokens after its
        end-of-sequence token are dropped. Checks for all-finished only every few steps (each check syncs)."""
        n, steps = len(requests), sampling.max_new_tokens
        unique: dict[int, int] = {}
        for state in states:
            unique.setdefault(id(state), len(unique))
        ordered = list({id(s): s for s in states}.values())
        longest = max(s.length for s in states)
        length = -(-(longest + steps + 1) // 64) * 64  # bucketed, so batches of a pass share one graph
        decoder = self._decoder(n, length)
        decoder.load([s.layers for s in ordered], [s.length for s in ordered], [unique[id(s)] for s in states],
                     [r.seed for r in requests], [r.branch_token for r in requests],
                     (sampling.temperature, sampling.top_p))
        out = torch.empty(n, steps, dtype=torch.int64, device=self.device)
        eos = torch.tensor(sorted(self.eos_ids), device=self.device)
        firsts = None
        for step in range(steps):
            logits, tokens = decoder.step()
            if step == 0:
                firsts = self._first_steps(logits, decoder.host_buffer(logits.shape[-1]))  # hashed during decode
            out[:, step] = tokens
            if step + 1 == steps:
                break
            if step % 16 == 15 and bool(torch.isin(out[:, :step + 1], eos).any(dim=1).all()):
                break
        out = out[:, :step + 1].cpu().tolist()
        top_ids, top_lps, digests = firsts()
        results = []
        for i, (row, s) in enumerate(zip(out, states)):
            end = next((j for j, t in enumerate(row) if t in self.eos_ids), None)
            tokens_i, finish = (row[:end + 1], "eos") if end is not None else (row, "length")
            results.append(ContinuationResult(tokens_i, finish, s.verified, s.length, top_ids[i], top_lps[i],
                                              digests[i], s.kv_maxdiff, cached_tokens=s.cached,
                                              expected_cached_tokens=s.expected))
        return results

    def _first_steps(self, logits: torch.Tensor, host: torch.Tensor):
        """Top-k (on the device) and digests (blake2b of the float32 bits, on the CPU, in threads that run while
        the decode continues) of every row's first continuation step; returns a function that collects them."""
        logits = logits.to(torch.float32)
        values, ids = torch.topk(torch.log_softmax(logits, dim=-1), self.topk, dim=-1)
        host.copy_(logits, non_blocking=True)
        ready = torch.cuda.Event() if self.device.type == "cuda" else None
        if ready is not None:
            ready.record()
        pool = ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 1)))

        def digest_all() -> list[str]:
            if ready is not None:
                ready.synchronize()
            return list(pool.map(logits_digest, host.unbind(0), chunksize=16))

        pending = pool.submit(digest_all)
        ids, values = ids.cpu().tolist(), values.cpu().tolist()

        def collect():
            digests = pending.result()
            pool.shutdown()
            return ids, values, digests

        return collect


def _left_padded_cache(states: list[PrefixState]) -> tuple[DynamicCache, torch.Tensor]:
    """One cache for rows of different prefix lengths: each row right-aligned, padding masked out."""
    longest = max(s.length for s in states)
    mask = torch.zeros(len(states), longest, dtype=torch.long)
    layers = []
    for layer in range(len(states[0].layers)):
        keys, values = [], []
        for row, state in enumerate(states):
            k, v = state.layers[layer]
            pad = longest - state.length
            keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            if layer == 0:
                mask[row, pad:] = 1
        layers.append((torch.cat(keys), torch.cat(values)))
    return DynamicCache(ddp_cache_data=layers), mask


def cache_layers(cache: DynamicCache) -> KVLayers:
    return [(layer.keys, layer.values) for layer in cache.layers]


def save_kv(layers: KVLayers, keep: int, path: Path) -> str:
    """Store the first ``keep`` positions of a batch-1 cache in its native dtype; return the file's sha256."""
    tensors = {}
    for i, (k, v) in enumerate(layers):
        tensors[f"k.{i}"] = k[..., :keep, :].contiguous().cpu()
        tensors[f"v.{i}"] = v[..., :keep, :].contiguous().cpu()
    with atomic_path(path) as tmp:
        # One metadata key only: safetensors writes metadata in hash-map order, so several keys would make
        # equal caches give different bytes (and different checksums) from run to run.
        save_file(tensors, str(tmp), metadata={"replaynoise-kv": f"format=1;positions={keep}"})
    return sha256_file(path)


def load_kv(path: str | Path, expected_sha256: str | None = None, device: torch.device | str = "cpu") -> KVLayers:
    """Load a stored cache; a file whose checksum or structure is wrong raises an error naming it."""
    if expected_sha256 is not None:
        actual = sha256_file(path)
        if actual != expected_sha256:
            raise VerificationError(
                f"{path}: stored KV is corrupt (sha256 {actual}, recorded {expected_sha256}); "
                "rerun the rollout step for this configuration")
    try:
        tensors = load_file(str(path), device=str(device))
    except (SafetensorError, OSError, ValueError) as exc:
        raise VerificationError(f"{path}: stored KV cannot be read ({exc})") from exc
    n_layers = len(tensors) // 2
    try:
        return [(tensors[f"k.{i}"], tensors[f"v.{i}"]) for i in range(n_layers)]
    except KeyError as exc:
        raise VerificationError(f"{path}: stored KV lacks tensor {exc}") from exc
