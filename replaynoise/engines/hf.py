"""The HF transformers engine: the reference engine, on CPU or GPU.

Two kernel modes:
- ``stock``: the prompt is prefilled in one forward, continuation rows from many pivots share padded batches
  and finished rows leave the batch, as in a serving engine. Batch composition then moves the numbers.
- ``invariant``: no result may depend on batching or on prefill versus decode, so all passes must agree
  bitwise. With static decode (``decode: auto`` on CUDA, Llama/Qwen2 families) every forward computes one token
  per row in one fixed [rows, slots] shape with position p in slot p (``AlignedDecoder``: batched, at close to
  stock speed); otherwise every forward computes one token of one row, prompt included.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from dataclasses import replace

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import DynamicCache

from replaynoise.engines.base import (
    ContinuationRequest,
    ContinuationResult,
    PrefixSource,
    SamplingSettings,
    VerificationError,
    scored_from,
)
from replaynoise.engines.cpu_matmul import use_fp32_matmul
from replaynoise.engines.hf_rollouts import HFRollouts
from replaynoise.engines.kernels import static_attention, static_decode_supported
from replaynoise.engines.kvfiles import stack_layers
from replaynoise.engines.sampling import (
    digest_rows,
    digest_strings,
    logprob_rows,
    sample_rows,
    token_logprob_of,
    topk_rows,
)
from replaynoise.engines.states import (
    PrefixState,
    StoredKV,
    bucket,
    cache_layers,
    left_padded_cache,
    row_bucket,
    transplant,
)
from replaynoise.engines.static import AlignedDecoder, StaticDecoder
from replaynoise.models import eos_token_ids
from replaynoise.passes import as_source
from replaynoise.progress import Phases

log = logging.getLogger(__name__)

KERNEL_MODES = ("stock", "invariant")
#: ``dynamic``: HF forward with a DynamicCache, finished rows leave the batch; ``static``: preallocated KV and, on
#: CUDA, one captured graph per step with on-device sampling (rows stay until every row has finished);
#: ``auto``: static on CUDA for the model families it supports, dynamic otherwise.
DECODE_MODES = ("auto", "dynamic", "static")
#: On CPU, half-precision linear layers as float32 GEMMs (``fp32``) or with torch's own kernel (``native``).
CPU_MATMULS = ("fp32", "native")

#: Attention backends of the HF forwards (prefills, re-steps, dynamic decode). cuDNN's is left out: it builds an
#: execution plan for every new shape, 1.8 ms of host time per layer and forward on an H200 (measured,
#: benchmarks/profile_pass.py), and nearly every batch of a pass has shapes of its own. CPUs never use it.
EAGER_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
#: prefix positions whose next-token log-probs one head GEMM computes at a time (``_prefix_scores``): a batch's
#: prefixes never hold [rows, length, vocab] logits at once (Qwen's 151,936-token vocabulary: 0.6 MB a position)
SCORE_CHUNK = 256


class HFEngine(HFRollouts):
    name = "hf"

    def __init__(self, model, tokenizer, *, kernels: str = "stock", topk: int = 5, decode: str = "auto",
                 cpu_matmul: str = "fp32", cache_gib: float | None = None, invariant_rows: int = 64,
                 invariant_context: int = 1024, stop_ids: set[int] | frozenset = frozenset(),
                 graphs: bool = True) -> None:
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
        # invariant with static decode: one decoder shape for the configuration's rollouts and every pass
        self.aligned = decode == "static" and self.invariant
        self.invariant_shape = (invariant_rows, invariant_context)
        self._aligned_decoder: AlignedDecoder | None = None
        self._decoders: OrderedDict[tuple[int, int, bool], StaticDecoder] = OrderedDict()
        self._graphs = graphs  # CUDA graphs for the static decode (off: each step eager, to compare against)
        self.attention = static_attention(self.invariant)
        self.topk = topk
        self.stop_ids = set(stop_ids)  # text tokens that end a response (configs.X.stop) as the EOS ids do
        self.eos_ids = eos_token_ids(model.generation_config, tokenizer) | self.stop_ids
        # Stored KV files stay on the device for the pass, within a byte budget (the rows of one pivot are spread
        # over many batches by the schedule): 8 GiB on a GPU, 1 GiB on a CPU.
        self.stored = StoredKV(self.device, int((cache_gib if cache_gib is not None else
                                                 8 if self.device.type == "cuda" else 1) * 2**30))
        self.phases = Phases(torch.cuda.synchronize if self.device.type == "cuda" else None)
        self._copies: dict[str, torch.nn.Module] = {}  # the model in another dtype (precision controls)

    # ----------------------------------------------------------------------------------------- forwards
    @torch.inference_mode()
    def _step(self, ids: torch.Tensor, cache: DynamicCache, model: torch.nn.Module | None = None,
              **kwargs) -> torch.Tensor:
        """One forward (of ``model``, default the engine's); returns float32 logits of the last position of every
        row, on the model's device (sampling noise, digests and top-k are computed there, so a GPU never copies a
        vocabulary per row and step)."""
        with sdpa_kernel(EAGER_ATTENTION):
            out = (model or self.model)(input_ids=ids.to(self.device), past_key_values=cache, use_cache=True,
                                        logits_to_keep=1, **kwargs)
        return out.logits[:, -1, :].to(torch.float32)

    def _model_in(self, dtype: str) -> torch.nn.Module:
        """The model with its weights cast to ``dtype`` (a copy, made once; the engine's own where it is in that
        dtype already): the precision controls compute a prefix or a continuation at another precision."""
        if getattr(torch, dtype) == self.model.dtype:
            return self.model
        if dtype not in self._copies:
            self._copies[dtype] = copy.deepcopy(self.model).to(getattr(torch, dtype)).eval()
        return self._copies[dtype]

    def _prefill(self, ids: list[int], score_from: int | None = None
                 ) -> tuple[DynamicCache, torch.Tensor, list[float] | None]:
        """KV and last logits of one prompt: one forward in stock mode, one forward per token in invariant mode;
        with ``score_from`` (invariant mode), the log-probs its steps give tokens ``ids[score_from:]`` as well."""
        cache = DynamicCache()
        if score_from is not None and not self.invariant:
            raise ValueError("a one-prompt prefill scores its tokens in invariant mode only; a stock prefill is "
                             "scored by _prefill_scored")
        scores = [] if score_from is not None else None
        if self.invariant:
            logits = None
            for at, tok in enumerate(ids):
                if scores is not None and at >= max(score_from, 1):
                    scores.append(float(token_logprob_of(logprob_rows(logits), torch.tensor([tok]))[0]))
                logits = self._step(torch.tensor([[tok]]), cache)
        else:
            logits = self._step(torch.tensor([ids]), cache)
        return cache, logits[0], scores

    @torch.inference_mode()
    def _prefill_batch(self, seqs: list[list[int]], model: torch.nn.Module | None = None
                       ) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
        """KV and last logits of many prompts in one left-padded forward, as a serving engine prefills a batch.

        Returns the cache (row r's positions start at ``pads[r]``), float32 logits [rows, vocab] on the device,
        and the padding mask [rows, longest] on the CPU."""
        ids, mask, positions = _left_padded(seqs)
        cache = DynamicCache()
        logits = self._step(ids, cache, model, attention_mask=mask.to(self.device),
                            position_ids=positions.to(self.device))
        _zero_padding(cache, mask, self.device)
        return cache, logits, mask

    @torch.inference_mode()
    def _prefill_scored(self, seqs: list[list[int]], starts: list[int | None],
                        model: torch.nn.Module | None = None) -> tuple[DynamicCache, torch.Tensor, list]:
        """``_prefill_batch``'s KV (the same forward of the decoder layers, so the same bits) and, for every row
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
        return cache, mask, self._prefix_scores(model, hidden, seqs, starts, pads)

    def _prefix_scores(self, model: torch.nn.Module, hidden: torch.Tensor, seqs: list[list[int]],
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

    # ----------------------------------------------------------------------------------------- decoders
    def _aligned(self) -> AlignedDecoder:
        """The configuration's one invariant decoder (built once: its shape is fixed by the configuration)."""
        if self._aligned_decoder is None:
            rows, length = self.invariant_shape
            self._aligned_decoder = AlignedDecoder(self.model, rows, length, graphs=self._graphs,
                                                   attention=self.attention)
        return self._aligned_decoder

    # ----------------------------------------------------------------------------------------- prefix states
    def prefix_state(self, req: ContinuationRequest, source: str | PrefixSource) -> PrefixState:
        return self.prefix_states([req], source)[0]

    @torch.inference_mode()
    def prefix_states(self, requests: list[ContinuationRequest], source: str | PrefixSource) -> list[PrefixState]:
        """The prefix state of every request, built together for the batch's pivots (one batched forward for
        all their re-feed prefills or exact-state re-steps, not one batch-1 forward per pivot); for a
        transplant, the recipient's state with the donor's KV swapped into the source's layers.

        Built anew for every batch, from the batch alone: a state kept from an earlier batch would make a
        batch's numbers depend on which batches ran before it in this process, so a resumed pass would differ
        from an uninterrupted one. (The stored KV files are kept: loading is exact.)"""
        source = as_source(source)
        todo = list({req.pivot_id: req for req in requests}.values())
        wanted = {req.pivot_id for req in requests if req.restep}
        starts = [scored_from(req, source) if req.pivot_id in wanted else None for req in todo]
        with self.phases("prefix states"):
            self.stored.load_ahead([req for req in todo if req.kv_file is not None])
            built = self._states_of(source.kind, todo, source.prefix_dtype, starts)
            if source.donor is not None:
                donors = self._states_of(source.donor, todo)
                built = self.stored.drift(todo, [transplant(req, mine, theirs, source.layers) for req, mine, theirs
                                           in zip(todo, built, donors)])
        if source.kind == "decode_kv" and source.donor is None:
            chosen = [i for i, req in enumerate(todo) if req.pivot_id in wanted]
            if chosen:
                with self.phases("re-step"):
                    (self._restep_aligned if self.aligned else self._restep)([todo[i] for i in chosen],
                                                                             [built[i] for i in chosen])
        by_pivot = {req.pivot_id: state for req, state in zip(todo, built)}
        return [by_pivot[req.pivot_id] for req in requests]

    def _states_of(self, kind: str, requests: list[ContinuationRequest], prefix_dtype: str | None = None,
                   starts: list[int | None] | None = None) -> list[PrefixState]:
        """The states a prefix source kind builds for these (distinct) pivots; a built prefix also scores its
        tokens from ``starts[i]`` on (``scored_from``)."""
        if kind == "decode_kv":
            return [self._decode_state(req) for req in requests]
        ids = [list(req.text_prefix_ids or req.prefix_ids) if kind == "refeed_text" else list(req.prefix_ids)
               for req in requests]
        return self._refeed_states(requests, ids, prefix_dtype, starts or [None] * len(requests))

    def _decode_state(self, req: ContinuationRequest) -> PrefixState:
        """The stored decode-time KV cropped to the pivot. It is the decode-time state when the file is the one
        recorded at capture (sha256, checked on load) and the ids it was computed from are the prefix's."""
        if req.kv_file is None:
            raise VerificationError(f"pivot {req.pivot_id}: no stored KV to resume from")
        stored, ids, stacked = self.stored.get(req.kv_file, req.kv_sha256)
        length = len(req.prefix_ids)
        if stored[0][0].shape[-2] < length:
            raise VerificationError(
                f"{req.kv_file}: holds {stored[0][0].shape[-2]} positions, pivot {req.pivot_id} needs {length}")
        same_ids = ids is None or ids[:length] == list(req.prefix_ids)
        if not same_ids:
            log.warning("pivot %s: the KV in %s was computed from other token ids than its prefix",
                        req.pivot_id, req.kv_file)
        if stacked is not None:  # views of the stacked tensor: no per-layer slicing on the hot path
            return PrefixState(None, length, same_ids, None, cached=length, expected=length,
                               kv=stacked[..., :length, :])
        return PrefixState([(k[..., :length, :], v[..., :length, :]) for k, v in stored], length, same_ids, None,
                           cached=length, expected=length)

    def _restep(self, requests: list[ContinuationRequest], states: list[PrefixState]) -> None:
        """The re-step channel: re-run each pivot's last prefix token over its stored KV (all pivots of the
        batch together; one token per forward in invariant mode) and record whether the logits and the new KV
        entry reproduce the rollout's bitwise. A rollout made in a batch need not reproduce (other kernels'
        reduction order), so this measures batch variance; it does not decide which state is used."""
        groups = [[i] for i in range(len(states))] if self.invariant else [list(range(len(states)))]
        for group in groups:
            shorter = [PrefixState(None, states[i].length - 1, True, None, kv=states[i].kv[..., :-1, :])
                       if states[i].kv is not None else
                       PrefixState([(k[..., :-1, :], v[..., :-1, :]) for k, v in states[i].layers],
                                   states[i].length - 1, True, None) for i in group]
            cache, mask = left_padded_cache(shorter)
            mask = torch.cat([mask, torch.ones(len(group), 1, dtype=mask.dtype)], dim=1)
            kwargs = {} if self.invariant else {
                "attention_mask": mask.to(self.device),
                "position_ids": torch.tensor([[s.length] for s in shorter], device=self.device)}
            last = torch.tensor([[requests[i].prefix_ids[-1]] for i in group])
            logits = self._step(last, cache, **kwargs)
            digests = digest_strings(digest_rows(logits))
            new = torch.stack([torch.stack((layer.keys[:, :, -1], layer.values[:, :, -1])) for layer in cache.layers])
            old = torch.stack([torch.stack([torch.stack((k[0, :, -1], v[0, :, -1])) for k, v in states[i].per_layer()])
                               if states[i].kv is None else states[i].kv[:, :, 0, :, -1] for i in group], dim=2)
            same_kv = (new == old).flatten(3).all(-1).all(1).all(0).tolist()  # [L, 2, rows, ...] -> [rows]
            for slot, i in enumerate(group):
                states[i].restep_match = same_kv[slot] and digests[slot] == requests[i].expected_digest

    def _restep_aligned(self, requests: list[ContinuationRequest], states: list[PrefixState]) -> None:
        """The re-step channel in the invariant decoder: each pivot's last prefix token re-run over the rest of
        its stored KV, as one eager forward of the decoder (the kernels its steps use), compared on the device."""
        decoder, rows = self._aligned(), self.invariant_shape[0]
        sampling = decoder.sampling or (1.0, 1.0)  # kept: a captured continuation graph stays valid
        for start in range(0, len(states), rows):
            group, reqs = states[start:start + rows], requests[start:start + rows]
            kvs = [s.stacked() for s in group]
            at = [s.length - 1 for s in group]
            decoder.start(at, [r.prefix_ids[-1] for r in reqs], [0] * len(group), sampling, states=kvs)
            digests = digest_strings(digest_rows(decoder.logits()[:len(group)]))
            slots = torch.arange(len(group), device=self.device)
            new = decoder.kv[:, :, slots, :, torch.tensor(at, device=self.device)]  # [rows, layers, 2, heads, dim]
            old = torch.stack([kv[:, :, 0, :, a] for kv, a in zip(kvs, at)])
            same_kv = (new == old).flatten(1).all(1).tolist()
            for slot, (req, state) in enumerate(zip(reqs, group)):
                state.restep_match = same_kv[slot] and digests[slot] == req.expected_digest

    def _refeed_states(self, requests: list[ContinuationRequest], seqs: list[list[int]], dtype: str | None,
                       starts: list[int | None]) -> list[PrefixState]:
        """Recompute the prefixes as fresh prompts, prefilled together (invariant: by the invariant decoder's steps,
        or one token of one row at a time without static decode; ``dtype``: by the model cast to it, in one
        batched forward whatever the kernels, the KV cast back to the model's dtype); where the decode KV is
        stored, record how far each moved from it (max |dKV| per layer). A row with a start keeps the log-probs
        its own prefill gave its tokens from there on (``PrefixState.token_logprobs``); a batch with none
        prefills exactly as before (the head is then applied to the last position only)."""
        padded = None  # the states as one left-padded tensor, padding zero, where a batched prefill made them
        scores: list = [None] * len(seqs)
        scoring = any(start is not None for start in starts)
        if dtype is not None or not (self.aligned or self.invariant):
            model = self._model_in(dtype) if dtype is not None else None
            if scoring:
                cache, mask, scores = self._prefill_scored(seqs, starts, model)
            else:
                cache, _, mask = self._prefill_batch(seqs, model)
            whole, longest = stack_layers(cache_layers(cache)).to(self.model.dtype), mask.shape[1]
            del cache
            stacks = [whole[:, :, r:r + 1, :, longest - len(seq):] for r, seq in enumerate(seqs)]
            padded = whole
        elif self.aligned:  # prefilled by the invariant decoder's own steps, at most invariant_rows at a time
            decoder, rows, stacks = self._aligned(), self.invariant_shape[0], []
            for start in range(0, len(seqs), rows):
                chunk = seqs[start:start + rows]
                scores[start:start + len(chunk)] = decoder.prefill(chunk, starts[start:start + rows])
                whole = decoder.kv[:, :, :len(chunk), :, :max(map(len, chunk))].clone()
                stacks.extend(whole[:, :, r:r + 1, :, :len(seq)] for r, seq in enumerate(chunk))
        else:
            stacks = []
            for row, (seq, start) in enumerate(zip(seqs, starts)):
                cache, _, scores[row] = self._prefill(seq, start)
                stacks.append(stack_layers(cache_layers(cache)))
        states = [PrefixState(None, len(seq), True, None, kv=kv, token_logprobs=score)
                  for seq, kv, score in zip(seqs, stacks, scores)]
        return self.stored.drift(requests, states, whole=padded)

    # ----------------------------------------------------------------------------------------- continuations
    @torch.inference_mode()
    def run_batch(self, requests: list[ContinuationRequest], source: str | PrefixSource,
                  sampling: SamplingSettings) -> list[ContinuationResult]:
        source = as_source(source)
        states = self.prefix_states(requests, source)
        if source.continuation_dtype is not None:  # a precision control: the model cast, states cast up
            return self._continue_in(source.continuation_dtype, requests, states, sampling)
        if self.aligned:
            rows = self.invariant_shape[0]
            return [result for start in range(0, len(requests), rows) for result in
                    self._continue_aligned(requests[start:start + rows], states[start:start + rows], sampling)]
        if self.static:
            return self._continue_static(requests, states, sampling)  # times its own phases
        with self.phases("decode"):
            if self.invariant:
                return [self._continue(reqs, sts, sampling)[0] for reqs, sts in
                        (([r], [s]) for r, s in zip(requests, states))]
            return self._continue(requests, states, sampling)

    def _continue_in(self, dtype: str, requests: list[ContinuationRequest], states: list[PrefixState],
                     sampling: SamplingSettings) -> list[ContinuationResult]:
        """Decode the continuations with the model cast to ``dtype`` from the states cast up to it (HF's own
        forward, finished rows leaving the batch; one row at a time under invariant kernels)."""
        to = getattr(torch, dtype)
        cast: dict[int, PrefixState] = {}
        for state in states:
            if id(state) not in cast:
                cast[id(state)] = (replace(state, kv=state.kv.to(to)) if state.kv is not None else
                                   replace(state, layers=[(k.to(to), v.to(to)) for k, v in state.per_layer()]))
        states = [cast[id(s)] for s in states]
        model = self._model_in(dtype)
        with self.phases("decode"):
            if self.invariant:
                return [self._continue([r], [s], sampling, model)[0] for r, s in zip(requests, states)]
            return self._continue(requests, states, sampling, model)

    def _result(self, req: ContinuationRequest, tokens: list[int], finish: str, state: PrefixState,
                first: tuple) -> ContinuationResult:
        """One row's result; the re-step outcome only on rows that asked for it (once per pivot and pass)."""
        return ContinuationResult(tokens, finish, state.verified, state.length, first[0], first[1], first[2],
                                  state.kv_maxdiff, cached_tokens=state.cached, expected_cached_tokens=state.expected,
                                  restep_match=state.restep_match if req.restep else None,
                                  prefix_logprobs=state.token_logprobs if req.restep else None)

    def _continue(self, requests: list[ContinuationRequest], states: list[PrefixState],
                  sampling: SamplingSettings, model: torch.nn.Module | None = None) -> list[ContinuationResult]:
        """Decode all rows together from their prefix states; finished rows leave the batch."""
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
            kwargs = {} if self.invariant else {
                "attention_mask": mask.to(self.device), "position_ids": positions[:, None].to(self.device)}
            logits = self._step(tokens[:, None], cache, model, **kwargs)
            if step == 0:
                first = self._first_steps(logits)
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
        return [self._result(requests[i], generated[i], finish[i], states[i], tuple(f[i] for f in first))
                for i in range(n)]

    def _first_steps(self, logits: torch.Tensor) -> tuple[list, list, list[str]]:
        """Top-k and digest of every row's first continuation step, computed on the device, copied once."""
        ids, values = topk_rows(logits, self.topk)
        return ids.tolist(), values.tolist(), digest_strings(digest_rows(logits))

    def _decoder(self, rows: int, length: int, compiled: bool = True) -> StaticDecoder:
        key = (rows, length, compiled)
        if key not in self._decoders:
            if len(self._decoders) >= 2:
                self._decoders.popitem(last=False)
                torch.cuda.empty_cache() if self.device.type == "cuda" else None
            self._decoders[key] = StaticDecoder(self.model, rows, length, graphs=self._graphs,
                                                attention=self.attention, compiled=compiled)
        self._decoders.move_to_end(key)
        return self._decoders[key]

    def _run_steps(self, decoder: StaticDecoder, steps: range, step_fn, before: int = -1) -> int:
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

    def _continue_static(self, requests: list[ContinuationRequest], states: list[PrefixState],
                         sampling: SamplingSettings) -> list[ContinuationResult]:
        """Decode all rows together in a static cache (one graph replay per step)."""
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
        with self.phases("load states"):
            decoder = self._decoder(rows, length)
            stacked = all(s.kv is not None for s in ordered)
            decoder.load([s.kv if stacked else s.per_layer() for s in ordered], [s.length for s in ordered],
                         [unique[id(s)] for s in states],
                         [r.seed for r in requests], [r.branch_token for r in requests],
                         (sampling.temperature, sampling.top_p))
        return self._decode_rows(decoder, requests[:n], states[:n], steps)

    def _continue_aligned(self, requests: list[ContinuationRequest], states: list[PrefixState],
                          sampling: SamplingSettings) -> list[ContinuationResult]:
        """Decode at most ``invariant_rows`` rows in the invariant decoder, each from its own prefix state."""
        steps = sampling.max_new_tokens
        decoder = self._aligned()
        decoder.check_fits(max(s.length for s in states) + steps)
        with self.phases("load states"):
            decoder.start([s.length for s in states], [r.branch_token for r in requests], [r.seed for r in requests],
                          (sampling.temperature, sampling.top_p),
                          states=[s.stacked() for s in states])
        return self._decode_rows(decoder, requests, states, steps)

    def _decode_rows(self, decoder: StaticDecoder, requests: list[ContinuationRequest], states: list[PrefixState],
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

        step = self._run_steps(decoder, range(steps), record)
        with self.phases("results to host"):
            out = out[:n, :step + 1].cpu().tolist()
            firsts = (first[0][:n].tolist(), first[1][:n].tolist(), digest_strings(first[2][:n]))
        results = []
        for i, (req, row, s) in enumerate(zip(requests, out, states)):
            end = next((j for j, t in enumerate(row) if t in self.eos_ids), None)
            tokens_i, finish = (row[:end + 1], "eos") if end is not None else (row, "length")
            results.append(self._result(req, tokens_i, finish, s, tuple(f[i] for f in firsts)))
        return results


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
