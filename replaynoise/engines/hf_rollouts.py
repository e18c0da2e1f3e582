"""The HF engine's rollouts: whole problems generated together, each row's own decode-time KV stored with the
token ids it was computed from, per-step top-k and logits digests kept on the device until a batch ends.

A part of ``HFEngine`` (``hf.py``), kept in its own module: it uses the engine's forwards (``_step``,
``_prefill``, ``_prefill_batch``), decoders (``_decoder``, ``_aligned``, ``_run_steps``) and settings.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from replaynoise.engines.base import KeepLen, Rollout, RolloutRequest, SamplingSettings
from replaynoise.engines.kvfiles import KVLayers, save_kv, stack_layers
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
from replaynoise.engines.states import IO_THREADS, bucket, cache_layers
from replaynoise.engines.static import StaticDecoder
from replaynoise.io import file_in


class HFRollouts:
    """Rollout generation of ``HFEngine``."""

    @torch.inference_mode()
    def generate_rollouts(self, requests: list[RolloutRequest], sampling: SamplingSettings, kv_dir: Path,
                          keep_len: KeepLen) -> list[Rollout]:
        """All requests as one batch (stock: left-padded prefill, then one decode step for every row at once; each
        row's own, unpadded decode-time KV is kept); invariant: in the invariant decoder, ``invariant_rows`` at a
        time, or, without static decode, one token of one row per forward."""
        if self.aligned:
            rows = [row for start in range(0, len(requests), self.invariant_shape[0])
                    for row in self._generate_aligned(requests[start:start + self.invariant_shape[0]], sampling)]
        elif self.static:
            rows = self._generate_static(requests, sampling)  # times its own phases
        else:
            with self.phases("generate"):
                rows = ([self._generate_one(req, sampling) for req in requests] if self.invariant
                        else self._generate_dynamic(requests, sampling))
        with self.phases("store KV"), ThreadPoolExecutor(IO_THREADS) as pool:
            saving = []
            for req, (rollout, layers) in zip(requests, rows):
                keep = min(keep_len(rollout), layers[0][0].shape[-2])
                if keep > 0:
                    path = file_in(kv_dir, f"{req.key}.safetensors")
                    ids = (rollout.prompt_ids + rollout.response_ids)[:keep]
                    saving.append((rollout, pool.submit(save_kv, layers, keep, path, ids=ids)))
                    rollout.kv_file, rollout.kv_len = str(path), keep
            for rollout, sha in saving:
                rollout.kv_sha256 = sha.result()
        return [rollout for rollout, _ in rows]

    def _generate_one(self, req: RolloutRequest, sampling: SamplingSettings) -> tuple[Rollout, KVLayers]:
        sampler = RowSampler(req.seed, sampling.temperature, sampling.top_p)
        cache, logits, _ = self._prefill(list(req.prompt_ids))
        response, top_ids, top_lps, digests, token_lps = [], [], [], [], []
        finish = "length"
        for step in range(sampling.max_new_tokens):
            logprobs = logprob_rows(logits[None, :])
            ids, lps = topk_of(logprobs, self.topk)
            top_ids.append(ids[0].tolist())
            top_lps.append(lps[0].tolist())
            digests.append(logits_digest(logits))
            token = sampler.sample(logits)
            response.append(token)
            token_lps.append(float(logprobs[0, token]))
            if token in self.eos_ids:
                finish = "eos"
                break
            if step + 1 < sampling.max_new_tokens:
                logits = self._step(torch.tensor([[token]]), cache)[0]
        rollout = Rollout(req.problem_id, list(req.prompt_ids), response, top_ids, top_lps, digests, finish,
                          rollout=req.rollout, token_logprobs=token_lps)
        return rollout, cache_layers(cache)

    def _rollout_of(self, req: RolloutRequest, tokens: list[int], top_ids, top_lps, digests, token_lps) -> Rollout:
        """A row's rollout from its sampled tokens (cut after the first end-of-sequence token) and per-step
        records (host lists, one entry per step)."""
        end = next((j for j, t in enumerate(tokens) if t in self.eos_ids), None)
        n = len(tokens) if end is None else end + 1
        return Rollout(req.problem_id, list(req.prompt_ids), tokens[:n], top_ids[:n], top_lps[:n],
                       digest_strings(digests[:n]), "length" if end is None else "eos", rollout=req.rollout,
                       token_logprobs=token_lps[:n])

    @torch.inference_mode()
    def _generate_dynamic(self, requests: list[RolloutRequest], sampling: SamplingSettings
                          ) -> list[tuple[Rollout, KVLayers]]:
        """Batched rollouts on an HF DynamicCache; finished rows leave the batch (their KV sliced out first)."""
        n, steps, k = len(requests), sampling.max_new_tokens, self.topk
        cache, logits, mask = self._prefill_batch([list(r.prompt_ids) for r in requests])
        pads = (mask.shape[1] - mask.sum(-1)).tolist()
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=self.device)
        positions = mask.sum(-1).to(self.device)
        mask = mask.to(self.device)
        dev = dict(device=self.device)
        top_ids, top_lps, digests, sampled, token_lps = self._step_records(n, steps)
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
            done = torch.isin(tokens, torch.tensor(sorted(self.eos_ids), **dev)) | (step + 1 == steps)
            if bool(done.any()):
                rows = active[done].tolist()
                host = [t[rows, :step + 1].tolist() for t in (sampled, top_ids, top_lps, digests, token_lps)]
                for slot, (row, *records) in zip(done.nonzero()[:, 0].tolist(), zip(rows, *host)):
                    rollout = self._rollout_of(requests[row], *records)
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
            logits = self._step(tokens[:, None], cache, attention_mask=mask, position_ids=positions[:, None])
            positions = positions + 1
        return out

    @torch.inference_mode()
    def _generate_static(self, requests: list[RolloutRequest], sampling: SamplingSettings
                         ) -> list[tuple[Rollout, torch.Tensor]]:
        """Batched rollouts in a static cache: the batch's prompts prefilled together, then one captured graph
        replay per step for all rows; top-k, digests and tokens stay on the device until the batch ends."""
        n, steps = len(requests), sampling.max_new_tokens
        prompts = [list(r.prompt_ids) for r in requests]
        with self.phases("prefill"):
            cache, logits, mask = self._prefill_batch(prompts)
            longest = mask.shape[1]
            records = self._step_records(n, steps)
            seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=self.device)
            top_ids, top_lps, digests, sampled, token_lps = records
            logprobs = logprob_rows(logits)
            top_ids[:, 0], top_lps[:, 0] = topk_of(logprobs, self.topk)
            digests[:, 0] = digest_rows(logits)
            sampled[:, 0] = sample_rows(logits, seeds, torch.zeros_like(seeds), sampling.temperature,
                                        sampling.top_p)
            token_lps[:, 0] = token_logprob_of(logprobs, sampled[:, 0])
            del logprobs
            stacked = stack_layers(cache_layers(cache))
            layers = [stacked[:, :, r:r + 1, :, longest - len(p):] for r, p in enumerate(prompts)]
        with self.phases("load states"):
            # not compiled: a rollout job decodes one batch, and compiling the layer body costs seconds in every
            # job, more than a short decode takes (docs/performance.md). No pass needs the rollouts' kernels:
            # exact resumes from the stored KV, whatever computed it.
            decoder = self._decoder(n, bucket(longest + steps + 1), compiled=False)
            decoder.load(layers, [len(p) for p in prompts], list(range(n)), [r.seed for r in requests],
                         sampled[:, 0].tolist(), (sampling.temperature, sampling.top_p))
            del cache, layers, stacked
            decoder.step_no.fill_(1)  # token 0 came from the prefill: the decode samples steps 1, 2, ...
        last, host = self._record_steps(decoder, records, range(1, steps), n, before=0)
        rollouts = [self._rollout_of(req, *rec) for req, *rec in zip(requests, *host)]
        # Each row's KV stays a view of the decoder's buffer, which no other batch touches before the rows are
        # stored: storing copies to the host only the positions a row's pivots need (``keep_len``), a fifth of the
        # buffer at the 7B shape, since copying the whole buffer to pageable host memory is slow at that size.
        return [(r, decoder.kv[:, :, row:row + 1, :, longest - len(r.prompt_ids):longest + len(r.response_ids) - 1])
                for row, r in enumerate(rollouts)]

    @torch.inference_mode()
    def _generate_aligned(self, requests: list[RolloutRequest], sampling: SamplingSettings
                          ) -> list[tuple[Rollout, torch.Tensor]]:
        """Invariant rollouts of at most ``invariant_rows`` requests: the prompts fed by decode steps, then one
        step per token; a row's KV is slots [0, n) of the decoder, its own positions."""
        n, steps = len(requests), sampling.max_new_tokens
        prompts = [list(r.prompt_ids) for r in requests]
        decoder = self._aligned()
        decoder.check_fits(max(map(len, prompts)) - 1 + steps)
        with self.phases("prefill"):
            decoder.prefill(prompts)
            decoder.start([len(p) - 1 for p in prompts], [p[-1] for p in prompts], [r.seed for r in requests],
                          (sampling.temperature, sampling.top_p))
        last, host = self._record_steps(decoder, self._step_records(decoder.rows, steps), range(steps), n)
        with self.phases("results to host"):
            # a copy also on a CPU (.cpu() would alias the decoder, which the next chunk overwrites)
            kv = decoder.kv[:, :, :n, :, :max(map(len, prompts)) + last].to("cpu", copy=True)
        rollouts = [self._rollout_of(req, *rec) for req, *rec in zip(requests, *host)]
        return [(r, kv[:, :, row:row + 1, :, :len(r.prompt_ids) + len(r.response_ids) - 1])
                for row, r in enumerate(rollouts)]

    def _step_records(self, rows: int, steps: int) -> tuple[torch.Tensor, ...]:
        """Device buffers of a rollout batch's per-step records: top-k ids, top-k log-probs, digests, tokens, the
        tokens' own log-probs."""
        dev = dict(device=self.device)
        return (torch.zeros(rows, steps, self.topk, dtype=torch.int64, **dev),
                torch.zeros(rows, steps, self.topk, dtype=torch.float32, **dev),
                torch.zeros(rows, steps, 2, dtype=torch.int64, **dev),
                torch.zeros(rows, steps, dtype=torch.int64, **dev),
                torch.zeros(rows, steps, dtype=torch.float32, **dev))

    def _record_steps(self, decoder: StaticDecoder, records: tuple[torch.Tensor, ...], steps: range, n: int,
                      before: int = -1) -> tuple[int, list]:
        """Decode rollout ``steps`` until the first ``n`` rows have all ended, recording every step on the
        device; returns the last step run and those rows' records on the host (tokens, top-k ids, top-k
        log-probs, digests, the tokens' log-probs: the argument order of ``_rollout_of``)."""
        top_ids, top_lps, digests, sampled, token_lps = records
        eos = torch.tensor(sorted(self.eos_ids), device=self.device)

        def record(step: int) -> bool:
            logits, tokens = decoder.step()
            logprobs = logprob_rows(logits)
            top_ids[:, step], top_lps[:, step] = topk_of(logprobs, self.topk)
            digests[:, step] = digest_rows(logits)
            sampled[:, step] = tokens
            token_lps[:, step] = token_logprob_of(logprobs, tokens)
            return step % 16 == 15 and bool(torch.isin(sampled[:n, :step + 1], eos).any(dim=1).all())

        last = self._run_steps(decoder, steps, record, before=before)
        with self.phases("results to host"):
            return last, [t[:n, :last + 1].tolist() for t in (sampled, top_ids, top_lps, digests, token_lps)]
