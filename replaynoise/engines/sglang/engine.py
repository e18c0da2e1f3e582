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

import importlib.util
import logging
import os
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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
    checked_result,
    read_recipe,
    recipe_members,
    rollout_recipe,
    salted_prompt,
    score_salt,
    stored_rollouts,
)
from replaynoise.engines.sglang.plugin import SEEDED
from replaynoise.progress import Phases
from replaynoise.settings import EngineSettings

log = logging.getLogger(__name__)

#: ``sglang`` block keys passed to ``sglang.Engine`` as they are (None: SGLang's default, so not passed)
ENGINE_KEYS = (
    "attention_backend",
    "mem_fraction_static",
    "max_running_requests",
    "chunked_prefill_size",
    "disable_cuda_graph",
    "disable_radix_cache",
    "page_size",
    "context_length",
)


#: the module SGLang's processes import first (``children_import_plugin``): it hooks their sampling where asked
PLUGIN = "replaynoise.engines.sglang.plugin"


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


def _position(top: list, sampled: tuple, topk: int) -> tuple[list[int], list[float], bytes]:
    """One position's top-k (SGLang sorts it by log-prob, descending) and the exact bytes of what it returned:
    the top-k entries and the sampled token's, each ``(logprob, token_id, text)``."""
    entries = sorted({(int(tid), float(lp)) for lp, tid, *_ in [*top, sampled]})
    raw = b"".join(struct.pack("<qd", tid, value) for tid, value in entries)
    return [int(tid) for _, tid, *_ in top[:topk]], [float(lp) for lp, *_ in top[:topk]], raw


class SaltedEngine:
    """``sglang.Engine`` with a cache salt per request: ``Engine.generate`` does not pass ``extra_key`` on, so a batch
    goes to its tokenizer manager as the ``GenerateReqInput`` that ``Engine.generate`` itself builds, salts added."""

    def __init__(self, engine: Any, request_type: type) -> None:
        self.engine, self.request_type = engine, request_type

    def generate(self, *, extra_key: list[str], **fields: Any) -> list[dict]:
        """A batch's results in order, as ``Engine.generate`` returns them (``fields``: its arguments)."""
        request = self.request_type(extra_key=extra_key, **fields)
        generator = self.engine.tokenizer_manager.generate_request(request, None)
        return self.engine.loop.run_until_complete(generator.__anext__())

    def flush_cache(self) -> Any:
        return self.engine.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


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
        #: rollouts whose decode-time KV this process holds: cache salt -> (prompt, result)
        self._present: dict[str, tuple[list[int], Generated]] = {}
        self._recipes: dict[str, dict] = {}
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

    def submit(self, prompts: list[tuple[list[int], str]], params: list[dict], what: str) -> list[Generated]:
        """Submit prompts (ids, cache salt) together, as one co-scheduled batch; engine errors propagate."""
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
            self._generated(out, len(ids), f"{what}: request {i}")
            for i, ((ids, _), out) in enumerate(zip(prompts, outputs))
        ]

    def _generated(self, out: dict, prompt_len: int, what: str) -> Generated:
        """One SGLang result as the pipeline keeps it; one that aborted or returned no log-probs is an error naming the
        request, never a row."""
        meta = out.get("meta_info", {})
        reason = (meta.get("finish_reason") or {}).get("type")
        sampled, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
        if reason not in FINISH or not sampled or tops is None:
            raise EngineError(f"{what} (prompt of {prompt_len} tokens) ended with {reason!r}")
        positions = [_position(top, tok, self.topk) for top, tok in zip(tops, sampled)]
        return Generated(
            [int(tok[1]) for tok in sampled],
            [p[0] for p in positions],
            [p[1] for p in positions],
            [p[2] for p in positions],
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
        for member, gen in zip(recipe["batch"], generated):
            self._present.setdefault(member["cache_salt"], (member["prompt_ids"], gen))
        return generated

    def _recipe(self, kv_file: str, kv_sha256: str | None) -> dict:
        if kv_file not in self._recipes:
            self._recipes[kv_file] = read_recipe(kv_file, kv_sha256, engine=self.name)
        return self._recipes[kv_file]

    def _salt_of(self, kv_file: str) -> str:
        recipe = self._recipes[kv_file]
        return recipe["batch"][recipe["index"]]["cache_salt"]

    def regenerated_rollout(self, kv_file: str, kv_sha256: str | None) -> tuple[list[int], Generated]:
        """A stored rollout's prompt and its generation in this process (its whole batch regenerated on first use)."""
        recipe = self._recipe(kv_file, kv_sha256)
        salt = self._salt_of(kv_file)
        if salt not in self._present:
            log.info("regenerating a batch of %d from %s", len(recipe["batch"]), kv_file)
            self._run_recipe(recipe, f"regeneration from {kv_file}")
        return self._present[salt]

    # ----------------------------------------------------------------------------------------- continuations
    def expected_cached(self, prompt_len: int) -> int:
        """Tokens SGLang serves from its radix cache for a prompt of ``prompt_len`` tokens whose prefix is all
        cached: all but the last, which is computed for its logits, in whole pages."""
        return ((prompt_len - 1) // self.page_size) * self.page_size

    def run_batch(
        self, requests: list[ContinuationRequest], source: str | PrefixSource, sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        spec = as_source(source)
        if not spec.plain:
            raise ValueError(
                f"prefix source {spec.label!r}: the SGLang engine keeps its KV inside SGLang, so it can neither "
                "transplant a cache nor change a prefix's precision; run those passes with engine: hf"
            )
        built = [salted_prompt(req, spec, self.regenerated_rollout, self._salt_of) for req in requests]
        settings = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_new_tokens": sampling.max_new_tokens,
        }
        params = [self._params(r.seed, settings) for r in requests]
        generated = self.submit([prompt for prompt, _ in built], params, f"{spec.kind} batch of {len(requests)}")
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


#: the seeded-sampling check's request: free-running (no stop, a high temperature), so that two draws from SGLang's
#: one generator, or from two seeds, would differ somewhere in 32 tokens, and two draws from one seed agree; top-p
#: below 1, as the runs', takes the sampler path they take
PROBE = {"temperature": 1.5, "top_p": 0.95, "max_new_tokens": 32, "ignore_eos": True}
PROBE_SEEDS = (20260606, 20260606, 7)


def check_seeded(engine: Any, prompt_ids: list[int]) -> None:
    """Each request must sample from its own seed, or a rollout cannot be regenerated and passes share no random
    numbers. One request drawn three times alone, under three salts (so each computes the same prefill): twice from
    one seed, which must give the same tokens (with stock kernels this fails when this package's SGLang plugin did
    not load in SGLang's scheduler), and once from another, which must not (a seed that never reached the sampler)."""
    drawn = [
        engine.generate(
            input_ids=[prompt_ids], extra_key=[f"seed-check:{i}"], sampling_params=[{**PROBE, "sampling_seed": seed}]
        )[0]["output_ids"]
        for i, seed in enumerate(PROBE_SEEDS)
    ]
    if drawn[0] == drawn[1] == drawn[2]:
        raise EngineError(
            "SGLang drew the same tokens for one request under two seeds: the request seeds do not reach its sampler "
            "(a sampler that ignores them, or one seed for every request)"
        )
    if drawn[0] != drawn[1]:
        raise EngineError(
            "SGLang drew different tokens for one request and seed twice: its sampler ignores the request seeds. "
            f"With stock kernels they come from replaynoise's SGLang plugin ({PLUGIN}, with {SEEDED}=1), which "
            "SGLang's spawned processes import first: check that SGLang still starts them by spawn and that nothing "
            "else sets their main module; or use kernels: invariant (SGLang's deterministic mode seeds by itself)"
        )


@contextmanager
def children_import_plugin() -> Iterator[None]:
    """While SGLang starts its processes: each imports this package's SGLang plugin as its main module.

    SGLang starts its scheduler with multiprocessing's spawn, whose child first runs the parent's ``__main__`` again:
    a Snakemake script (a file without a ``__main__`` guard) would build a second engine there. A main module that
    names an importable spec is imported by that name instead, so naming the plugin module makes each child import
    it, which registers its hook there (``plugin.py``) whether or not replaynoise is installed in the environment (its
    entry point is not, under ``--use-conda``). The main module's own spec is restored once the processes run."""
    main = sys.modules["__main__"]
    had, saved = hasattr(main, "__spec__"), getattr(main, "__spec__", None)
    main.__spec__ = importlib.util.find_spec(PLUGIN)
    try:
        yield
    finally:
        if had:
            main.__spec__ = saved
        else:
            del main.__spec__


def build(settings: dict, model_dir: Path, *, topk: int, threads: int, startup: Phases) -> SGLangEngine:
    """The SGLang engine of a configuration (``engines.make_engine``), its model loaded offline from safetensors;
    with stock kernels, its requests' seeds come from this package's SGLang plugin, checked before any request."""
    s = EngineSettings.of(settings)
    with startup("weights check"):
        weights = model_weights_dir(model_dir)
    with startup("engine build"):
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # untempered log-probs, as the other engines record
        os.environ[SEEDED] = "1" if s.kernels == "stock" else "0"  # SGLang's processes inherit it
        if ":" in s.device:
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", s.device.split(":")[1])
        import sglang  # the engine's heavy dependency, loaded only when it is built (its own environment)
        from sglang.srt.managers.io_struct import GenerateReqInput

        kwargs = engine_kwargs(settings)
        log.info("SGLang engine: %s", ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items())))
        with children_import_plugin():
            engine = sglang.Engine(model_path=str(weights), tokenizer_path=str(weights), **kwargs)
        page_size = checked_server_args(engine.server_args, settings)
        tokenizer = load_tokenizer(weights)
    salted = SaltedEngine(engine, GenerateReqInput)
    with startup("seed check"):
        try:
            check_seeded(salted, list(tokenizer("Seeded sampling check.")["input_ids"]))
        except EngineError:
            salted.shutdown()  # its processes would hold their share of the GPU until this one exits
            raise
    return SGLangEngine(
        salted,
        tokenizer,
        eos_ids(weights, tokenizer),
        topk=topk,
        page_size=page_size,
        stop_ids=stop_token_ids(tokenizer, s.stop),
    )


def checked_server_args(server_args: Any, settings: dict) -> int:
    """What SGLang made of the settings once built, where it overrides them by GPU: its radix cache must be on (its
    deterministic mode turns it off where it picks flashinfer, on Blackwell for one), its sampler the one that takes
    seeds, and its page size is the one the exact pass's expected hits are computed with (fa4 on SM100 forces 128).
    Returns that page size."""
    if server_args.disable_radix_cache:
        raise EngineError(
            f"SGLang turned its radix cache off (attention backend {server_args.attention_backend!r}, deterministic "
            f"{settings['kernels'] == 'invariant'}): the exact pass could not read the decode-time state; set "
            "sglang.attention_backend to fa3 or triton"
        )
    if server_args.sampling_backend != "pytorch":
        raise EngineError(
            f"SGLang chose the {server_args.sampling_backend!r} sampler, which draws no request from its own seed with "
            "top-p below 1 (its flashinfer sampler refuses seeds); the engine asks for 'pytorch'"
        )
    if server_args.page_size != settings["sglang"]["page_size"]:
        log.warning(
            "SGLang runs with page_size %d, not the %d configured",
            server_args.page_size,
            settings["sglang"]["page_size"],
        )
    return int(server_args.page_size)
