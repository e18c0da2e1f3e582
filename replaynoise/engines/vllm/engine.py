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

import struct
from pathlib import Path
from typing import Any

from replaynoise.data.loading import eos_ids, load_tokenizer, model_weights_dir, stop_token_ids
from replaynoise.engines.base import (
    ContinuationRequest,
    ContinuationResult,
    KeepLen,
    PrefixSource,
    Rollout,
    RolloutRequest,
    SamplingSettings,
    as_source,
    scored_from,
)
from replaynoise.engines.recipes import (
    FINISH,
    EngineError,
    Generated,
    RegeneratedRollouts,
    checked_result,
    recipe_members,
    rollout_recipe,
    salted_prompt,
    score_salt,
    stored_rollouts,
)
from replaynoise.engines.vllm.build import build_llm, check_invariant_platform
from replaynoise.progress import Phases
from replaynoise.settings import EngineSettings


# --------------------------------------------------------------------------------------------- log-probs
def _position(entry: dict, topk: int) -> tuple[list[int], list[float], bytes]:
    """Top-k ids/log-probs of one position (by rank) and the exact bytes of everything vLLM returned."""
    items = sorted(
        ((lp.rank if lp.rank is not None else 1 << 30, -lp.logprob, tid, lp.logprob) for tid, lp in entry.items())
    )
    top = [(tid, value) for _, _, tid, value in items][:topk]
    raw = b"".join(struct.pack("<qd", tid, value) for tid, value in sorted((t, v) for *_, t, v in items))
    return [t for t, _ in top], [v for _, v in top], raw


class VLLMEngine:
    name = "vllm"

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        eos_ids: set[int],
        *,
        topk: int,
        block_size: int,
        stop_ids: set[int] | frozenset = frozenset(),
    ) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)  # text tokens that end a response (configs.X.stop), stopped on like EOS
        self.eos_ids = set(eos_ids) | self.stop_ids
        self.topk = topk
        self.block_size = block_size
        #: rollouts whose decode-time blocks this process has produced
        self.rollouts = RegeneratedRollouts(self.name)
        self.phases = Phases()

    # ----------------------------------------------------------------------------------------- requests
    def sampling_params(self, seed: int, temperature: float, top_p: float, max_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(
            seed=seed,
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            logprobs=self.topk,
            stop_token_ids=sorted(self.eos_ids),
            detokenize=False,
        )

    def submit(
        self, prompts: list[tuple[list[int], str]], params: list, what: str, positions: int | None = None
    ) -> list[Generated]:
        """Submit prompts (ids, cache salt) together, as one co-scheduled batch; engine errors propagate. Only the
        first ``positions`` steps' top-k are kept (None: all, as rollouts need; a continuation reads its first step's
        alone)."""
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
                raise EngineError(
                    f"{what}: request {i} (prompt of {len(prompts[i][0])} tokens) ended with "
                    f"finish_reason {getattr(comp, 'finish_reason', None)!r}"
                )
            kept = [_position(entry, self.topk) for entry in comp.logprobs[:positions]]
            results.append(
                Generated(
                    list(comp.token_ids),
                    [p[0] for p in kept],
                    [p[1] for p in kept],
                    [p[2] for p in kept],
                    FINISH[comp.finish_reason],
                    int(out.num_cached_tokens or 0),
                    [entry[token].logprob for entry, token in zip(comp.logprobs, comp.token_ids)],
                )
            )
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
    def generate_rollouts(
        self, requests: list[RolloutRequest], sampling: SamplingSettings, kv_dir: Path, keep_len: KeepLen
    ) -> list[Rollout]:
        """All requests go in as one batch; the recipe of each records that batch, so it can be regenerated."""
        members = recipe_members(requests)
        recipe = rollout_recipe(self.name, self.topk, sampling, members, block_size=self.block_size)
        generated = self._run_recipe(recipe, f"rollouts {[m['problem_id'] for m in members]}")
        return stored_rollouts(requests, generated, recipe, kv_dir, keep_len)

    def _run_recipe(self, recipe: dict, what: str) -> list[Generated]:
        s = recipe["sampling"]
        prompts = [(m["prompt_ids"], m["cache_salt"]) for m in recipe["batch"]]
        params = [
            self.sampling_params(m["seed"], s["temperature"], s["top_p"], s["max_new_tokens"]) for m in recipe["batch"]
        ]
        generated = self.submit(prompts, params, what)
        self.rollouts.register(recipe, generated)
        return generated

    def regenerated_rollout(self, kv_file: str, kv_sha256: str | None) -> tuple[list[int], Generated]:
        """A stored rollout's prompt and its generation in this process (regenerated on first use)."""
        return self.rollouts.get(kv_file, kv_sha256, self._run_recipe)

    def forget_rollouts(self) -> None:
        """Drop the regenerated rollouts (after the cache was reset, say): the next use regenerates."""
        self.rollouts.forget()

    # ----------------------------------------------------------------------------------------- continuations
    def expected_cached(self, prompt_len: int) -> int:
        """Tokens vLLM serves from cache for a prompt of ``prompt_len`` tokens whose prefix is all cached."""
        return ((prompt_len - 1) // self.block_size) * self.block_size

    def run_batch(
        self, requests: list[ContinuationRequest], source: str | PrefixSource, sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        spec = as_source(source)
        if spec.prompt_cached:
            raise ValueError(
                f"pass refeed_cached (prefix source {spec.label!r}): the vLLM engine does not serve a re-feed's "
                "prompt from a prefill of its own (its re-feeds carry a cache salt of their own); run it with "
                "engine: hf"
            )
        if not spec.plain:
            raise ValueError(
                f"prefix source {spec.label!r}: the vLLM engine keeps its KV inside vLLM, so it can "
                "neither transplant a cache nor change the precision of a prefix or continuation; "
                "run transplant and precision passes with engine: hf"
            )
        prompts, checks = (
            zip(*(salted_prompt(req, spec, self.regenerated_rollout, self.rollouts.salt_of) for req in requests))
            if requests
            else ((), ())
        )
        params = [
            self.sampling_params(r.seed, sampling.temperature, sampling.top_p, sampling.max_new_tokens)
            for r in requests
        ]
        generated = self.submit(list(prompts), params, f"{spec.kind} batch of {len(requests)}", positions=1)
        scored = {}  # once per pivot, on the row that measures its once-per-pivot channels, after the batch
        for i, req in enumerate(requests):
            start = scored_from(req, spec) if req.restep else None
            if start is not None:
                scored[i] = (list(req.prefix_ids), start)
        scores = dict(zip(scored, self.score_prefixes(list(scored.values()), spec.label))) if scored else {}
        return [
            checked_result(
                req, len(ids), same, gen, self.expected_cached(len(ids)) if spec.kind.resumes else None, scores.get(i)
            )
            for i, (req, (ids, _), same, gen) in enumerate(zip(requests, prompts, checks, generated))
        ]


def build(settings: dict, model_dir: Path, *, topk: int, threads: int, startup: Phases) -> VLLMEngine:
    """The vLLM engine of a configuration (``engines.make_engine``): a platform its invariant mode cannot run on is
    refused before anything loads; vLLM loads the weights, compiles and captures its graphs in the engine build."""
    s = EngineSettings.of(settings)
    if s.kernels == "invariant":
        check_invariant_platform(s.device)
    with startup("weights check"):
        weights = model_weights_dir(model_dir)
    with startup("engine build"):
        tokenizer = load_tokenizer(weights)
        llm = build_llm(weights, settings, topk=topk, threads=threads)
        return VLLMEngine(
            llm,
            tokenizer,
            eos_ids(weights, tokenizer),
            topk=topk,
            block_size=settings["block_size"],
            stop_ids=stop_token_ids(tokenizer, s.stop),
        )
