"""The HF engine's decode modes: each says how it prefills a re-fed prefix, re-steps a stored one, continues rows
from their prefix states and generates rollouts.

- ``Dynamic``: HF's own forward on a DynamicCache, prompts prefilled in one left-padded forward, finished rows
  leaving the batch, as in a serving engine (stock kernels, ``decode: dynamic``).
- ``Static``: as ``Dynamic`` for prefills; continuations and rollouts in a preallocated static cache, one captured
  graph per step on CUDA, rows staying until every row has finished (stock kernels, ``decode: static``).
- ``ByToken``: nothing may depend on batching or on prefill versus decode, so every forward computes one token
  of one row, prompt included (invariant kernels where static decode is not used).
- ``Aligned``: the same promise at close to stock speed: every forward computes one token per row in one fixed
  [rows, slots] shape with position p in slot p (``AlignedDecoder``; invariant kernels with static decode).

A mode holds no state of a run but its decoder; what it computes with is the engine's ``Forwards``.
"""

from __future__ import annotations

import torch

from replaynoise.engines.base import ContinuationRequest, ContinuationResult, Rollout, RolloutRequest, SamplingSettings
from replaynoise.engines.hf_forwards import Forwards
from replaynoise.engines.kvfiles import KVLayers, stack_layers
from replaynoise.engines.sampling import (
    RowSampler,
    digest_rows,
    digest_strings,
    logits_digest,
    logprob_rows,
    sample_rows,
    token_logprob_of,
    topk_of,
)
from replaynoise.engines.states import PrefixState, bucket, cache_layers, row_bucket
from replaynoise.engines.static import AlignedDecoder

#: what ``refeed`` returns: each row's stacked KV, its prefill's scores (None where not scored), and the whole
#: left-padded stack where one batched forward made them (the drift check reads it in one piece), else None
Refed = tuple[list[torch.Tensor], list, torch.Tensor | None]


class Dynamic:
    name = "dynamic"

    def __init__(self, forwards: Forwards) -> None:
        self.f = forwards

    def refeed(self, seqs: list[list[int]], starts: list[int | None]) -> Refed:
        return self.f.batched_states(seqs, starts)

    def restep(self, requests: list[ContinuationRequest], states: list[PrefixState]) -> None:
        self.f.restep(requests, states, alone=False)

    def continue_rows(self, requests: list[ContinuationRequest], states: list[PrefixState],
                      sampling: SamplingSettings) -> list[ContinuationResult]:
        with self.f.phases("decode"):
            return self.f.continue_dynamic(requests, states, sampling)

    def continue_in(self, model: torch.nn.Module, requests: list[ContinuationRequest], states: list[PrefixState],
                    sampling: SamplingSettings) -> list[ContinuationResult]:
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
        top_ids, top_lps, digests, sampled, token_lps = f.step_records(n, steps)
        active = torch.arange(n, **dev)
        out: list = [None] * n
        for step in range(steps):
            logprobs = logprob_rows(logits)
            top_ids[active, step], top_lps[active, step] = topk_of(logprobs, k)
            digests[active, step] = digest_rows(logits)
            tokens = sample_rows(logits, seeds[active], torch.full_like(active, step), sampling.temperature,
                                 sampling.top_p)
            sampled[active, step] = tokens
            token_lps[active, step] = token_logprob_of(logprobs, tokens)
            done = torch.isin(tokens, torch.tensor(sorted(f.eos_ids), **dev)) | (step + 1 == steps)
            if bool(done.any()):
                rows = active[done].tolist()
                host = [t[rows, :step + 1].tolist() for t in (sampled, top_ids, top_lps, digests, token_lps)]
                for slot, (row, *records) in zip(done.nonzero()[:, 0].tolist(), zip(rows, *host)):
                    rollout = f.rollout_of(requests[row], *records)
                    start = pads[row]
                    length = len(rollout.prompt_ids) + len(rollout.response_ids) - 1
                    out[row] = (rollout, [(layer.keys[slot:slot + 1, :, start:start + length].clone(),
                                           layer.values[slot:slot + 1, :, start:start + length].clone())
                                          for layer in cache.layers])
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

    def continue_rows(self, requests: list[ContinuationRequest], states: list[PrefixState],
                      sampling: SamplingSettings) -> list[ContinuationResult]:
        """Decode all rows together in a static cache (one graph replay per step); times its own phases."""
        n, steps = len(requests), sampling.max_new_tokens
        length = bucket(max(s.length for s in states) + steps + 1)  # bucketed: the batches of a pass share a graph
        rows = row_bucket(n)
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
            decoder.load([s.kv if stacked else s.per_layer() for s in ordered], [s.length for s in ordered],
                         [unique[id(s)] for s in states],
                         [r.seed for r in requests], [r.branch_token for r in requests],
                         (sampling.temperature, sampling.top_p))
        return self.f.decode_rows(decoder, requests[:n], states[:n], steps)

    @torch.inference_mode()
    def generate(self, requests: list[RolloutRequest], sampling: SamplingSettings
                 ) -> list[tuple[Rollout, torch.Tensor]]:
        """Batched rollouts in a static cache: the batch's prompts prefilled together, then one captured graph
        replay per step for all rows; top-k, digests and tokens stay on the device until the batch ends."""
        f = self.f
        n, steps = len(requests), sampling.max_new_tokens
        prompts = [list(r.prompt_ids) for r in requests]
        with f.phases("prefill"):
            cache, logits, mask = f.prefill_batch(prompts)
            longest = mask.shape[1]
            records = f.step_records(n, steps)
            seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=f.device)
            top_ids, top_lps, digests, sampled, token_lps = records
            logprobs = logprob_rows(logits)
            top_ids[:, 0], top_lps[:, 0] = topk_of(logprobs, f.topk)
            digests[:, 0] = digest_rows(logits)
            sampled[:, 0] = sample_rows(logits, seeds, torch.zeros_like(seeds), sampling.temperature,
                                        sampling.top_p)
            token_lps[:, 0] = token_logprob_of(logprobs, sampled[:, 0])
            del logprobs
            stacked = stack_layers(cache_layers(cache))
            layers = [stacked[:, :, r:r + 1, :, longest - len(p):] for r, p in enumerate(prompts)]
        with f.phases("load states"):
            # not compiled: a rollout job decodes one batch, and compiling the layer body costs seconds in every
            # job, more than a short decode takes (docs/performance.md). No pass needs the rollouts' kernels:
            # exact resumes from the stored KV, whatever computed it.
            decoder = f.decoder(n, bucket(longest + steps + 1), compiled=False)
            decoder.load(layers, [len(p) for p in prompts], list(range(n)), [r.seed for r in requests],
                         sampled[:, 0].tolist(), (sampling.temperature, sampling.top_p))
            del cache, layers, stacked
            decoder.step_no.fill_(1)  # token 0 came from the prefill: the decode samples steps 1, 2, ...
        last, host = f.record_steps(decoder, records, range(1, steps), n, before=0)
        rollouts = [f.rollout_of(req, *rec) for req, *rec in zip(requests, *host)]
        # Each row's KV stays a view of the decoder's buffer, which no other batch touches before the rows are
        # stored: storing copies to the host only the positions a row's pivots need (``keep_len``), a fifth of the
        # buffer at the 7B shape, since copying the whole buffer to pageable host memory is slow at that size.
        return [(r, decoder.kv[:, :, row:row + 1, :, longest - len(r.prompt_ids):longest + len(r.response_ids) - 1])
                for row, r in enumerate(rollouts)]


class ByToken:
    name = "invariant"

    def __init__(self, forwards: Forwards) -> None:
        self.f = forwards

    def refeed(self, seqs: list[list[int]], starts: list[int | None]) -> Refed:
        stacks, scores = [], []
        for seq, start in zip(seqs, starts):
            cache, _, score = self.f.prefill_by_token(seq, start)
            stacks.append(stack_layers(cache_layers(cache)))
            scores.append(score)
        return stacks, scores, None

    def restep(self, requests: list[ContinuationRequest], states: list[PrefixState]) -> None:
        self.f.restep(requests, states, alone=True)

    def continue_rows(self, requests: list[ContinuationRequest], states: list[PrefixState],
                      sampling: SamplingSettings) -> list[ContinuationResult]:
        with self.f.phases("decode"):
            return self.continue_in(None, requests, states, sampling)

    def continue_in(self, model: torch.nn.Module | None, requests: list[ContinuationRequest],
                    states: list[PrefixState], sampling: SamplingSettings) -> list[ContinuationResult]:
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
        rollout = Rollout(req.problem_id, list(req.prompt_ids), response, top_ids, top_lps, digests, finish,
                          rollout=req.rollout, token_logprobs=token_lps)
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
            self._decoder = AlignedDecoder(self.f.model, self.rows, self.context, graphs=self.f.graphs,
                                           attention=self.f.attention)
        return self._decoder

    def refeed(self, seqs: list[list[int]], starts: list[int | None]) -> Refed:
        """Prefilled by the decoder's own steps, at most ``rows`` at a time."""
        decoder, stacks, scores = self.decoder(), [], []
        for start in range(0, len(seqs), self.rows):
            chunk = seqs[start:start + self.rows]
            scores.extend(decoder.prefill(chunk, starts[start:start + self.rows]))
            whole = decoder.kv[:, :, :len(chunk), :, :max(map(len, chunk))].clone()
            stacks.extend(whole[:, :, r:r + 1, :, :len(seq)] for r, seq in enumerate(chunk))
        return stacks, scores, None

    def restep(self, requests: list[ContinuationRequest], states: list[PrefixState]) -> None:
        """Each pivot's last prefix token re-run over the rest of its stored KV, as one eager forward of the
        decoder (the kernels its steps use), compared on the device."""
        decoder = self.decoder()
        sampling = decoder.sampling or (1.0, 1.0)  # kept: a captured continuation graph stays valid
        for start in range(0, len(states), self.rows):
            group, reqs = states[start:start + self.rows], requests[start:start + self.rows]
            kvs = [s.stacked() for s in group]
            at = [s.length - 1 for s in group]
            decoder.start(at, [r.prefix_ids[-1] for r in reqs], [0] * len(group), sampling, states=kvs)
            digests = digest_strings(digest_rows(decoder.logits()[:len(group)]))
            slots = torch.arange(len(group), device=self.f.device)
            new = decoder.kv[:, :, slots, :, torch.tensor(at, device=self.f.device)]  # [rows, layers, 2, heads, dim]
            old = torch.stack([kv[:, :, 0, :, a] for kv, a in zip(kvs, at)])
            same_kv = (new == old).flatten(1).all(1).tolist()
            for slot, (req, state) in enumerate(zip(reqs, group)):
                state.restep_match = same_kv[slot] and digests[slot] == req.expected_digest

    def continue_rows(self, requests: list[ContinuationRequest], states: list[PrefixState],
                      sampling: SamplingSettings) -> list[ContinuationResult]:
        """At most ``rows`` rows at a time in the decoder, each from its own prefix state."""
        results = []
        for start in range(0, len(requests), self.rows):
            reqs, sts = requests[start:start + self.rows], states[start:start + self.rows]
            decoder = self.decoder()
            decoder.check_fits(max(s.length for s in sts) + sampling.max_new_tokens)
            with self.f.phases("load states"):
                decoder.start([s.length for s in sts], [r.branch_token for r in reqs], [r.seed for r in reqs],
                              (sampling.temperature, sampling.top_p), states=[s.stacked() for s in sts])
            results.extend(self.f.decode_rows(decoder, reqs, sts, sampling.max_new_tokens))
        return results

    @torch.inference_mode()
    def generate(self, requests: list[RolloutRequest], sampling: SamplingSettings
                 ) -> list[tuple[Rollout, torch.Tensor]]:
        return [row for start in range(0, len(requests), self.rows)
                for row in self._generate_chunk(requests[start:start + self.rows], sampling)]

    def _generate_chunk(self, requests: list[RolloutRequest], sampling: SamplingSettings
                        ) -> list[tuple[Rollout, torch.Tensor]]:
        """Rollouts of at most ``rows`` requests: the prompts fed by decode steps, then one step per token; a
        row's KV is slots [0, n) of the decoder, its own positions."""
        f, n, steps = self.f, len(requests), sampling.max_new_tokens
        prompts = [list(r.prompt_ids) for r in requests]
        decoder = self.decoder()
        decoder.check_fits(max(map(len, prompts)) - 1 + steps)
        with f.phases("prefill"):
            decoder.prefill(prompts)
            decoder.start([len(p) - 1 for p in prompts], [p[-1] for p in prompts], [r.seed for r in requests],
                          (sampling.temperature, sampling.top_p))
        last, host = f.record_steps(decoder, f.step_records(decoder.rows, steps), range(steps), n)
        with f.phases("results to host"):
            # a copy also on a CPU (.cpu() would alias the decoder, which the next chunk overwrites)
            kv = decoder.kv[:, :, :n, :, :max(map(len, prompts)) + last].to("cpu", copy=True)
        rollouts = [f.rollout_of(req, *rec) for req, *rec in zip(requests, *host)]
        return [(r, kv[:, :, row:row + 1, :, :len(r.prompt_ids) + len(r.response_ids) - 1])
                for row, r in enumerate(rollouts)]
