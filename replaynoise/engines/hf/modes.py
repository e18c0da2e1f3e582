"""The HF engine's decode modes: each says how it prefills a re-fed prefix, re-steps a stored one, continues rows
from their prefix states and generates rollouts.

- ``Dynamic``: HF's own forward on a DynamicCache, prompts prefilled in one left-padded forward, finished rows
  leaving the batch, as in a serving engine (stock kernels, ``decode: dynamic``).
- ``Static``: as ``Dynamic`` for prefills; continuations and rollouts in a preallocated static cache, one captured
  graph per step on CUDA, rows staying until every row has finished (stock kernels, ``decode: static``); with
  ``static_rows``, a batch of more continuations than that runs through a decoder of that many rows, each row
  taking the next waiting continuation when its own ends.
- ``ByToken`` and ``Aligned`` (``invariant_modes``): the batch-invariant modes of kernels invariant.

A mode holds no state of a run but its decoder; what it computes with is the engine's ``Forwards``; what the engine
asks of every mode is ``DecodeMode``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import cast

import torch

from replaynoise.engines.base import ContinuationRequest, ContinuationResult, Rollout, RolloutRequest, SamplingSettings
from replaynoise.engines.hf.cached import cached_refeed
from replaynoise.engines.hf.forwards import Forwards
from replaynoise.engines.hf.kvfiles import KVLayers, stack_layers
from replaynoise.engines.hf.records import rollout_of, step_records
from replaynoise.engines.hf.refill import CHECK_EVERY
from replaynoise.engines.hf.states import PrefixState, bucket, cache_layers, row_bucket
from replaynoise.engines.hf.static import RefillDecoder
from replaynoise.engines.sampling import (
    digest_rows,
    logprob_rows,
    sample_rows,
    token_logprob_of,
    topk_of,
)

#: what ``refeed`` returns: each row's stacked KV, its prefill's scores (None where not scored), and the whole
#: left-padded stack where one batched forward made them (the drift check reads it in one piece), else None
Refed = tuple[list[torch.Tensor], list, torch.Tensor | None]


class DecodeMode(ABC):
    """What the HF engine asks of a decode mode: each of these, so that the engine never asks which mode it has."""

    #: the mode's name in the engine's log and in ``decode`` (``invariant`` for the two invariant modes)
    name: str

    def __init__(self, forwards: Forwards) -> None:
        self.f = forwards

    @abstractmethod
    def refeed(self, seqs: list[list[int]], starts: list[int | None]) -> Refed:
        """Prefill each re-fed prefix; score its tokens from ``starts[i]`` on where given."""

    def refeed_cached(self, seqs: list[list[int]], prompt_lens: list[int], starts: list[int | None]) -> Refed:
        """Prefill each re-fed prefix with its prompt served as a prefix cache holds it (``cached.cached_refeed``)."""
        stacks, scores = cached_refeed(self.f, seqs, prompt_lens, starts)
        return stacks, scores, None

    @abstractmethod
    def restep(self, requests: list[ContinuationRequest], states: list[PrefixState]) -> None:
        """Run each stored prefix's last step again and record whether it reproduces the rollout bitwise."""

    @abstractmethod
    def continue_rows(
        self, requests: list[ContinuationRequest], states: list[PrefixState], sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        """Decode every row's continuation from its prefix state."""

    @abstractmethod
    def continue_in(
        self,
        model: torch.nn.Module | None,
        requests: list[ContinuationRequest],
        states: list[PrefixState],
        sampling: SamplingSettings,
    ) -> list[ContinuationResult]:
        """The same on ``model`` (a precision control's cast copy), where given."""

    @abstractmethod
    def generate(self, requests: list[RolloutRequest], sampling: SamplingSettings) -> list[tuple[Rollout, KVLayers]]:
        """Generate rollouts, each with the decode-time KV its pivots may need."""


class Dynamic(DecodeMode):
    name = "dynamic"

    def refeed(self, seqs: list[list[int]], starts: list[int | None]) -> Refed:
        return self.f.batched_states(seqs, starts)

    def restep(self, requests: list[ContinuationRequest], states: list[PrefixState]) -> None:
        self.f.restep(requests, states, alone=False)

    def continue_rows(
        self, requests: list[ContinuationRequest], states: list[PrefixState], sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        with self.f.phases("decode"):
            return self.f.continue_dynamic(requests, states, sampling)

    def continue_in(
        self,
        model: torch.nn.Module,
        requests: list[ContinuationRequest],
        states: list[PrefixState],
        sampling: SamplingSettings,
    ) -> list[ContinuationResult]:
        """Continue with another model (a precision control's cast copy) on HF's own forward."""
        return self.f.continue_dynamic(requests, states, sampling, model)

    def generate(self, requests: list[RolloutRequest], sampling: SamplingSettings) -> list[tuple[Rollout, KVLayers]]:
        with self.f.phases("generate"):
            return self._generate(requests, sampling)

    @torch.inference_mode()
    def _generate(self, requests: list[RolloutRequest], sampling: SamplingSettings) -> list[tuple[Rollout, KVLayers]]:
        """Batched rollouts on an HF DynamicCache; finished rows leave the batch (their KV sliced out first)."""
        f = self.f
        n, steps, k = len(requests), sampling.max_new_tokens, f.topk
        cache, logits, mask = f.prefill_batch([list(r.prompt_ids) for r in requests])
        pads = (mask.shape[1] - mask.sum(-1)).tolist()
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=f.device)
        positions = mask.sum(-1).to(f.device)
        mask = mask.to(f.device)
        dev = dict(device=f.device)
        top_ids, top_lps, digests, sampled, token_lps = step_records(n, steps, f.topk, f.device)
        active = torch.arange(n, **dev)
        out: list = [None] * n
        for step in range(steps):
            logprobs = logprob_rows(logits)
            top_ids[active, step], top_lps[active, step] = topk_of(logprobs, k)
            digests[active, step] = digest_rows(logits)
            tokens = sample_rows(
                logits, seeds[active], torch.full_like(active, step), sampling.temperature, sampling.top_p
            )
            sampled[active, step] = tokens
            token_lps[active, step] = token_logprob_of(logprobs, tokens)
            done = torch.isin(tokens, torch.tensor(sorted(f.eos_ids), **dev)) | (step + 1 == steps)
            if bool(done.any()):
                rows = active[done].tolist()
                host = [t[rows, : step + 1].tolist() for t in (sampled, top_ids, top_lps, digests, token_lps)]
                for slot, (row, *records) in zip(done.nonzero()[:, 0].tolist(), zip(rows, *host)):
                    rollout = rollout_of(requests[row], f.eos_ids, *records)
                    start = pads[row]
                    length = len(rollout.prompt_ids) + len(rollout.response_ids) - 1
                    out[row] = (
                        rollout,
                        [
                            (
                                layer.keys[slot : slot + 1, :, start : start + length].clone(),
                                layer.values[slot : slot + 1, :, start : start + length].clone(),
                            )
                            for layer in cache.layers
                        ],
                    )
                if bool(done.all()):
                    break
                keep = (~done).nonzero()[:, 0]
                cache.batch_select_indices(keep)
                mask, positions, active, tokens = mask[keep], positions[keep], active[keep], tokens[keep]
            mask = torch.cat([mask, torch.ones(len(active), 1, dtype=mask.dtype, **dev)], dim=1)
            logits = f.step(tokens[:, None], cache, attention_mask=mask, position_ids=positions[:, None])
            positions = positions + 1
        return out


class Static(Dynamic):
    name = "static"

    def __init__(self, forwards: Forwards, rows: int | None = None, *, compile_rollouts: bool = False) -> None:
        super().__init__(forwards)
        #: the most rows a continuation decoder holds (``static_rows``; None: a batch's own, rounded up)
        self.rows = rows
        #: the rollout decoder's layers compiled (``compile_rollouts``); else eager inside its captured graph
        self.compile_rollouts = compile_rollouts

    def continue_rows(
        self, requests: list[ContinuationRequest], states: list[PrefixState], sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        """Decode all rows together in a static cache (one graph replay per step); times its own phases."""
        n, steps = len(requests), sampling.max_new_tokens
        if self.rows is not None and n > self.rows:
            return self._refilled(requests, states, sampling)
        length = bucket(max(s.length for s in states) + steps + 1)  # bucketed: the batches of a pass share a graph
        rows = row_bucket(n) if self.rows is None else min(row_bucket(n), self.rows)  # at most static_rows
        if rows > n:  # a short batch runs padded to a power of two (the full batches' shape where the batch size
            # is one) with copies of its first row whose results are dropped: the shape, and so the numbers,
            # depend on the batch alone, not on which decoders this process built before a resume
            requests = requests + [requests[0]] * (rows - n)
            states = states + [states[0]] * (rows - n)
        unique: dict[int, int] = {}
        for state in states:
            unique.setdefault(id(state), len(unique))
        ordered = list({id(s): s for s in states}.values())
        with self.f.phases("load states"):
            decoder = self.f.decoder(rows, length)
            stacked = all(s.kv is not None for s in ordered)
            decoder.load(
                [s.kv if stacked else s.per_layer() for s in ordered],
                [s.length for s in ordered],
                [unique[id(s)] for s in states],
                [r.seed for r in requests],
                [r.branch_token for r in requests],
                (sampling.temperature, sampling.top_p),
            )
        return self.f.decode_rows(decoder, requests[:n], states[:n], steps)

    def _refilled(
        self, requests: list[ContinuationRequest], states: list[PrefixState], sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        """More continuations than ``rows``: one decoder of ``rows`` rows, refilled as they end. Its cache holds
        the batch's longest prefix and the steps a row may run past its budget before it is seen to end."""
        length = bucket(max(s.length for s in states) + sampling.max_new_tokens + CHECK_EVERY + 1)
        with self.f.phases("load states"):
            decoder = cast(RefillDecoder, self.f.decoder(self.rows, length, kind=RefillDecoder))
            decoder.start((sampling.temperature, sampling.top_p))
        return self.f.decode_refilled(decoder, requests, states, sampling.max_new_tokens)

    @torch.inference_mode()
    def generate(
        self, requests: list[RolloutRequest], sampling: SamplingSettings
    ) -> list[tuple[Rollout, torch.Tensor]]:
        """Batched rollouts in a static cache: the batch's prompts prefilled together, then one captured graph
        replay per step for all rows; top-k, digests and tokens stay on the device until the batch ends."""
        f = self.f
        n, steps = len(requests), sampling.max_new_tokens
        prompts = [list(r.prompt_ids) for r in requests]
        with f.phases("prefill"):
            cache, logits, mask = f.prefill_batch(prompts)
            longest = mask.shape[1]
            records = step_records(n, steps, f.topk, f.device)
            seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=f.device)
            top_ids, top_lps, digests, sampled, token_lps = records
            logprobs = logprob_rows(logits)
            top_ids[:, 0], top_lps[:, 0] = topk_of(logprobs, f.topk)
            digests[:, 0] = digest_rows(logits)
            sampled[:, 0] = sample_rows(logits, seeds, torch.zeros_like(seeds), sampling.temperature, sampling.top_p)
            token_lps[:, 0] = token_logprob_of(logprobs, sampled[:, 0])
            del logprobs
            stacked = stack_layers(cache_layers(cache))
            layers = [stacked[:, :, r : r + 1, :, longest - len(p) :] for r, p in enumerate(prompts)]
        with f.phases("load states"):
            # eager layers unless compile_rollouts: compiling costs seconds per batch shape in every job, which a
            # short decode does not repay (docs/hf.md). No pass needs the rollouts' kernels: exact
            # resumes from the stored KV, whatever computed it.
            decoder = f.decoder(n, bucket(longest + steps + 1), compiled=self.compile_rollouts)
            decoder.load(
                layers,
                [len(p) for p in prompts],
                list(range(n)),
                [r.seed for r in requests],
                sampled[:, 0].tolist(),
                (sampling.temperature, sampling.top_p),
            )
            del cache, layers, stacked
            decoder.step_no.fill_(1)  # token 0 came from the prefill: the decode samples steps 1, 2, ...
        last, host = f.record_steps(decoder, records, range(1, steps), n, before=0)
        rollouts = [rollout_of(req, f.eos_ids, *rec) for req, *rec in zip(requests, *host)]
        # Each row's KV stays a view of the decoder's buffer, which no other batch touches before the rows are
        # stored: storing copies to the host only the positions a row's pivots need (``keep_len``), a fifth of the
        # buffer at the 7B shape, since copying the whole buffer to pageable host memory is slow at that size.
        return [
            (r, decoder.kv[:, :, row : row + 1, :, longest - len(r.prompt_ids) : longest + len(r.response_ids) - 1])
            for row, r in enumerate(rollouts)
        ]
