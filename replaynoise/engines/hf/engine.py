"""The HF transformers engine: the reference engine, on CPU or GPU.

Two kernel modes:
- ``stock``: the prompt is prefilled in one forward, continuation rows from many pivots share padded batches
  and finished rows leave the batch, as in a serving engine. Batch composition then moves the numbers.
- ``invariant``: no result may depend on batching or on prefill versus decode, so all passes must agree
  bitwise. With static decode (``decode: auto`` on CUDA, Llama/Qwen2 families) every forward computes one token
  per row in one fixed [rows, slots] shape with position p in slot p (``AlignedDecoder``: batched, at close to
  stock speed); otherwise every forward computes one token of one row, prompt included.

The engine picks one decode mode (``engines.hf.modes``) from the kernels and the decode setting, and builds prefix
states and stores rollouts' KV the same way whichever runs.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

# transformers' model machinery (modeling_utils, the auto classes and what they pull in: 10.1-10.7 s with transformers
# itself in fresh processes on a lent GPU machine's image, benchmarks/results/weight-load-2026-12-07/) loads here, in
# the job's "imports" phase; left to load_weights, which imports AutoModelForCausalLM itself, the log counted it as
# "model load", where it was taken for slow weights
from transformers import AutoModelForCausalLM, PreTrainedModel  # noqa: F401 - AutoModelForCausalLM: loaded here

from replaynoise.data.loading import eos_token_ids, load_weights, model_weights_dir, stop_token_ids
from replaynoise.engines.base import (
    ContinuationRequest,
    ContinuationResult,
    KeepLen,
    PrefixKind,
    PrefixSource,
    Rollout,
    RolloutRequest,
    SamplingSettings,
    VerificationError,
    as_source,
    scored_from,
)
from replaynoise.engines.hf.cpu_matmul import use_fp32_matmul
from replaynoise.engines.hf.forwards import Forwards
from replaynoise.engines.hf.invariant_modes import Aligned, ByToken
from replaynoise.engines.hf.kernels import static_attention, static_decode_supported
from replaynoise.engines.hf.kvfiles import KVLayers, PinnedRows, save_kv
from replaynoise.engines.hf.modes import Dynamic, Static
from replaynoise.engines.hf.states import IO_THREADS, PrefixState, transplant
from replaynoise.io import file_in
from replaynoise.progress import Phases
from replaynoise.settings import INVARIANT_CONTEXT, INVARIANT_ROWS, EngineSettings

log = logging.getLogger(__name__)

KERNEL_MODES = ("stock", "invariant")
#: ``dynamic``: HF forward with a DynamicCache, finished rows leave the batch; ``static``: preallocated KV and, on
#: CUDA, one captured graph per step with on-device sampling (rows stay until every row has finished);
#: ``auto``: static on CUDA for the model families it supports, dynamic otherwise.
DECODE_MODES = ("auto", "dynamic", "static")
#: On CPU, half-precision linear layers as float32 GEMMs (``fp32``) or with torch's own kernel (``native``).
CPU_MATMULS = ("fp32", "native")


@dataclass(frozen=True)
class HFOptions:
    """How an HF engine runs its model (``build`` reads them from a configuration's validated settings)."""

    kernels: str
    #: the alternatives recorded per generated token (``pivots.topk``)
    topk: int
    decode: str
    cpu_matmul: str
    #: text tokens that end a response (``stop``) as the EOS ids do
    stop_ids: frozenset[int] = frozenset()
    #: GiB of stored KV files kept on the device for a pass (None: 8 on a GPU, 1 on a CPU)
    cache_gib: float | None = None
    #: the invariant decoder's shape, where kernels invariant decodes statically
    invariant_rows: int = INVARIANT_ROWS
    invariant_context: int = INVARIANT_CONTEXT
    #: capture CUDA graphs for the static decoder's steps
    graphs: bool = True
    #: the most rows a stock static continuation decoder holds, refilled as rows end (None: a batch's own)
    static_rows: int | None = None
    #: compile the stock static rollout decoder's layers and sampler (as the passes' are), not only capture them
    compile_rollouts: bool = False
    #: the stock static decoders' attention (``kernels.STATIC_ATTENTIONS``; None: the process's, ``static_attention``)
    static_attention: str | None = None


class HFEngine:
    name = "hf"

    def __init__(self, model: PreTrainedModel, tokenizer, options: HFOptions) -> None:
        o = options
        kernels, decode, cpu_matmul, topk = o.kernels, o.decode, o.cpu_matmul, o.topk
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
        if decode == "auto":
            decode = "static" if self.device.type == "cuda" and static_decode_supported(model) else "dynamic"
        if decode == "static" and not static_decode_supported(model):
            raise ValueError(f"decode: static does not support model type {model.config.model_type!r}")
        self.topk = topk
        self.stop_ids = set(o.stop_ids)
        self.eos_ids = eos_token_ids(model.generation_config, tokenizer) | self.stop_ids
        invariant = kernels == "invariant"
        given_keys = (
            (o.static_rows is not None, f"static_rows {o.static_rows}: sizes"),
            (o.compile_rollouts, "compile_rollouts: compiles"),
            (o.static_attention is not None, f"static_attention {o.static_attention}: chooses the attention of"),
        )
        for given, what in given_keys:
            if given and (invariant or decode != "static"):
                raise ValueError(
                    f"{what} the stock static decoder, and this engine decodes with kernels {kernels!r}, decode "
                    f"{decode!r} (auto is static only on CUDA, for the model families it supports)"
                )
        self.forwards = Forwards(
            self.model,
            eos_ids=self.eos_ids,
            topk=topk,
            graphs=o.graphs,
            attention=static_attention(invariant, o.static_attention),
            cache_gib=o.cache_gib,
        )
        self.stored, self.phases = self.forwards.stored, self.forwards.phases
        self.pinned = PinnedRows()  # the rollouts' kept KV on its way to their files
        if invariant:  # one decoder shape for the configuration's rollouts and every pass
            self.mode = (
                Aligned(self.forwards, o.invariant_rows, o.invariant_context)
                if decode == "static"
                else ByToken(self.forwards)
            )
        else:
            self.mode = (
                Static(self.forwards, o.static_rows, compile_rollouts=o.compile_rollouts)
                if decode == "static"
                else Dynamic(self.forwards)
            )

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
            built = self._states_of(source.kind, todo, source.prefix_dtype, starts, cached=source.prompt_cached)
            if source.donor is not None:
                donors = self._states_of(source.donor, todo)
                built = self.stored.drift(
                    todo,
                    [transplant(req, mine, theirs, source.layers) for req, mine, theirs in zip(todo, built, donors)],
                )
        if source.kind.resumes and source.donor is None:
            chosen = [i for i, req in enumerate(todo) if req.pivot_id in wanted]
            if chosen:
                with self.phases("re-step"):
                    self.mode.restep([todo[i] for i in chosen], [built[i] for i in chosen])
        by_pivot = {req.pivot_id: state for req, state in zip(todo, built)}
        return [by_pivot[req.pivot_id] for req in requests]

    def _states_of(
        self,
        kind: PrefixKind,
        requests: list[ContinuationRequest],
        prefix_dtype: str | None = None,
        starts: list[int | None] | None = None,
        *,
        cached: bool = False,
    ) -> list[PrefixState]:
        """The states a prefix source kind builds for these (distinct) pivots; a built prefix also scores its
        tokens from ``starts[i]`` on (``scored_from``); ``cached``: its prompt served from a prompt-alone prefill."""
        if kind.resumes:
            return [self.decode_state(req) for req in requests]
        ids = [kind.prompt_ids(req.prefix_ids, req.text_prefix_ids) for req in requests]
        starts = starts or [None] * len(requests)
        if cached:
            return self._cached_states(requests, ids, starts)
        return self._refeed_states(requests, ids, prefix_dtype, starts)

    def decode_state(self, req: ContinuationRequest) -> PrefixState:
        """The stored decode-time KV cropped to the pivot. It is the decode-time state when the file is the one
        recorded at capture (sha256, checked on load) and the ids it was computed from are the prefix's."""
        if req.kv_file is None:
            raise VerificationError(f"pivot {req.pivot_id}: no stored KV to resume from")
        stored, ids, stacked = self.stored.get(req.kv_file, req.kv_sha256)
        length = len(req.prefix_ids)
        if stored[0][0].shape[-2] < length:
            raise VerificationError(
                f"{req.kv_file}: holds {stored[0][0].shape[-2]} positions, pivot {req.pivot_id} needs {length}"
            )
        same_ids = ids is None or ids[:length] == list(req.prefix_ids)
        if not same_ids:
            log.warning(
                "pivot %s: the KV in %s was computed from other token ids than its prefix", req.pivot_id, req.kv_file
            )
        if stacked is not None:  # views of the stacked tensor: no per-layer slicing on the hot path
            return PrefixState(
                None, length, same_ids, None, cached=length, expected=length, kv=stacked[..., :length, :]
            )
        return PrefixState(
            [(k[..., :length, :], v[..., :length, :]) for k, v in stored],
            length,
            same_ids,
            None,
            cached=length,
            expected=length,
        )

    def _refeed_states(
        self, requests: list[ContinuationRequest], seqs: list[list[int]], dtype: str | None, starts: list[int | None]
    ) -> list[PrefixState]:
        """Recompute the prefixes as fresh prompts, as the mode prefills them (``dtype``: by the model cast to
        it, in one batched forward whatever the mode, the KV cast back to the model's dtype); where the decode KV
        is stored, record how far each moved from it (max |dKV| per layer). A row with a start keeps the
        log-probs its own prefill gave its tokens from there on (``PrefixState.token_logprobs``); a batch with
        none prefills exactly as before (the head is then applied to the last position only)."""
        if dtype is not None:
            stacks, scores, padded = self.forwards.batched_states(seqs, starts, self.forwards.model_in(dtype))
        else:
            stacks, scores, padded = self.mode.refeed(seqs, starts)
        states = [
            PrefixState(None, len(seq), True, None, kv=kv, token_logprobs=score)
            for seq, kv, score in zip(seqs, stacks, scores)
        ]
        return self.stored.drift(requests, states, whole=padded)

    def _cached_states(
        self, requests: list[ContinuationRequest], seqs: list[list[int]], starts: list[int | None]
    ) -> list[PrefixState]:
        """The prefixes re-fed over their prompts' KV from prompt-alone prefills (``DecodeMode.refeed_cached``):
        the prompt's positions count as served from cache, the rest is the recomputed tail."""
        if any(req.response_start is None for req in requests):
            raise ValueError("a re-feed over a cached prompt needs each request's response_start (the prompt's length)")
        prompt_lens = [int(req.response_start or 0) for req in requests]
        stacks, scores, _ = self.mode.refeed_cached(seqs, prompt_lens, starts)
        states = [
            PrefixState(None, len(seq), True, None, cached=n, kv=kv, token_logprobs=score)
            for seq, n, kv, score in zip(seqs, prompt_lens, stacks, scores)
        ]
        return self.stored.drift(requests, states)

    # ----------------------------------------------------------------------------------------- continuations
    @torch.inference_mode()
    def run_batch(
        self, requests: list[ContinuationRequest], source: str | PrefixSource, sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        source = as_source(source)
        states = self.prefix_states(requests, source)
        if source.continuation_dtype is not None:  # a precision control: the model cast, states cast up
            return self._continue_in(source.continuation_dtype, requests, states, sampling)
        return self.mode.continue_rows(requests, states, sampling)

    def _continue_in(
        self, dtype: str, requests: list[ContinuationRequest], states: list[PrefixState], sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        """Decode the continuations with the model cast to ``dtype`` from the states cast up to it (HF's own
        forward, finished rows leaving the batch; one row at a time under invariant kernels)."""
        to = getattr(torch, dtype)
        cast: dict[int, PrefixState] = {}
        for state in states:
            if id(state) not in cast:
                cast[id(state)] = (
                    replace(state, kv=state.kv.to(to))
                    if state.kv is not None
                    else replace(state, layers=[(k.to(to), v.to(to)) for k, v in state.per_layer()])
                )
        states = [cast[id(s)] for s in states]
        model = self.forwards.model_in(dtype)
        with self.phases("decode"):
            return self.mode.continue_in(model, requests, states, sampling)

    # ----------------------------------------------------------------------------------------- rollouts
    @torch.inference_mode()
    def generate_rollouts(
        self, requests: list[RolloutRequest], sampling: SamplingSettings, kv_dir: Path, keep_len: KeepLen
    ) -> list[Rollout]:
        """All requests as one batch, generated as the mode generates; each row's own, unpadded decode-time KV is
        stored as far as its pivots need (``keep_len``), with the token ids it was computed from."""
        rows = self.mode.generate(requests, sampling)
        kept: list[tuple[RolloutRequest, Rollout, int, KVLayers | torch.Tensor]] = []
        for req, (rollout, layers) in zip(requests, rows):
            keep = min(keep_len(rollout), layers[0][0].shape[-2])
            if keep > 0:
                kept.append((req, rollout, keep, layers))
        stacked = [layers for *_, layers in kept if isinstance(layers, torch.Tensor)]
        if self.device.type == "cuda" and kept and len(stacked) == len(kept):
            with self.phases("KV to host"):  # one stacked tensor a row (the static decoders): into pinned memory
                hosts = self.pinned.copy([layers[..., :keep, :] for (_, _, keep, _), layers in zip(kept, stacked)])
                kept = [(req, rollout, keep, host) for (req, rollout, keep, _), host in zip(kept, hosts)]
        with self.phases("store KV"), ThreadPoolExecutor(IO_THREADS) as pool:
            saving = []
            for req, rollout, keep, layers in kept:
                path = file_in(kv_dir, f"{req.key}.safetensors")
                ids = (rollout.prompt_ids + rollout.response_ids)[:keep]
                saving.append((rollout, pool.submit(save_kv, layers, keep, path, ids=ids)))
                rollout.kv_file, rollout.kv_len = str(path), keep
            for rollout, sha in saving:
                rollout.kv_sha256 = sha.result()
        return [rollout for rollout, _ in rows]


def build(settings: dict, model_dir: Path, *, topk: int, threads: int, startup: Phases) -> HFEngine:
    """The HF engine of a configuration (``engines.make_engine``): its weights loaded offline, its decode mode chosen
    from its settings."""
    s = EngineSettings.of(settings)
    with startup("weights check"):
        weights = model_weights_dir(model_dir)
    with startup("model load"):
        model, tokenizer = load_weights(weights, s.dtype, s.device)
    with startup("engine build"):
        shape = {
            key: value
            for key, value in (("invariant_rows", s.invariant_rows), ("invariant_context", s.invariant_context))
            if value is not None
        }
        return HFEngine(
            model,
            tokenizer,
            HFOptions(
                kernels=s.kernels,
                topk=topk,
                decode=s.decode,
                cpu_matmul=s.cpu_matmul,
                stop_ids=frozenset(stop_token_ids(tokenizer, s.stop)),
                static_rows=s.static_rows,
                compile_rollouts=s.compile_rollouts,
                static_attention=s.static_attention,
                **shape,
            ),
        )
