"""The SGLang engine: SGLang's offline ``Engine``, whose radix-cache resume is instrumented and verified as the vLLM
engine's prefix-cache resume is (docs/sglang.md has the source reading behind each step).

- SGLang inserts a finished request's prompt and output into its radix tree with the KV they were computed in, so a
  continuation submitted as prompt + response[:t] + [branch] reads the rollout's *decode-time* KV, as on vLLM. The tree
  does not outlive the process: the rollout step stores a **recipe** per rollout and a ``decode_kv`` pass regenerates
  each rollout it needs (same seeds, same batch) and checks tokens and log-probs bitwise against the stored rollout.
- Every request carries a cache salt (SGLang's ``extra_key``, the vLLM engine's salts): a rollout's own, which its
  regeneration and its resumed continuations share; a pass's, for re-feeds; a scoring one. A rollout never reads
  another's prompt entries, and a re-feed never reads decode-time state, in whatever order the requests come.
- Each request samples from its own seed: SGLang does so in its deterministic mode (``kernels: invariant``), and with
  stock kernels through this package's SGLang plugin (``plugin.py``), checked once the engine is built
  (``check_seeded``).
- Each continuation records ``cached_tokens``. A prompt of L tokens can match at most L - 1 of them, in whole pages;
  a hit below that expectation makes the row unverified, never silently used.
- Log-probs are the untempered ones (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``), as the other engines record them.
"""

from __future__ import annotations

import logging
import os
import struct
from contextlib import ExitStack, suppress
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
from replaynoise.engines.sglang.launch import (
    SaltedEngine,
    check_seeded,
    checked_pool,
    checked_server_args,
    children_import_plugin,
    logging_kept,
    start_lock,
)
from replaynoise.engines.sglang.plugin import SEEDED
from replaynoise.progress import Phases
from replaynoise.settings import EngineSettings

log = logging.getLogger(__name__)

#: ``sglang`` block keys passed to ``sglang.Engine`` as they are (None or absent: SGLang's default, so not passed)
ENGINE_KEYS = (
    "attention_backend",
    "mem_fraction_static",
    "max_running_requests",
    "chunked_prefill_size",
    "disable_cuda_graph",
    "cuda_graph_max_bs_decode",
    "max_total_tokens",
    "disable_radix_cache",
    "page_size",
    "context_length",
)


def engine_kwargs(settings: dict) -> dict:
    """The ``sglang.Engine`` arguments of a configuration's resolved settings: the ``sglang`` block's keys that are
    not null, the deterministic mode for ``kernels: invariant``, the one sampler that draws from per-request seeds
    with top-p (SGLang's deterministic mode picks it too), a fixed random seed, ids in and out."""
    s = settings["sglang"]
    return {
        **{key: s[key] for key in ENGINE_KEYS if s.get(key) is not None},
        "enable_deterministic_inference": settings["kernels"] == "invariant",
        "sampling_backend": "pytorch",
        "dtype": settings["dtype"],
        "random_seed": 0,
        "skip_tokenizer_init": True,
        "log_level": "error",
    }


def described(kwargs: dict) -> str:
    """The engine's arguments as the job's log states them, where a run's fingerprint reads them back."""
    return ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()))


def _position(top: list, sampled: tuple, topk: int) -> tuple[list[int], list[float], bytes]:
    """One position's top-k (SGLang sorts it by log-prob, descending) and the exact bytes of what it returned:
    the top-k entries and the sampled token's, each ``(logprob, token_id, text)``."""
    entries = sorted({(int(tid), float(lp)) for lp, tid, *_ in [*top, sampled]})
    raw = b"".join(struct.pack("<qd", tid, value) for tid, value in entries)
    return [int(tid) for _, tid, *_ in top[:topk]], [float(lp) for lp, *_ in top[:topk]], raw


class SGLangEngine:
    name = "sglang"

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        eos: set[int],
        *,
        topk: int,
        page_size: int,
        stop_ids: set[int] | frozenset = frozenset(),
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.eos_ids = set(eos) | self.stop_ids
        self.topk = topk
        self.page_size = page_size
        #: rollouts whose decode-time KV this process holds
        self.rollouts = RegeneratedRollouts(self.name)
        self.phases = Phases()

    def _params(self, seed: int, sampling: dict) -> dict:
        return {
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "max_new_tokens": sampling["max_new_tokens"],
            "stop_token_ids": sorted(self.eos_ids),
            "sampling_seed": seed,
            "no_stop_trim": True,
        }

    def submit(
        self, prompts: list[tuple[list[int], str]], params: list[dict], what: str, positions: int | None = None
    ) -> list[Generated]:
        """Submit prompts (ids, cache salt) together, as one co-scheduled batch; engine errors propagate. Only the
        first ``positions`` steps' top-k are kept (None: all, as rollouts need; a continuation reads its first step's
        alone, and building each step's is Python work for every generated token)."""
        with self.phases("SGLang generate"):
            outputs = self.engine.generate(
                input_ids=[ids for ids, _ in prompts],
                extra_key=[salt for _, salt in prompts],
                sampling_params=params,
                return_logprob=True,
                top_logprobs_num=self.topk,
            )
        if len(outputs) != len(prompts):
            raise EngineError(f"{what}: SGLang returned {len(outputs)} results for {len(prompts)} requests")
        return [
            self._generated(out, len(ids), f"{what}: request {i}", positions)
            for i, ((ids, _), out) in enumerate(zip(prompts, outputs))
        ]

    def _generated(self, out: dict, prompt_len: int, what: str, positions: int | None = None) -> Generated:
        """One SGLang result as the pipeline keeps it; one that aborted or returned no log-probs is an error naming the
        request, never a row."""
        meta = out.get("meta_info", {})
        reason = (meta.get("finish_reason") or {}).get("type")
        sampled, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
        if reason not in FINISH or not sampled or tops is None:
            raise EngineError(f"{what} (prompt of {prompt_len} tokens) ended with {reason!r}")
        kept = [_position(top, tok, self.topk) for top, tok in zip(tops[:positions], sampled[:positions])]
        return Generated(
            [int(tok[1]) for tok in sampled],
            [p[0] for p in kept],
            [p[1] for p in kept],
            [p[2] for p in kept],
            FINISH[reason],
            int(meta.get("cached_tokens") or 0),
            [float(tok[0]) for tok in sampled],
        )

    def score_prefixes(self, prefixes: list[tuple[list[int], int]], label: str) -> list[list[float]]:
        """The log-probs a prefill gives each prefix's tokens from ``start`` on, all prefixes in one call of one
        output token each, under a salt of their own (``score_salt``), so that scoring reads and leaves nothing a
        pass's requests use. With ``logprob_start_len`` s SGLang matches its cache below s alone, computes the rest,
        and returns entries for tokens s, s + 1, ..., the first without a value (it would need the logits before s):
        so s is the token before the first one scored, and its entry is dropped."""
        firsts = [max(start, 1) for _, start in prefixes]
        with self.phases("SGLang prefix scores"):
            outputs = self.engine.generate(
                input_ids=[list(ids) for ids, _ in prefixes],
                extra_key=[score_salt(label)] * len(prefixes),
                sampling_params=[{"temperature": 0.0, "max_new_tokens": 1} for _ in prefixes],
                return_logprob=True,
                logprob_start_len=[first - 1 for first in firsts],
            )
        scores = []
        for (ids, _), first, out in zip(prefixes, firsts, outputs):
            entries = (out["meta_info"].get("input_token_logprobs") or [])[1:]
            values = [lp for lp, *_ in entries]
            if len(values) != len(ids) - first or any(lp is None for lp in values):
                raise EngineError(f"prefix scores: {len(values)} log-probs for {len(ids) - first} prefix tokens")
            scores.append([float(lp) for lp in values])
        return scores

    # ----------------------------------------------------------------------------------------- rollouts
    def generate_rollouts(
        self, requests: list[RolloutRequest], sampling: SamplingSettings, kv_dir: Path, keep_len: KeepLen
    ) -> list[Rollout]:
        """All requests go in as one batch; the recipe of each records that batch, so it can be regenerated."""
        recipe = rollout_recipe(self.name, self.topk, sampling, recipe_members(requests), page_size=self.page_size)
        generated = self._run_recipe(recipe, f"rollouts {[r.problem_id for r in requests]}")
        return stored_rollouts(requests, generated, recipe, kv_dir, keep_len)

    def _run_recipe(self, recipe: dict, what: str) -> list[Generated]:
        """A recipe's batch, generated (again) in this process, each member registered as present: SGLang's radix
        tree keeps the first copy of equal keys, so a member is never regenerated to be read."""
        prompts = [(m["prompt_ids"], m["cache_salt"]) for m in recipe["batch"]]
        params = [self._params(m["seed"], recipe["sampling"]) for m in recipe["batch"]]
        generated = self.submit(prompts, params, what)
        self.rollouts.register(recipe, generated)
        return generated

    def regenerated_rollout(self, kv_file: str, kv_sha256: str | None) -> tuple[list[int], Generated]:
        """A stored rollout's prompt and its generation in this process (its whole batch regenerated on first use)."""
        return self.rollouts.get(kv_file, kv_sha256, self._run_recipe)

    # ----------------------------------------------------------------------------------------- continuations
    def expected_cached(self, prompt_len: int) -> int:
        """Tokens SGLang serves from its radix cache for a prompt of ``prompt_len`` tokens whose prefix is all
        cached: all but the last, which is computed for its logits, in whole pages."""
        return ((prompt_len - 1) // self.page_size) * self.page_size

    def run_batch(
        self, requests: list[ContinuationRequest], source: str | PrefixSource, sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        spec = as_source(source)
        if spec.prompt_cached:
            raise ValueError(
                f"pass refeed_cached (prefix source {spec.label!r}): the SGLang engine does not serve a re-feed's "
                "prompt from a prefill of its own (its re-feeds carry a cache salt of their own); run it with "
                "engine: hf"
            )
        if not spec.plain:
            raise ValueError(
                f"prefix source {spec.label!r}: the SGLang engine keeps its KV inside SGLang, so it can neither "
                "transplant a cache nor change a prefix's precision; run those passes with engine: hf"
            )
        built = [salted_prompt(req, spec, self.regenerated_rollout, self.rollouts.salt_of) for req in requests]
        settings = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_new_tokens": sampling.max_new_tokens,
        }
        params = [self._params(r.seed, settings) for r in requests]
        generated = self.submit(
            [prompt for prompt, _ in built], params, f"{spec.kind} batch of {len(requests)}", positions=1
        )
        scored = {
            i: (list(r.prefix_ids), s)
            for i, r in enumerate(requests)
            if r.restep and (s := scored_from(r, spec)) is not None
        }
        scores = dict(zip(scored, self.score_prefixes(list(scored.values()), spec.label))) if scored else {}
        return [
            checked_result(
                req,
                len(ids),
                same,
                gen,
                self.expected_cached(len(ids)) if spec.kind.resumes else None,
                scores.get(i),
            )
            for i, (req, ((ids, _), same), gen) in enumerate(zip(requests, built, generated))
        ]


def build(settings: dict, model_dir: Path, *, topk: int, threads: int, startup: Phases) -> SGLangEngine:
    """The SGLang engine of a configuration (``engines.make_engine``), its model loaded offline from safetensors;
    with stock kernels, its requests' seeds come from this package's SGLang plugin, checked before any request."""
    s = EngineSettings.of(settings)
    with startup("weights check"):
        weights = model_weights_dir(model_dir)
    os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # untempered log-probs, as the other engines record
    os.environ[SEEDED] = "1" if s.kernels == "stock" else "0"  # SGLang's processes inherit it
    if ":" in s.device:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", s.device.split(":")[1])
    with startup("engine build"):  # outside the queue: imports hold no GPU memory
        import sglang  # the engine's heavy dependency, loaded only when it is built (its own environment)
        from sglang.srt.managers.io_struct import GenerateReqInput
    with ExitStack() as building:
        with startup("start queue"):  # other SGLang jobs' builds on this machine
            building.enter_context(start_lock())
        with startup("engine build"):
            kwargs = engine_kwargs(settings)
            log.info("SGLang engine: %s", described(kwargs))
            with children_import_plugin(), logging_kept():
                engine = sglang.Engine(model_path=str(weights), tokenizer_path=str(weights), **kwargs)
    salted = SaltedEngine(engine, GenerateReqInput)
    try:
        page_size = checked_server_args(engine.server_args, settings)
        checked_pool(engine.get_server_info(), settings, page_size)
        tokenizer = load_tokenizer(weights)
        with startup("seed check"):
            check_seeded(salted, list(tokenizer("Seeded sampling check.")["input_ids"]))
        eos, stops = eos_ids(weights, tokenizer), stop_token_ids(tokenizer, s.stop)
    except BaseException:
        with suppress(Exception):  # a failing shutdown must not hide why the build stopped
            salted.shutdown()  # its processes would hold their share of the GPU until this one exits
        raise
    return SGLangEngine(salted, tokenizer, eos, topk=topk, page_size=page_size, stop_ids=stops)
