"""The SGLang engine: SGLang's offline ``Engine`` in its deterministic mode, whose radix-cache resume is instrumented
and verified as the vLLM engine's prefix-cache resume is (docs/sglang.md has the source reading behind each step).

Not yet run on a GPU: ``tests/test_engine_sglang.py`` holds the checks a lease must pass before a campaign uses it.

- SGLang inserts a finished request's prompt and output into its radix tree with the KV they were computed in, so a
  continuation submitted as prompt + response[:t] + [branch] reads the rollout's *decode-time* KV, as on vLLM. The tree
  does not outlive the process: the rollout step stores a **recipe** per rollout and a ``decode_kv`` pass regenerates
  each rollout it needs (same seeds, same batch) and checks tokens and log-probs bitwise against the stored rollout.
- A request samples from its own ``sampling_seed`` only under ``enable_deterministic_inference``; the configuration
  check refuses stock kernels for that reason (``settings.check``).
- Each continuation records ``cached_tokens``. A prompt of L tokens can match at most L - 1 of them, in whole pages;
  a hit below that expectation makes the row unverified, never silently used.
- A re-feed pass is a process of its own, which never regenerates a rollout: its radix tree holds no decode-time
  KV to read (its requests of one pivot share their own prefill, as on vLLM).
- Log-probs are the untempered ones (``SGLANG_RETURN_ORIGINAL_LOGPROB=1``), as the other engines record them.
"""

from __future__ import annotations

import logging
import os
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
    checked_result,
    read_recipe,
    resume_matches,
    rollout_recipe,
    stored_rollouts,
)
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


def engine_kwargs(settings: dict) -> dict:
    """The ``sglang.Engine`` arguments of a configuration's resolved settings: the ``sglang`` block's keys that are
    not null, the deterministic mode for ``kernels: invariant``, a fixed random seed, ids in and out."""
    s = settings["sglang"]
    return {
        **{key: s[key] for key in ENGINE_KEYS if s.get(key) is not None},
        "enable_deterministic_inference": settings["kernels"] == "invariant",
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


def member_key(member: dict) -> str:
    """A rollout of a recipe's batch: its problem and seed (the seed is drawn per problem and rollout)."""
    return f"{member['problem_id']}:{member['seed']}"


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
        #: rollouts whose decode-time KV this process holds: ``member_key`` -> (prompt, result)
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

    def submit(self, prompts: list[list[int]], params: list[dict], what: str) -> list[Generated]:
        """Submit prompts together, as one co-scheduled batch; engine errors propagate."""
        with self.phases("SGLang generate"):
            outputs = self.engine.generate(
                input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=self.topk
            )
        if len(outputs) != len(prompts):
            raise EngineError(f"{what}: SGLang returned {len(outputs)} results for {len(prompts)} requests")
        results = []
        for i, out in enumerate(outputs):
            meta = out.get("meta_info", {})
            reason = (meta.get("finish_reason") or {}).get("type")
            sampled, tops = meta.get("output_token_logprobs"), meta.get("output_top_logprobs")
            if reason not in FINISH or not sampled or tops is None:
                raise EngineError(f"{what}: request {i} (prompt of {len(prompts[i])} tokens) ended with {reason!r}")
            positions = [_position(top, tok, self.topk) for top, tok in zip(tops, sampled)]
            results.append(
                Generated(
                    [int(tok[1]) for tok in sampled],
                    [p[0] for p in positions],
                    [p[1] for p in positions],
                    [p[2] for p in positions],
                    FINISH[reason],
                    int(meta.get("cached_tokens") or 0),
                    [float(tok[0]) for tok in sampled],
                )
            )
        return results

    def score_prefixes(self, prefixes: list[tuple[list[int], int]]) -> list[list[float]]:
        """The log-probs a prefill gives each prefix's tokens from ``start`` on, all prefixes in one call of one
        output token each. With ``logprob_start_len`` s SGLang matches its cache below s alone, computes the rest,
        and returns entries for tokens s, s + 1, ..., the first without a value (it would need the logits before s):
        so s is the token before the first one scored, and its entry is dropped."""
        firsts = [max(start, 1) for _, start in prefixes]
        with self.phases("SGLang prefix scores"):
            outputs = self.engine.generate(
                input_ids=[list(ids) for ids, _ in prefixes],
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
        batch = [{"problem_id": r.problem_id, "prompt_ids": list(r.prompt_ids), "seed": r.seed} for r in requests]
        recipe = rollout_recipe(self.name, self.topk, sampling, batch, page_size=self.page_size)
        generated = self._run_recipe(recipe, f"rollouts {[r.problem_id for r in requests]}")
        return stored_rollouts(requests, generated, recipe, kv_dir, keep_len)

    def _run_recipe(self, recipe: dict, what: str) -> list[Generated]:
        params = [self._params(m["seed"], recipe["sampling"]) for m in recipe["batch"]]
        return self.submit([m["prompt_ids"] for m in recipe["batch"]], params, what)

    def regenerated_rollout(self, kv_file: str, kv_sha256: str | None) -> tuple[list[int], Generated]:
        """A stored rollout's prompt and its generation in this process. Its whole batch is regenerated on first
        use and every member registered, so a batch runs once: SGLang's radix tree keeps the first copy of equal
        keys, so a second regeneration would be checked but never read."""
        if kv_file not in self._recipes:
            self._recipes[kv_file] = read_recipe(kv_file, kv_sha256, engine=self.name)
        recipe = self._recipes[kv_file]
        key = member_key(recipe["batch"][recipe["index"]])
        if key not in self._present:
            log.info("regenerating a batch of %d from %s", len(recipe["batch"]), kv_file)
            generated = self._run_recipe(recipe, f"regeneration from {kv_file}")
            for member, gen in zip(recipe["batch"], generated):
                self._present.setdefault(member_key(member), (member["prompt_ids"], gen))
        return self._present[key]

    # ----------------------------------------------------------------------------------------- continuations
    def expected_cached(self, prompt_len: int) -> int:
        """Tokens SGLang serves from its radix cache for a prompt of ``prompt_len`` tokens whose prefix is all
        cached: all but the last, which is computed for its logits, in whole pages."""
        return ((prompt_len - 1) // self.page_size) * self.page_size

    def _prompt(self, req: ContinuationRequest, spec: PrefixSource) -> tuple[list[int], bool]:
        if not spec.kind.resumes:
            return spec.kind.prompt_ids(req.prefix_ids, req.text_prefix_ids) + [req.branch_token], True
        return list(req.prefix_ids) + [req.branch_token], resume_matches(req, self.regenerated_rollout)

    def run_batch(
        self, requests: list[ContinuationRequest], source: str | PrefixSource, sampling: SamplingSettings
    ) -> list[ContinuationResult]:
        spec = as_source(source)
        if not spec.plain:
            raise ValueError(
                f"prefix source {spec.label!r}: the SGLang engine keeps its KV inside SGLang, so it can neither "
                "transplant a cache nor change a prefix's precision; run those passes with engine: hf"
            )
        built = [self._prompt(req, spec) for req in requests]
        settings = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_new_tokens": sampling.max_new_tokens,
        }
        params = [self._params(r.seed, settings) for r in requests]
        generated = self.submit([ids for ids, _ in built], params, f"{spec.kind} batch of {len(requests)}")
        scored = {
            i: (list(r.prefix_ids), s)
            for i, r in enumerate(requests)
            if r.restep and (s := scored_from(r, spec)) is not None
        }
        scores = dict(zip(scored, self.score_prefixes(list(scored.values())))) if scored else {}
        return [
            checked_result(
                req, len(ids), same, gen, self.expected_cached(len(ids)) if spec.kind.resumes else None, scores.get(i)
            )
            for i, (req, (ids, same), gen) in enumerate(zip(requests, built, generated))
        ]


def build(settings: dict, model_dir: Path, *, topk: int, threads: int, startup: Phases) -> SGLangEngine:
    """The SGLang engine of a configuration (``engines.make_engine``), its model loaded offline from safetensors."""
    s = EngineSettings.of(settings)
    with startup("weights check"):
        weights = model_weights_dir(model_dir)
    with startup("engine build"):
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # untempered log-probs, as the other engines record
        if ":" in s.device:
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", s.device.split(":")[1])
        import sglang  # the engine's heavy dependency, loaded only when it is built (its own environment)

        kwargs = engine_kwargs(settings)
        log.info("SGLang engine: %s", ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items())))
        engine = sglang.Engine(model_path=str(weights), tokenizer_path=str(weights), **kwargs)
        page_size = checked_server_args(engine.server_args, settings)
        tokenizer = load_tokenizer(weights)
        return SGLangEngine(
            engine,
            tokenizer,
            eos_ids(weights, tokenizer),
            topk=topk,
            page_size=page_size,
            stop_ids=stop_token_ids(tokenizer, s.stop),
        )


def checked_server_args(server_args: Any, settings: dict) -> int:
    """What SGLang made of the settings once built, where it overrides them by GPU: its radix cache must be on (its
    deterministic mode turns it off where it picks flashinfer, on Blackwell for one) and its page size is the one
    the exact pass's expected hits are computed with (fa4 on SM100 forces 128). Returns that page size."""
    if server_args.disable_radix_cache:
        raise EngineError(
            f"SGLang turned its radix cache off (attention backend {server_args.attention_backend!r}, deterministic "
            f"{settings['kernels'] == 'invariant'}): the exact pass could not read the decode-time state; set "
            "sglang.attention_backend to fa3 or triton"
        )
    if server_args.page_size != settings["sglang"]["page_size"]:
        log.warning(
            "SGLang runs with page_size %d, not the %d configured",
            server_args.page_size,
            settings["sglang"]["page_size"],
        )
    return int(server_args.page_size)
