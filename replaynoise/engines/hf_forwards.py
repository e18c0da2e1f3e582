"""What every decode mode of the HF engine computes with: the model's forwards (one step, a one-prompt, batched or
scored prefill), the static decoders and their step loop, the re-step channel, the dynamic continuation and the
per-step records of a rollout batch.

The modes (``hf_modes``) choose among these; the engine (``hf``) chooses the mode. Nothing here knows which mode
runs: where modes differ in how a shared routine runs (one row at a time, no padding inputs), they say so by
argument.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from replaynoise.engines.base import ContinuationRequest, ContinuationResult, Rollout, RolloutRequest, SamplingSettings
from replaynoise.engines.kvfiles import stack_layers
from replaynoise.engines.sampling import (
    digest_rows,
    digest_strings,
    logprob_rows,
    sample_rows,
    token_logprob_of,
    topk_of,
    topk_rows,
)
from replaynoise.engines.states import PrefixState, StoredKV, cache_layers, left_padded_cache
from replaynoise.engines.static import StaticDecoder
from replaynoise.progress import Phases

#: Attention backends of the HF forwards (prefills, re-steps, dynamic decode). cuDNN's is left out: it builds an
#: execution plan for every new shape, 1.8 ms of host time per layer and forward on an H200 (measured,
#: benchmarks/profile_pass.py), and nearly every batch of a pass has shapes of its own. CPUs never use it.
EAGER_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: prefix positions whose next-token log-probs one head GEMM computes at a time (``_prefix_scores``): a batch's
#: prefixes never hold [rows, length, vocab] logits at once (Qwen's 151,936-token vocabulary: 0.6 MB a position)
SCORE_CHUNK = 256
#: static decoders kept built at once (a pass's shape and the rollouts'; each holds a KV buffer)
KEPT_DECODERS = 2


class Forwards:
    """The model on its device and the engine's per-run state: the stored KV kept for a pass, the phase timer,
    the built static decoders and the model's copies in other dtypes (precision controls)."""

    def __init__(self, model, *, eos_ids: set[int], topk: int, graphs: bool, attention: str,
                 cache_gib: float | None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.eos_ids = eos_ids
        self.topk = topk
        self.graphs = graphs  # CUDA graphs for the static decode (off: each step eager, to compare against)
        self.attention = attention
        # Stored KV files stay on the device for the pass, within a byte budget (the rows of one pivot are spread
        # over many batches by the schedule): 8 GiB on a GPU, 1 GiB on a CPU.
        self.stored = StoredKV(self.device, int((cache_gib if cache_gib is not None else
                                                 8 if self.device.type == "cuda" else 1) * 2**30))
        self.phases = Phases(torch.cuda.synchronize if self.device.type == "cuda" else None)
        self.decoders: OrderedDict[tuple[int, int, bool], StaticDecoder] = OrderedDict()
        self._copies: dict[str, torch.nn.Module] = {}

    # ----------------------------------------------------------------------------------------- forwards
    @torch.inference_mode()
    def step(self, ids: torch.Tensor, cache: DynamicCache, model: torch.nn.Module | None = None,
             **kwargs) -> torch.Tensor:
        """One forward (of ``model``, default the engine's); returns float32 logits of the last position of every
        row, on the model's device (sampling noise, digests and top-k are computed there, so a GPU never copies a
        vocabulary per row and step)."""
        with sdpa_kernel(EAGER_ATTENTION):
            out = (model or self.model)(input_ids=ids.to(self.device), past_key_values=cache, use_cache=True,
                                        logits_to_keep=1, **kwargs)
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

    def prefill_by_token(self, ids: list[int], score_from: int | None = None
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
    def prefill_batch(self, seqs: list[list[int]], model: torch.nn.Module | None = None
                      ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """KV and last logits of many prompts in one left-padded forward, as a serving engine prefills a batch.

        Returns the cache (row r's positions start at ``pads[r]``), float32 logits [rows, vocab] on the device,
        and the padding mask [rows, longest] on the CPU."""
        ids, mask, positions = _left_padded(seqs)
        cache = DynamicCache()
        logits = self.step(ids, cache, model, attention_mask=mask.to(self.device),
                           position_ids=positions.to(self.device))
        _zero_padding(cache, mask, self.device)
        return cache, logits, mask

    @torch.inference_mode()
    def prefill_scored(self, seqs: list[list[int]], starts: list[int | None],
                       model: torch.nn.Module | None = None) -> tuple[DynamicCache, torch.Tensor, list]:
        """``prefill_batch``'s KV (the same forward of the decoder layers, so the same bits) and, for every row
        with a start, the log-probs that forward gives its tokens ``seq[start:]``; no last logits (a re-feed does
        not read them). Returns the cache, the padding mask and the scores (None for a row without a start)."""
        model = model or self.model
        ids, mask, positions = _left_padded(seqs)
        cache = DynamicCache()
        with sdpa_kernel(EAGER_ATTENTION):
            hidden = model.base_model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      position_ids=positions.to(self.device), past_key_values=cache,
                                      use_cache=True).last_hidden_state
        _zero_padding(cache, mask, self.device)
        pads = [mask.shape[1] - len(seq) for seq in seqs]
        return cache, mask, _prefix_scores(model, hidden, seqs, starts, pads)

    def batched_states(self, seqs: list[list[int]], starts: list[int | None], model: torch.nn.Module | None = None
                       ) -> tuple[list[torch.Tensor], list, torch.Tensor]:
        """Prefixes prefilled together in one batched forward (scored where a row has a start; otherwise the head
        is applied to the last position only): each row's stacked KV, its scores, and the whole padded stack."""
        if any(start is not None for start in starts):
            cache, mask, scores = self.prefill_scored(seqs, starts, model)
        else:
            (cache, _, mask), scores = self.prefill_batch(seqs, model), [None] * len(seqs)
        whole, longest = stack_layers(cache_layers(cache)).to(self.model.dtype), mask.shape[1]
        del cache
        return [whole[:, :, r:r + 1, :, longest - len(seq):] for r, seq in enumerate(seqs)], scores, whole

    # ----------------------------------------------------------------------------------------- re-step
    def restep(self, requests: list[ContinuationRequest], states: list[PrefixState], *, alone: bool) -> None:
        """The re-step channel: re-run each pivot's last prefix token over its stored KV (all pivots of the batch
        together, or each ``alone`` in a forward of one unpadded row) and record whether the logits and the new
        KV entry reproduce the rollout's bitwise. A rollout made in a batch need not reproduce (other kernels'
        reduction order), so this measures batch variance; it does not decide which state is used."""
        groups = [[i] for i in range(len(states))] if alone else [list(range(len(states)))]
        for group in groups:
            shorter = [PrefixState(None, states[i].length - 1, True, None, kv=states[i].kv[..., :-1, :])
                       if states[i].kv is not None else
                       PrefixState([(k[..., :-1, :], v[..., :-1, :]) for k, v in states[i].layers],
                                   states[i].length - 1, True, None) for i in group]
            cache, mask = left_padded_cache(shorter)
            mask = torch.cat([mask, torch.ones(len(group), 1, dtype=mask.dtype)], dim=1)
            kwargs = {} if alone else {
                "attention_mask": mask.to(self.device),
                "position_ids": torch.tensor([[s.length] for s in shorter], device=self.device)}
            last = torch.tensor([[requests[i].prefix_ids[-1]] for i in group])
            logits = self.step(last, cache, **kwargs)
            digests = digest_strings(digest_rows(logits))
            new = torch.stack([torch.stack((layer.keys[:, :, -1], layer.values[:, :, -1])) for layer in cache.layers])
            old = torch.stack([torch.stack([torch.stack((k[0, :, -1], v[0, :, -1])) for k, v in states[i].per_layer()])
                               if states[i].kv is None else states[i].kv[:, :, 0, :, -1] for i in group], dim=2)
            same_kv = (new == old).flatten(3).all(-1).all(1).all(0).tolist()  # [L, 2, rows, ...] -> [rows]
            for slot, i in enumerate(group):
                states[i].restep_match = same_kv[slot] and digests[slot] == requests[i].expected_digest

    # ----------------------------------------------------------------------------------------- continuations
    def result(self, req: ContinuationRequest, tokens: list[int], finish: str, state: PrefixState,
               first: tuple) -> ContinuationResult:
        """One row's result; the re-step outcome only on rows that asked for it (once per pivot and pass)."""
        return ContinuationResult(tokens, finish, state.verified, state.length, first[0], first[1], first[2],
                                  state.kv_maxdiff, cached_tokens=state.cached, expected_cached_tokens=state.expected,
                                  restep_match=state.restep_match if req.restep else None,
                                  prefix_logprobs=state.token_logprobs if req.restep else None)

    def first_steps(self, logits: torch.Tensor) -> tuple[list, list, list[str]]:
        """Top-k and digest of every row's first continuation step, computed on the device, copied once."""
        ids, values = topk_rows(logits, self.topk)
        return ids.tolist(), values.tolist(), digest_strings(digest_rows(logits))

    @torch.inference_mode()
    def continue_dynamic(self, requests: list[ContinuationRequest], states: list[PrefixState],
                         sampling: SamplingSettings, model: torch.nn.Module | None = None, *,
                         padded: bool = True) -> list[ContinuationResult]:
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
            kwargs = {} if not padded else {
                "attention_mask": mask.to(self.device), "position_ids": positions[:, None].to(self.device)}
            logits = self.step(tokens[:, None], cache, model, **kwargs)
            if step == 0:
                first = self.first_steps(logits)
            keep = []
            sampled = sample_rows(logits, seeds[active], torch.full((len(active),), step, dtype=torch.int64,
                                                                    device=self.device),
                                  sampling.temperature, sampling.top_p).tolist()
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
        return [self.result(requests[i], generated[i], finish[i], states[i], tuple(f[i] for f in first))
                for i in range(n)]

    # ----------------------------------------------------------------------------------------- static decoders
    def decoder(self, rows: int, length: int, compiled: bool = True) -> StaticDecoder:
        """The static decoder of this shape, built on first use; the least recently used goes beyond
        ``KEPT_DECODERS``."""
        key = (rows, length, compiled)
        if key not in self.decoders:
            if len(self.decoders) >= KEPT_DECODERS:
                self.decoders.popitem(last=False)
                torch.cuda.empty_cache() if self.device.type == "cuda" else None
            self.decoders[key] = StaticDecoder(self.model, rows, length, graphs=self.graphs,
                                               attention=self.attention, compiled=compiled)
        self.decoders.move_to_end(key)
        return self.decoders[key]

    def run_steps(self, decoder: StaticDecoder, steps: range, step_fn, before: int = -1) -> int:
        """Run ``step_fn(step)`` over ``steps`` until it returns True (all rows finished); returns the last step
        run (``before`` if none). A new decoder's first steps (kernel compilation, graph capture) are timed as
        their own phase, apart from the steady decode."""
        todo, last = list(steps), before
        while todo and decoder.graphs and decoder.graph is None:
            with self.phases("compile and capture"):
                last = todo.pop(0)
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

    def decode_rows(self, decoder: StaticDecoder, requests: list[ContinuationRequest], states: list[PrefixState],
                    steps: int) -> list[ContinuationResult]:
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
            return (step + 1 < steps and step % 16 == 15
                    and bool(torch.isin(out[:n, :step + 1], eos).any(dim=1).all()))

        step = self.run_steps(decoder, range(steps), record)
        with self.phases("results to host"):
            out = out[:n, :step + 1].cpu().tolist()
            firsts = (first[0][:n].tolist(), first[1][:n].tolist(), digest_strings(first[2][:n]))
        results = []
        for i, (req, row, s) in enumerate(zip(requests, out, states)):
            end = next((j for j, t in enumerate(row) if t in self.eos_ids), None)
            tokens_i, finish = (row[:end + 1], "eos") if end is not None else (row, "length")
            results.append(self.result(req, tokens_i, finish, s, tuple(f[i] for f in firsts)))
        return results

    # ----------------------------------------------------------------------------------------- rollout records
    def rollout_of(self, req: RolloutRequest, tokens: list[int], top_ids, top_lps, digests, token_lps) -> Rollout:
        """A row's rollout from its sampled tokens (cut after the first end-of-sequence token) and per-step
        records (host lists, one entry per step)."""
        end = next((j for j, t in enumerate(tokens) if t in self.eos_ids), None)
        n = len(tokens) if end is None else end + 1
        return Rollout(req.problem_id, list(req.prompt_ids), tokens[:n], top_ids[:n], top_lps[:n],
                       digest_strings(digests[:n]), "length" if end is None else "eos", rollout=req.rollout,
                       token_logprobs=token_lps[:n])

    def step_records(self, rows: int, steps: int) -> tuple[torch.Tensor, ...]:
        """Device buffers of a rollout batch's per-step records: top-k ids, top-k log-probs, digests, tokens, the
        tokens' own log-probs."""
        dev = dict(device=self.device)
        return (torch.zeros(rows, steps, self.topk, dtype=torch.int64, **dev),
                torch.zeros(rows, steps, self.topk, dtype=torch.float32, **dev),
                torch.zeros(rows, steps, 2, dtype=torch.int64, **dev),
                torch.zeros(rows, steps, dtype=torch.int64, **dev),
                torch.zeros(rows, steps, dtype=torch.float32, **dev))

    def record_steps(self, decoder: StaticDecoder, records: tuple[torch.Tensor, ...], steps: range, n: int,
                     before: int = -1) -> tuple[int, list]:
        """Decode rollout ``steps`` until the first ``n`` rows have all ended, recording every step on the
        device; returns the last step run and those rows' records on the host (tokens, top-k ids, top-k
        log-probs, digests, the tokens' log-probs: the argument order of ``rollout_of``)."""
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

        last = self.run_steps(decoder, steps, record, before=before)
        with self.phases("results to host"):
            return last, [t[:n, :last + 1].tolist() for t in (sampled, top_ids, top_lps, digests, token_lps)]


def _prefix_scores(model: torch.nn.Module, hidden: torch.Tensor, seqs: list[list[int]],
                   starts: list[int | None], pads: list[int]) -> list[list[float] | None]:
    """Each scored row's tokens' log-probs from the hidden states of its prefill: the head applied to
    ``SCORE_CHUNK`` positions at a time, only the target token's log-prob kept, one host copy at the end."""
    rows, cols, targets = [], [], []
    for row, (seq, start) in enumerate(zip(seqs, starts)):
        if start is not None:
            for j in range(max(start, 1), len(seq)):
                rows.append(row), cols.append(pads[row] + j - 1), targets.append(seq[j])
    if not rows:
        return [None if start is None else [] for start in starts]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    index = (torch.tensor(rows, device=hidden.device), torch.tensor(cols, device=hidden.device))
    target = torch.tensor(targets, device=hidden.device)
    out = torch.empty(len(rows), dtype=torch.float32, device=hidden.device)
    for lo in range(0, len(rows), SCORE_CHUNK):
        part = slice(lo, lo + SCORE_CHUNK)
        logits = model.lm_head(hidden[index[0][part], index[1][part]]).to(torch.float32)
        if softcap is not None:  # Gemma's final soft cap, as its forward applies it
            logits = torch.tanh(logits / softcap) * softcap
        out[part] = token_logprob_of(logprob_rows(logits), target[part])
    values, scores, at = out.tolist(), [], 0
    for seq, start in zip(seqs, starts):
        n = 0 if start is None else len(seq) - max(start, 1)
        scores.append(None if start is None else values[at:at + n])
        at += n
    return scores


def _left_padded(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [rows, longest] left-padded with 0, the padding mask and the positions of a batched prefill."""
    longest = max(map(len, seqs))
    ids = torch.zeros(len(seqs), longest, dtype=torch.int64)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, longest - len(seq):] = torch.tensor(seq)
        mask[row, longest - len(seq):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _zero_padding(cache: DynamicCache, mask: torch.Tensor, device: torch.device) -> None:
    """Padding's KV is masked out, but 0 * NaN would not be: make it zero."""
    padding = (mask == 0).to(device)[:, None, :, None]
    for layer in cache.layers:
        if layer.keys.shape[-2] != padding.shape[2]:
            continue  # a sliding-window layer that kept only its window
        layer.keys.masked_fill_(padding, 0)
        layer.values.masked_fill_(padding, 0)
