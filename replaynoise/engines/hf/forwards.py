"""What every decode mode of the HF engine computes with: the model's forwards (one step, a one-prompt, batched or
scored prefill), the static decoders and their step loop, the re-step channel, the dynamic continuation and the
per-step records of a rollout batch.

The modes (``engines.hf.modes``) choose among these; the engine (``engines.hf.engine``) chooses the mode. Nothing
here knows which mode runs: where modes differ in how a shared routine runs (one row at a time, no padding
inputs), they say so by argument.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch.nn.attention import sdpa_kernel
from transformers import DynamicCache

from replaynoise.engines.base import ContinuationRequest, ContinuationResult, SamplingSettings
from replaynoise.engines.hf.kernels import EAGER_ATTENTION
from replaynoise.engines.hf.kvfiles import stack_layers
from replaynoise.engines.hf.refill import CHECK_EVERY, Refill
from replaynoise.engines.hf.states import (
    PrefixState,
    StoredKV,
    cache_layers,
    left_padded,
    left_padded_cache,
    zero_padding,
)
from replaynoise.engines.hf.static import RefillDecoder, StaticDecoder
from replaynoise.engines.sampling import (
    digest_rows,
    digest_strings,
    logprob_rows,
    prefix_scores,
    sample_rows,
    token_logprob_of,
    topk_of,
    topk_rows,
)
from replaynoise.progress import Phases

#: static decoders kept built at once (a pass's shape and the rollouts'; each holds a KV buffer)
KEPT_DECODERS = 2


class Forwards:
    """The model on its device and the engine's per-run state: the stored KV kept for a pass, the phase timer,
    the built static decoders and the model's copies in other dtypes (precision controls)."""

    def __init__(
        self, model, *, eos_ids: set[int], topk: int, graphs: bool, attention: str, cache_gib: float | None
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.eos_ids = eos_ids
        self.topk = topk
        self.graphs = graphs  # CUDA graphs for the static decode (off: each step eager, to compare against)
        self.attention = attention
        # Stored KV files stay on the device for the pass, within a byte budget (the rows of one pivot are spread
        # over many batches by the schedule): 8 GiB on a GPU, 1 GiB on a CPU.
        self.stored = StoredKV(
            self.device, int((cache_gib if cache_gib is not None else 8 if self.device.type == "cuda" else 1) * 2**30)
        )
        self.phases = Phases(torch.cuda.synchronize if self.device.type == "cuda" else None)
        self.decoders: OrderedDict[tuple[type, int, int, bool], StaticDecoder] = OrderedDict()
        self._copies: dict[str, torch.nn.Module] = {}

    # ----------------------------------------------------------------------------------------- forwards
    @torch.inference_mode()
    def step(
        self, ids: torch.Tensor, cache: DynamicCache, model: torch.nn.Module | None = None, **kwargs
    ) -> torch.Tensor:
        """One forward (of ``model``, default the engine's); returns float32 logits of the last position of every
        row, on the model's device (sampling noise, digests and top-k are computed there, so a GPU never copies a
        vocabulary per row and step)."""
        with sdpa_kernel(EAGER_ATTENTION):
            out = (model or self.model)(
                input_ids=ids.to(self.device), past_key_values=cache, use_cache=True, logits_to_keep=1, **kwargs
            )
        return out.logits[:, -1, :].to(torch.float32)

    def model_in(self, dtype: str) -> torch.nn.Module:
        """The model with its weights cast to ``dtype`` (a copy, made once; the engine's own where it is in that
        dtype already): the precision controls compute a prefix or a continuation at another precision."""
        if getattr(torch, dtype) == self.model.dtype:
            return self.model
        if dtype not in self._copies:
            self._copies[dtype] = copy.deepcopy(self.model).to(getattr(torch, dtype)).eval()
        return self._copies[dtype]

    def prefill(self, ids: list[int]) -> tuple[DynamicCache, torch.Tensor]:
        """KV and last logits of one prompt in one forward."""
        cache = DynamicCache()
        return cache, self.step(torch.tensor([ids]), cache)[0]

    def prefill_by_token(
        self, ids: list[int], score_from: int | None = None
    ) -> tuple[DynamicCache, torch.Tensor, list[float] | None]:
        """KV and last logits of one prompt fed one token per forward, as its decode would see it; with
        ``score_from``, the log-probs its steps give tokens ``ids[score_from:]`` as well."""
        cache = DynamicCache()
        scores = [] if score_from is not None else None
        logits = None
        for at, tok in enumerate(ids):
            if scores is not None and at >= max(score_from, 1):
                scores.append(float(token_logprob_of(logprob_rows(logits), torch.tensor([tok]))[0]))
            logits = self.step(torch.tensor([[tok]]), cache)
        return cache, logits[0], scores

    @torch.inference_mode()
    def prefill_batch(
        self, seqs: list[list[int]], model: torch.nn.Module | None = None
    ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """KV and last logits of many prompts in one left-padded forward, as a serving engine prefills a batch.

        Returns the cache (row r's positions start at ``pads[r]``), float32 logits [rows, vocab] on the device,
        and the padding mask [rows, longest] on the CPU."""
        ids, mask, positions = left_padded(seqs)
        cache = DynamicCache()
        logits = self.step(
            ids, cache, model, attention_mask=mask.to(self.device), position_ids=positions.to(self.device)
        )
        zero_padding(cache, mask, self.device)
        return cache, logits, mask

    @torch.inference_mode()
    def prefill_scored(
        self, seqs: list[list[int]], starts: list[int | None], model: torch.nn.Module | None = None
    ) -> tuple[DynamicCache, torch.Tensor, list]:
        """``prefill_batch``'s KV (the same forward of the decoder layers, so the same bits) and, for every row
        with a start, the log-probs that forward gives its tokens ``seq[start:]``; no last logits (a re-feed does
        not read them). Returns the cache, the padding mask and the scores (None for a row without a start)."""
        model = model or self.model
        ids, mask, positions = left_padded(seqs)
        cache = DynamicCache()
        with sdpa_kernel(EAGER_ATTENTION):
            hidden = model.base_model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                past_key_values=cache,
                use_cache=True,
            ).last_hidden_state
        zero_padding(cache, mask, self.device)
        pads = [mask.shape[1] - len(seq) for seq in seqs]
        return cache, mask, prefix_scores(model, hidden, seqs, starts, pads)

    def batched_states(
        self, seqs: list[list[int]], starts: list[int | None], model: torch.nn.Module | None = None
    ) -> tuple[list[torch.Tensor], list, torch.Tensor]:
        """Prefixes prefilled together in one batched forward (scored where a row has a start; otherwise the head
        is applied to the last position only): each row's stacked KV, its scores, and the whole padded stack."""
        if any(start is not None for start in starts):
            cache, mask, scores = self.prefill_scored(seqs, starts, model)
        else:
            (cache, _, mask), scores = self.prefill_batch(seqs, model), [None] * len(seqs)
        whole, longest = stack_layers(cache_layers(cache)).to(self.model.dtype), mask.shape[1]
        del cache
        return [whole[:, :, r : r + 1, :, longest - len(seq) :] for r, seq in enumerate(seqs)], scores, whole

    # ----------------------------------------------------------------------------------------- re-step
    def restep(self, requests: list[ContinuationRequest], states: list[PrefixState], *, alone: bool) -> None:
        """The re-step channel: re-run each pivot's last prefix token over its stored KV (all pivots of the batch
        together, or each ``alone`` in a forward of one unpadded row) and record whether the logits and the new
        KV entry reproduce the rollout's bitwise. A rollout made in a batch need not reproduce (other kernels'
        reduction order), so this measures batch variance; it does not decide which state is used."""
        groups = [[i] for i in range(len(states))] if alone else [list(range(len(states)))]
        for group in groups:
            shorter = [
                PrefixState(None, states[i].length - 1, True, None, kv=states[i].kv[..., :-1, :])
                if states[i].kv is not None
                else PrefixState(
                    [(k[..., :-1, :], v[..., :-1, :]) for k, v in states[i].layers], states[i].length - 1, True, None
                )
                for i in group
            ]
            cache, mask = left_padded_cache(shorter)
            mask = torch.cat([mask, torch.ones(len(group), 1, dtype=mask.dtype)], dim=1)
            kwargs = (
                {}
                if alone
                else {
                    "attention_mask": mask.to(self.device),
                    "position_ids": torch.tensor([[s.length] for s in shorter], device=self.device),
                }
            )
            last = torch.tensor([[requests[i].prefix_ids[-1]] for i in group])
            logits = self.step(last, cache, **kwargs)
            digests = digest_strings(digest_rows(logits))
            new = torch.stack([torch.stack((layer.keys[:, :, -1], layer.values[:, :, -1])) for layer in cache.layers])
            old = torch.stack(
                [
                    torch.stack([torch.stack((k[0, :, -1], v[0, :, -1])) for k, v in states[i].per_layer()])
                    if states[i].kv is None
                    else states[i].kv[:, :, 0, :, -1]
                    for i in group
                ],
                dim=2,
            )
            same_kv = (new == old).flatten(3).all(-1).all(1).all(0).tolist()  # [L, 2, rows, ...] -> [rows]
            for slot, i in enumerate(group):
                states[i].restep_match = same_kv[slot] and digests[slot] == requests[i].expected_digest

    # ----------------------------------------------------------------------------------------- continuations
    def result(
        self, req: ContinuationRequest, tokens: list[int], finish: str, state: PrefixState, first: tuple
    ) -> ContinuationResult:
        """One row's result; the re-step outcome only on rows that asked for it (once per pivot and pass)."""
        return ContinuationResult(
            tokens,
            finish,
            state.verified,
            state.length,
            first[0],
            first[1],
            first[2],
            state.kv_maxdiff,
            cached_tokens=state.cached,
            expected_cached_tokens=state.expected,
            restep_match=state.restep_match if req.restep else None,
            prefix_logprobs=state.token_logprobs if req.restep else None,
        )

    def first_steps(self, logits: torch.Tensor) -> tuple[list, list, list[str]]:
        """Top-k and digest of every row's first continuation step, computed on the device, copied once."""
        ids, values = topk_rows(logits, self.topk)
        return ids.tolist(), values.tolist(), digest_strings(digest_rows(logits))

    @torch.inference_mode()
    def continue_dynamic(
        self,
        requests: list[ContinuationRequest],
        states: list[PrefixState],
        sampling: SamplingSettings,
        model: torch.nn.Module | None = None,
        *,
        padded: bool = True,
    ) -> list[ContinuationResult]:
        """Decode all rows together from their prefix states on an HF DynamicCache; finished rows leave the batch.
        ``padded=False``: a batch of one row, run without padding inputs (the invariant forward)."""
        n = len(requests)
        cache, mask = left_padded_cache(states)
        seeds = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=self.device)
        positions = torch.tensor([s.length for s in states])
        tokens = torch.tensor([r.branch_token for r in requests])
        active = list(range(n))  # original row index of every row still in the batch
        generated: list[list[int]] = [[] for _ in range(n)]
        finish = ["length"] * n
        first = None
        for step in range(sampling.max_new_tokens):
            mask = torch.cat([mask, torch.ones(len(active), 1, dtype=mask.dtype)], dim=1)
            kwargs = (
                {}
                if not padded
                else {"attention_mask": mask.to(self.device), "position_ids": positions[:, None].to(self.device)}
            )
            logits = self.step(tokens[:, None], cache, model, **kwargs)
            if step == 0:
                first = self.first_steps(logits)
            keep = []
            sampled = sample_rows(
                logits,
                seeds[active],
                torch.full((len(active),), step, dtype=torch.int64, device=self.device),
                sampling.temperature,
                sampling.top_p,
            ).tolist()
            for slot, row in enumerate(active):
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
        return [
            self.result(requests[i], generated[i], finish[i], states[i], tuple(f[i] for f in first)) for i in range(n)
        ]

    # ----------------------------------------------------------------------------------------- static decoders
    def decoder(
        self, rows: int, length: int, compiled: bool = True, kind: type[StaticDecoder] = StaticDecoder
    ) -> StaticDecoder:
        """The static decoder of this kind and shape, built on first use; the least recently used goes beyond
        ``KEPT_DECODERS``."""
        key = (kind, rows, length, compiled)
        if key not in self.decoders:
            if len(self.decoders) >= KEPT_DECODERS:
                self.decoders.popitem(last=False)
                torch.cuda.empty_cache() if self.device.type == "cuda" else None
            self.decoders[key] = kind(
                self.model, rows, length, graphs=self.graphs, attention=self.attention, compiled=compiled
            )
        self.decoders.move_to_end(key)
        return self.decoders[key]

    def run_steps(self, decoder: StaticDecoder, steps: range, step_fn, before: int = -1) -> int:
        """Run ``step_fn(step)`` over ``steps`` until it returns True (all rows finished); returns the last step
        run (``before`` if none). A new decoder's first steps (kernel compilation, graph capture) are timed as
        their own phase, apart from the steady decode."""
        todo, last = iter(steps), before  # lazily: a refilled decode's bound is large and never reached
        while decoder.graphs and decoder.graph is None and (step := next(todo, None)) is not None:
            with self.phases("compile and capture"):
                last = step
                if step_fn(last):
                    return last
        with self.phases("decode"):
            ran = 0
            for last in todo:
                ran += 1
                if step_fn(last):
                    break
        self.phases.count("decode", ran)
        return last

    def decode_rows(
        self, decoder: StaticDecoder, requests: list[ContinuationRequest], states: list[PrefixState], steps: int
    ) -> list[ContinuationResult]:
        """Run a loaded decoder for the first ``len(requests)`` rows; a row's tokens after its end-of-sequence
        token are dropped. Checks for all-finished only every few steps (each check syncs)."""
        n = len(requests)
        out = torch.empty(decoder.rows, steps, dtype=torch.int64, device=self.device)
        eos = torch.tensor(sorted(self.eos_ids), device=self.device)
        first = []

        def record(step: int) -> bool:
            logits, tokens = decoder.step()
            if step == 0:
                first.extend((*topk_rows(logits, self.topk), digest_rows(logits)))
            out[:, step] = tokens
            return (
                step + 1 < steps
                and step % CHECK_EVERY == CHECK_EVERY - 1
                and bool(torch.isin(out[:n, : step + 1], eos).any(dim=1).all())
            )

        step = self.run_steps(decoder, range(steps), record)
        with self.phases("results to host"):
            out = out[:n, : step + 1].cpu().tolist()
            firsts = (first[0][:n].tolist(), first[1][:n].tolist(), digest_strings(first[2][:n]))
        results = []
        for i, (req, row, s) in enumerate(zip(requests, out, states)):
            end = next((j for j, t in enumerate(row) if t in self.eos_ids), None)
            tokens_i, finish = (row[: end + 1], "eos") if end is not None else (row, "length")
            results.append(self.result(req, tokens_i, finish, s, tuple(f[i] for f in firsts)))
        return results

    def decode_refilled(
        self, decoder: RefillDecoder, requests: list[ContinuationRequest], states: list[PrefixState], steps: int
    ) -> list[ContinuationResult]:
        """Decode more requests than the decoder has rows (``Refill``)."""
        refill = Refill(decoder, requests, states, steps, self.eos_ids, self.topk)
        with self.phases("load states"):
            refill.admit(list(range(decoder.rows)))
        # a request holds a row for fewer than steps + CHECK_EVERY steps, and some request holds one at every step
        # until all have ended: the bound is never reached
        self.run_steps(decoder, range(len(requests) * (steps + CHECK_EVERY)), refill.record)
        with self.phases("results to host"):
            firsts = refill.firsts()
        return [
            self.result(req, refill.generated[i], refill.finish[i], states[i], firsts[i])
            for i, req in enumerate(requests)
        ]

    # ----------------------------------------------------------------------------------------- rollout records
    def record_steps(
        self, decoder: StaticDecoder, records: tuple[torch.Tensor, ...], steps: range, n: int, before: int = -1
    ) -> tuple[int, list]:
        """Decode rollout ``steps`` until the first ``n`` rows have all ended, recording every step on the
        device; returns the last step run and those rows' records on the host (tokens, top-k ids, top-k
        log-probs, digests, the tokens' log-probs: the argument order of ``records.rollout_of``)."""
        top_ids, top_lps, digests, sampled, token_lps = records
        eos = torch.tensor(sorted(self.eos_ids), device=self.device)

        def record(step: int) -> bool:
            logits, tokens = decoder.step()
            logprobs = logprob_rows(logits)
            top_ids[:, step], top_lps[:, step] = topk_of(logprobs, self.topk)
            digests[:, step] = digest_rows(logits)
            sampled[:, step] = tokens
            token_lps[:, step] = token_logprob_of(logprobs, tokens)
            ended = step % CHECK_EVERY == CHECK_EVERY - 1
            return ended and bool(torch.isin(sampled[:n, : step + 1], eos).any(dim=1).all())

        last = self.run_steps(decoder, steps, record, before=before)
        with self.phases("results to host"):
            return last, [t[:n, : last + 1].tolist() for t in (sampled, top_ids, top_lps, digests, token_lps)]
