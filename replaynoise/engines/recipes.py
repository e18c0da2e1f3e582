"""What a serving engine (vLLM, SGLang) keeps of a rollout instead of its KV: a recipe (the request that regenerates it
bitwise, written beside the rollouts and checked by its sha256 when read back), the chained digest of its log-probs
that the regeneration is checked by, and the cache salts that keep each rollout's, pass's and scoring's prefix-cache
blocks apart."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from replaynoise.engines.base import (
    ContinuationRequest,
    ContinuationResult,
    KeepLen,
    PrefixSource,
    Rollout,
    RolloutRequest,
    SamplingSettings,
    VerificationError,
)
from replaynoise.io import file_in, sha256_file, write_json

log = logging.getLogger(__name__)

RECIPE_FORMAT = 1
#: a serving engine's finish reasons mapped onto the pipeline's ("eos": a stop token ended it; "length": the budget)
FINISH = {"stop": "eos", "length": "length"}


class EngineError(RuntimeError):
    """A serving engine returned no usable result for a request (aborted, empty); the message names the request."""


@dataclass
class Generated:
    """One finished request of a serving engine, reduced to what the pipeline keeps."""

    token_ids: list[int]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    raw: list[bytes]
    finish_reason: str
    cached_tokens: int
    #: the raw log-prob of each generated token (vLLM returns the sampled token beside the top-k)
    token_logprobs: list[float] | None = None


def chained_digests(raw_positions: list[bytes]) -> list[str]:
    """digest[t] = H(digest[t-1] || bytes of position t): equal digest[t] means positions 0..t are all equal."""
    out, prev = [], b""
    for raw in raw_positions:
        prev = hashlib.blake2b(prev + raw, digest_size=8).digest()
        out.append(prev.hex())
    return out


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


def recipe_members(requests: list[RolloutRequest]) -> list[dict]:
    """A batch of rollout requests as a recipe records it, in order, so that a pass can regenerate it: each member's
    prompt and seed, and its own cache salt, which its regeneration and resumed continuations share."""
    return [
        {
            "problem_id": r.problem_id,
            "prompt_ids": list(r.prompt_ids),
            "seed": r.seed,
            "cache_salt": rollout_salt(r.problem_id, r.seed),
        }
        for r in requests
    ]


def rollout_recipe(engine: str, topk: int, sampling: SamplingSettings, batch: list[dict], **cache: int) -> dict:
    """The recipe of a batch of rollouts (its members in order, each with its own seed): ``cache`` names the
    engine's cache granularity (vLLM's ``block_size``, SGLang's ``page_size``) that the expected hits are counted in."""
    return {
        "format": RECIPE_FORMAT,
        "engine": engine,
        **cache,
        "topk": topk,
        "sampling": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_new_tokens": sampling.max_new_tokens,
        },
        "batch": batch,
    }


def write_recipe(recipe: dict, path: Path) -> str:
    """Write a recipe atomically (the project's JSON writer) and return its sha256."""
    write_json(recipe, path)
    return sha256_file(path)


def read_recipe(path: str, expected_sha256: str | None, engine: str = "vllm") -> dict:
    """A rollout recipe of ``engine``; a missing, corrupt or foreign file raises an error naming it."""
    try:
        actual = sha256_file(path)
        recipe = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise VerificationError(f"{path}: rollout recipe cannot be read ({exc})") from exc
    if expected_sha256 is not None and actual != expected_sha256:
        raise VerificationError(
            f"{path}: rollout recipe is corrupt (sha256 {actual}, recorded {expected_sha256});"
            " rerun the rollout step for this configuration"
        )
    if recipe.get("format") != RECIPE_FORMAT or recipe.get("engine") != engine:
        raise VerificationError(
            f"{path}: not a {engine} rollout recipe (engine {recipe.get('engine')!r}); the "
            "rollouts were generated by another engine: rerun the rollout step"
        )
    return recipe


def stored_rollouts(
    requests: list[RolloutRequest], generated: list[Generated], recipe: dict, kv_dir: Path, keep_len: KeepLen
) -> list[Rollout]:
    """The rollouts of one generated batch, each keeping its recipe (the batch and its index in it) where a later
    exact pass can need its state: a serving engine keeps no KV, only the request that regenerates it."""
    rollouts = []
    for index, (req, gen) in enumerate(zip(requests, generated)):
        rollout = Rollout(
            req.problem_id,
            list(req.prompt_ids),
            gen.token_ids,
            gen.topk_ids,
            gen.topk_logprobs,
            chained_digests(gen.raw),
            gen.finish_reason,
            rollout=req.rollout,
            token_logprobs=gen.token_logprobs,
        )
        keep = keep_len(rollout)
        if keep > 0:
            path = file_in(kv_dir, f"{req.key}.json")
            rollout.kv_sha256 = write_recipe({**recipe, "index": index}, path)
            rollout.kv_file, rollout.kv_len = str(path), keep
        rollouts.append(rollout)
    return rollouts


class RegeneratedRollouts:
    """What a serving engine's process holds of its rollouts: each recipe read and checked once, and each rollout
    generated or regenerated here, by its cache salt (the key its decode-time state is cached under). A batch's members
    are registered together, so a batch runs once, and a member keeps its first generation: the one the cache holds."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self._recipes: dict[str, dict] = {}
        self._present: dict[str, tuple[list[int], Generated]] = {}

    def recipe(self, kv_file: str, kv_sha256: str | None) -> dict:
        if kv_file not in self._recipes:
            self._recipes[kv_file] = read_recipe(kv_file, kv_sha256, engine=self.engine)
        return self._recipes[kv_file]

    def salt_of(self, kv_file: str) -> str:
        """The cache salt of a recipe already read (``recipe``)."""
        recipe = self._recipes[kv_file]
        return recipe["batch"][recipe["index"]]["cache_salt"]

    def register(self, recipe: dict, generated: list[Generated]) -> None:
        for member, gen in zip(recipe["batch"], generated):
            self._present.setdefault(member["cache_salt"], (member["prompt_ids"], gen))

    def get(
        self, kv_file: str, kv_sha256: str | None, run: Callable[[dict, str], object]
    ) -> tuple[list[int], Generated]:
        """A stored rollout's prompt and its generation in this process, its batch regenerated by ``run`` (an
        engine's ``_run_recipe``, which registers what it generates) on first use."""
        recipe = self.recipe(kv_file, kv_sha256)
        member = recipe["batch"][recipe["index"]]
        if member["cache_salt"] not in self._present:
            log.info("regenerating %s (batch of %d) from %s", member["problem_id"], len(recipe["batch"]), kv_file)
            run(recipe, f"regeneration from {kv_file}")
        return self._present[member["cache_salt"]]

    def forget(self) -> None:
        """Drop the generated rollouts (after the cache was reset, say): the next use regenerates."""
        self._present.clear()


def checked_result(
    req: ContinuationRequest,
    prompt_len: int,
    same: bool,
    gen: Generated,
    expected: int | None,
    prefix_logprobs: list[float] | None,
) -> ContinuationResult:
    """A continuation's result, verified only where its prefix state was the decode-time one (``same``) and, for a
    resume, its cache hit is the one expected (``expected``): a shorter hit recomputed decode-time positions."""
    verified = same
    if expected is not None and gen.cached_tokens != expected:
        log.warning(
            "pivot %s %s/%d: %d prefix tokens from cache, %d expected: unverified",
            req.pivot_id,
            req.branch,
            req.k,
            gen.cached_tokens,
            expected,
        )
        verified = False
    return ContinuationResult(
        gen.token_ids,
        gen.finish_reason,
        verified,
        prompt_len - 1,
        gen.topk_ids[0],
        gen.topk_logprobs[0],
        chained_digests(gen.raw[:1])[0],
        None,
        cached_tokens=gen.cached_tokens,
        expected_cached_tokens=expected,
        prefix_logprobs=prefix_logprobs,
    )


def resume_matches(
    req: ContinuationRequest, regenerate: Callable[[str, str | None], tuple[list[int], Generated]]
) -> bool:
    """Whether a resumed continuation's rollout, regenerated by ``regenerate`` (an engine's
    ``regenerated_rollout``) from its stored recipe, is the stored one bitwise; a pivot without a recipe is an
    error, one whose regeneration differs is logged and comes back unverified."""
    if req.kv_file is None:
        raise VerificationError(f"pivot {req.pivot_id}: no stored rollout recipe to regenerate from")
    prompt, gen = regenerate(req.kv_file, req.kv_sha256)
    same = matches_rollout(req, prompt, gen)
    if not same:
        log.warning(
            "pivot %s: regenerated rollout from %s differs from the stored one: unverified", req.pivot_id, req.kv_file
        )
    return same


def matches_rollout(req: ContinuationRequest, prompt: list[int], gen: Generated) -> bool:
    """A regenerated rollout equals the stored one bitwise up to the pivot: tokens, and log-probs by their chained
    digest."""
    t = len(req.prefix_ids) - len(prompt)
    return (
        0 <= t < len(gen.token_ids)
        and list(req.prefix_ids) == prompt + gen.token_ids[:t]
        and chained_digests(gen.raw[: t + 1])[t] == req.expected_digest
    )


def salted_prompt(
    req: ContinuationRequest,
    spec: PrefixSource,
    regenerate: Callable[[str, str | None], tuple[list[int], Generated]],
    salt_of: Callable[[str], str],
) -> tuple[tuple[list[int], str], bool]:
    """A serving engine's continuation prompt (prefix and branch token, with its cache salt) and whether its state is
    the decode-time one so far: a resume carries its rollout's salt (``salt_of`` its recipe) and regenerates the
    rollout, checked bitwise against the stored one (its cache hit is checked once the batch ran); a re-feed carries
    its pass's salt, under which no decode-time entry exists."""
    if spec.kind.resumes:
        same = resume_matches(req, regenerate)
        assert req.kv_file is not None  # resume_matches refuses a pivot without a recipe
        return (list(req.prefix_ids) + [req.branch_token], salt_of(req.kv_file)), same
    ids = spec.kind.prompt_ids(req.prefix_ids, req.text_prefix_ids)
    return (ids + [req.branch_token], refeed_salt(spec.label)), True
