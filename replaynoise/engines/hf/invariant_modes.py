"""The HF engine's batch-invariant decode modes (kernels invariant): nothing a forward computes may depend on
batching or on prefill versus decode.

- ``ByToken``: every forward computes one token of one row, prompt included (where static decode is not used).
- ``Aligned``: the same promise at close to stock speed: every forward computes one token per row in one fixed
  [rows, slots] shape with position p in slot p (``AlignedDecoder``; with static decode).

The stock modes and the interface every mode keeps (``DecodeMode``) are in ``modes``."""

from __future__ import annotations

import torch

from replaynoise.engines.base import ContinuationRequest, ContinuationResult, Rollout, RolloutRequest, SamplingSettings
from replaynoise.engines.hf.forwards import Forwards
from replaynoise.engines.hf.kvfiles import KVLayers, stack_layers
from replaynoise.engines.hf.modes import DecodeMode, Refed
from replaynoise.engines.hf.records import rollout_of, step_records
from replaynoise.engines.hf.states import PrefixState, cache_layers
from replaynoise.engines.hf.static import AlignedDecoder
from replaynoise.engines.sampling import (
    RowSampler,
    digest_rows,
    digest_strings,
    logits_digest,
    logprob_rows,
    topk_of,
)


class ByToken(DecodeMode):
    name = "invariant"

    def refeed(self, seqs: list[list[int]], starts: list[int | None]) -> Refed:
        stacks, scores = [], []
        for seq, start in zip(seqs, starts):
            cache, _, score = self.f.prefill_by_token(seq, start)
            stacks.append(stack_layers(cache_layers(cache)))
            scores.append(score)
        return stacks, scores, None

    def refeed_cached(self, seqs: list[list[int]], prompt_lens: list[int], starts: list[int | None]) -> Refed:
        """The re-feed itself: every position is computed alone, by the decode step's own kernels, so a prompt
        served from an earlier prefill holds the bits this prefill gives it."""
        return self.refeed(seqs, starts)

    def restep(self, requests: list[ContinuationRequest], states: list[PrefixState]) -> None:
        self.f.restep(requests, states, alone=True)

    def continue_rows(
        self, requests: list[ContinuationRequest], states: list[PrefixState], sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        with self.f.phases("decode"):
            return self.continue_in(None, requests, states, sampling)

    def continue_in(
        self,
        model: torch.nn.Module | None,
        requests: list[ContinuationRequest],
        states: list[PrefixState],
        sampling: SamplingSettings,
    ) -> list[ContinuationResult]:
        """Each row alone, on HF's own forward (of ``model``, a precision control's cast copy, where given)."""
        return [self.f.continue_dynamic([r], [s], sampling, model, padded=False)[0] for r, s in zip(requests, states)]

    def generate(self, requests: list[RolloutRequest], sampling: SamplingSettings) -> list[tuple[Rollout, KVLayers]]:
        with self.f.phases("generate"):
            return [self._generate_one(req, sampling) for req in requests]

    def _generate_one(self, req: RolloutRequest, sampling: SamplingSettings) -> tuple[Rollout, KVLayers]:
        f = self.f
        sampler = RowSampler(req.seed, sampling.temperature, sampling.top_p)
        cache, logits, _ = f.prefill_by_token(list(req.prompt_ids))
        response, top_ids, top_lps, digests, token_lps = [], [], [], [], []
        finish = "length"
        for step in range(sampling.max_new_tokens):
            logprobs = logprob_rows(logits[None, :])
            ids, lps = topk_of(logprobs, f.topk)
            top_ids.append(ids[0].tolist())
            top_lps.append(lps[0].tolist())
            digests.append(logits_digest(logits))
            token = sampler.sample(logits)
            response.append(token)
            token_lps.append(float(logprobs[0, token]))
            if token in f.eos_ids:
                finish = "eos"
                break
            if step + 1 < sampling.max_new_tokens:
                logits = f.step(torch.tensor([[token]]), cache)[0]
        rollout = Rollout(
            req.problem_id,
            list(req.prompt_ids),
            response,
            top_ids,
            top_lps,
            digests,
            finish,
            rollout=req.rollout,
            token_logprobs=token_lps,
        )
        return rollout, cache_layers(cache)


class Aligned(ByToken):
    """Invariant kernels in the configuration's one decoder shape, ``rows`` x ``context`` (built once); a
    precision control's continuation still runs each row alone on HF's forward (``ByToken.continue_in``)."""

    name = "aligned"

    def __init__(self, forwards: Forwards, rows: int, context: int) -> None:
        super().__init__(forwards)
        self.rows, self.context = rows, context
        self._decoder: AlignedDecoder | None = None

    def decoder(self) -> AlignedDecoder:
        if self._decoder is None:
            self._decoder = AlignedDecoder(
                self.f.model, self.rows, self.context, graphs=self.f.graphs, attention=self.f.attention
            )
        return self._decoder

    def refeed(self, seqs: list[list[int]], starts: list[int | None]) -> Refed:
        """Prefilled by the decoder's own steps, at most ``rows`` at a time."""
        decoder, stacks, scores = self.decoder(), [], []
        for start in range(0, len(seqs), self.rows):
            chunk = seqs[start : start + self.rows]
            scores.extend(decoder.prefill(chunk, starts[start : start + self.rows]))
            whole = decoder.kv[:, :, : len(chunk), :, : max(map(len, chunk))].clone()
            stacks.extend(whole[:, :, r : r + 1, :, : len(seq)] for r, seq in enumerate(chunk))
        return stacks, scores, None

    def restep(self, requests: list[ContinuationRequest], states: list[PrefixState]) -> None:
        """Each pivot's last prefix token re-run over the rest of its stored KV, as one eager forward of the
        decoder (the kernels its steps use), compared on the device."""
        decoder = self.decoder()
        sampling = decoder.sampling or (1.0, 1.0)  # kept: a captured continuation graph stays valid
        for start in range(0, len(states), self.rows):
            group, reqs = states[start : start + self.rows], requests[start : start + self.rows]
            kvs = [s.stacked() for s in group]
            at = [s.length - 1 for s in group]
            decoder.start(at, [r.prefix_ids[-1] for r in reqs], [0] * len(group), sampling, states=kvs)
            digests = digest_strings(digest_rows(decoder.logits()[: len(group)]))
            slots = torch.arange(len(group), device=self.f.device)
            new = decoder.kv[:, :, slots, :, torch.tensor(at, device=self.f.device)]  # [rows, layers, 2, heads, dim]
            old = torch.stack([kv[:, :, 0, :, a] for kv, a in zip(kvs, at)])
            same_kv = (new == old).flatten(1).all(1).tolist()
            for slot, (req, state) in enumerate(zip(reqs, group)):
                state.restep_match = same_kv[slot] and digests[slot] == req.expected_digest

    def continue_rows(
        self, requests: list[ContinuationRequest], states: list[PrefixState], sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        """At most ``rows`` rows at a time in the decoder, each from its own prefix state."""
        results = []
        for start in range(0, len(requests), self.rows):
            reqs, sts = requests[start : start + self.rows], states[start : start + self.rows]
            decoder = self.decoder()
            decoder.check_fits(max(s.length for s in sts) + sampling.max_new_tokens)
            with self.f.phases("load states"):
                decoder.start(
                    [s.length for s in sts],
                    [r.branch_token for r in reqs],
                    [r.seed for r in reqs],
                    (sampling.temperature, sampling.top_p),
                    states=[s.stacked() for s in sts],
                )
            results.extend(self.f.decode_rows(decoder, reqs, sts, sampling.max_new_tokens))
        return results

    @torch.inference_mode()
    def generate(
        self, requests: list[RolloutRequest], sampling: SamplingSettings
    ) -> list[tuple[Rollout, torch.Tensor]]:
        return [
            row
            for start in range(0, len(requests), self.rows)
            for row in self._generate_chunk(requests[start : start + self.rows], sampling)
        ]

    def _generate_chunk(
        self, requests: list[RolloutRequest], sampling: SamplingSettings
    ) -> list[tuple[Rollout, torch.Tensor]]:
        """Rollouts of at most ``rows`` requests: the prompts fed by decode steps, then one step per token; a
        row's KV is slots [0, n) of the decoder, its own positions."""
        f, n, steps = self.f, len(requests), sampling.max_new_tokens
        prompts = [list(r.prompt_ids) for r in requests]
        decoder = self.decoder()
        decoder.check_fits(max(map(len, prompts)) - 1 + steps)
        with f.phases("prefill"):
            decoder.prefill(prompts)
            decoder.start(
                [len(p) - 1 for p in prompts],
                [p[-1] for p in prompts],
                [r.seed for r in requests],
                (sampling.temperature, sampling.top_p),
            )
        last, host = f.record_steps(decoder, step_records(decoder.rows, steps, f.topk, f.device), range(steps), n)
        with f.phases("results to host"):
            # a copy also on a CPU (.cpu() would alias the decoder, which the next chunk overwrites)
            kv = decoder.kv[:, :, :n, :, : max(map(len, prompts)) + last].to("cpu", copy=True)
        rollouts = [rollout_of(req, f.eos_ids, *rec) for req, *rec in zip(requests, *host)]
        return [
            (r, kv[:, :, row : row + 1, :, : len(r.prompt_ids) + len(r.response_ids) - 1])
            for row, r in enumerate(rollouts)
        ]
