"""The one interface every engine implements, and the records that cross it.

The rest of the pipeline only ever sees these dataclasses, so HF transformers and vLLM are interchangeable:
an engine generates rollouts (keeping the decode-time state it needs to resume them) and runs batches of
continuation requests from a named prefix source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol

from replaynoise.progress import Phases

__all__ = ["PREFIX_SOURCES", "PrefixSource"]  # where a prefix state comes from: defined with the passes


class PrefixKind(StrEnum):
    """Where a continuation's prefix state comes from (method.md section 2), with what each kind means for an
    engine: a resumed state reads the decode-time KV and computes no prefix; a built one prefills the prefix again,
    as the rollout's token ids or as its text tokenized anew."""

    DECODE_KV = "decode_kv"
    REFEED_IDS = "refeed_ids"
    REFEED_TEXT = "refeed_text"

    @property
    def resumes(self) -> bool:
        """Reads the decode-time state (verified, never recomputed)."""
        return self is PrefixKind.DECODE_KV

    @property
    def retokenizes(self) -> bool:
        """Feeds the prefix's text tokenized again, whose ids may differ from the rollout's."""
        return self is PrefixKind.REFEED_TEXT

    def prompt_ids(self, prefix_ids: Sequence[int], text_prefix_ids: Sequence[int] | None) -> list[int]:
        """The ids a built prefix is prefilled from: the re-tokenized text's where there is one, else the rollout's."""
        return list(text_prefix_ids) if self.retokenizes and text_prefix_ids else list(prefix_ids)


#: The kinds' names, as configurations and pass tables write them.
PREFIX_SOURCES = tuple(kind.value for kind in PrefixKind)


@dataclass(frozen=True)
class PrefixSource:
    """How an engine builds a pass's prefix states.

    ``kind`` builds the state; with ``donor``, layers [``layers[0]``, ``layers[1]``) (None: to the last) are then
    replaced by the KV the ``donor`` kind builds for the same prefix. ``prefix_dtype`` computes a re-fed prefix
    in that dtype and casts its KV back to the model's; ``continuation_dtype`` decodes the continuation in that
    dtype from the state cast up to it. ``prompt_cached`` re-feeds the prefix as a prefix cache would serve it:
    the prompt's KV from a prefill of the prompt alone, only the response's tokens computed on top of it.
    """

    kind: PrefixKind
    donor: PrefixKind | None = None
    layers: tuple[int, int | None] = (0, None)
    prefix_dtype: str | None = None
    continuation_dtype: str | None = None
    #: keeps this pass's own prefill state apart from another pass's of the same kind where an engine could
    #: share it (vLLM: its cache salt), so that a replica of a re-feed computes its prefixes again
    tag: str = ""
    prompt_cached: bool = False

    def __post_init__(self) -> None:
        for key in ("kind", "donor"):
            value = getattr(self, key)
            if value is None:
                continue
            if value not in PREFIX_SOURCES:
                raise ValueError(f"prefix source {key} must be one of {PREFIX_SOURCES}, got {value!r}")
            object.__setattr__(self, key, PrefixKind(value))  # a kind given by name carries its behaviour too
        if self.donor is not None and (self.donor.retokenizes or self.kind.retokenizes):
            raise ValueError(
                "a transplant needs the same token ids in donor and recipient; refeed_text "
                "re-tokenizes the prefix, so it can be neither"
            )
        if self.prefix_dtype is not None and self.kind.resumes:
            raise ValueError("prefix_dtype applies to a re-fed prefix; the decode-time KV is stored as computed")
        if self.prompt_cached and (
            self.kind is not PrefixKind.REFEED_IDS or self.donor is not None or self.prefix_dtype is not None
        ):
            raise ValueError(
                "prompt_cached re-feeds the rollout's own ids over a cached prompt: kind refeed_ids, with no "
                "donor and no prefix_dtype"
            )

    @property
    def plain(self) -> bool:
        """Built the way every engine can (no transplant, no precision change)."""
        return self.donor is None and self.prefix_dtype is None and self.continuation_dtype is None

    @property
    def label(self) -> str:
        """The ``prefix_source`` column of a pass table: the kind, then what differs from it."""
        label = self.kind.value
        if self.donor is not None:
            lo, hi = self.layers
            label += f"<-{self.donor.value}[{lo}:{'' if hi is None else hi}]"
        if self.prefix_dtype:
            label += f"+prefix:{self.prefix_dtype}"
        if self.continuation_dtype:
            label += f"+continuation:{self.continuation_dtype}"
        if self.prompt_cached:
            label += "+prompt:cached"
        if self.tag:
            label += f"#{self.tag}"
        return label


def as_source(source: str | PrefixSource) -> PrefixSource:
    """A prefix source given by kind alone (``"decode_kv"``) or in full."""
    return source if isinstance(source, PrefixSource) else PrefixSource(PrefixKind(source))


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_p: float
    max_new_tokens: int


@dataclass(frozen=True)
class RolloutRequest:
    problem_id: str
    prompt_ids: tuple[int, ...]
    seed: int
    #: which of the problem's rollouts (trunks) this is, 0..N-1
    rollout: int = 0

    @property
    def key(self) -> str:
        """The rollout's name in file names (its stored state is ``<key>.safetensors`` or ``<key>.json``)."""
        return f"{self.problem_id}.r{self.rollout}"


@dataclass
class Rollout:
    """One sampled response with, per response position, what the model saw when it chose that token."""

    problem_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    #: top-k of the untempered next-token distribution at each response position
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    #: digest of the full float32 logits vector at each response position (``sampling.digest_rows``)
    logits_digests: list[str]
    finish_reason: str
    rollout: int = 0
    kv_file: str | None = None
    kv_len: int = 0
    kv_sha256: str | None = None
    #: the raw (untempered) log-prob of each sampled response token at the step that chose it: what a trainer
    #: compares its own recomputation with (the prefix mismatch channel); the top-k need not hold the token
    token_logprobs: list[float] | None = None


@dataclass(frozen=True)
class ContinuationRequest:
    """Continuation k of one branch at one pivot. Identical in every pass but for the prefix source."""

    pivot_id: str
    branch: str
    k: int
    seed: int
    #: token ids of the prefix (prompt + response[:t]) that the branch token follows
    prefix_ids: tuple[int, ...]
    branch_token: int
    #: for decode_kv: the rollout's stored KV, and the digest its last step must reproduce
    kv_file: str | None = None
    kv_sha256: str | None = None
    expected_digest: str | None = None
    #: for refeed_text: the prefix re-tokenized from its text
    text_prefix_ids: tuple[int, ...] | None = None
    #: measure this row's pivot's once-per-pivot channels (the pass asks on one row per pivot, not on every
    #: row): decode_kv, the re-step; a prefix state the pass builds itself, its prefix tokens' log-probs
    restep: bool = True
    #: where the response starts in ``prefix_ids`` (the prompt's length): the prefix tokens from here on have
    #: a decode-time log-prob to set a re-fed one against; None: score none
    response_start: int | None = None


@dataclass
class ContinuationResult:
    token_ids: list[int]
    finish_reason: str
    verified: bool
    prefix_len: int
    next_topk_ids: list[int]
    next_topk_logprobs: list[float]
    next_digest: str
    kv_maxdiff: list[float] | None = None
    #: prefix positions whose KV came from a stored or cached state rather than a prefill in this request
    cached_tokens: int | None = None
    #: what ``cached_tokens`` must be for a faithful resume (decode_kv); None where nothing is expected
    expected_cached_tokens: int | None = None
    #: decode_kv: whether re-stepping the last prefix token over the stored KV reproduced the rollout's logits
    #: there bitwise (a measured channel, not a gate); None where not measured
    restep_match: bool | None = None
    #: the log-probs the pass's own prefix computation gave the prefix's response tokens
    #: (``prefix_ids[response_start:]``), on the row that measures its pivot's once-per-pivot channels of a
    #: pass that builds its prefix state; None elsewhere (a resumed state has no prefix computation)
    prefix_logprobs: list[float] | None = None
    extra: dict = field(default_factory=dict)


class Engine(Protocol):
    name: str
    #: the model's tokenizer (prompts, decoding and re-tokenization are engine-independent)
    tokenizer: object
    #: text tokens that end a response as end of sequence does (``configs.X.stop``); graded text ends at them
    stop_ids: set[int]
    #: seconds per phase of the engine's work (``progress.Phases``), for the step's closing log line
    phases: "Phases"

    def generate_rollouts(
        self,
        requests: list[RolloutRequest],
        sampling: SamplingSettings,
        kv_dir: Path,
        keep_len: "KeepLen",
    ) -> list[Rollout]:
        """Sample one rollout per request (together, as one co-scheduled batch), token by token after the
        prompt, keeping each rollout's decode-time state."""
        ...

    def run_batch(
        self,
        requests: list[ContinuationRequest],
        source: "str | PrefixSource",
        sampling: SamplingSettings,
    ) -> list[ContinuationResult]:
        """Run one batch of continuations together, as a serving engine would co-schedule them. ``source`` is a
        prefix source kind or a ``PrefixSource``; an engine refuses, by name, what it cannot build (a transplant
        needs the KV in hand)."""
        ...


def scored_from(req: ContinuationRequest, source: PrefixSource) -> int | None:
    """Where the prefix tokens whose log-probs a pass's own prefix computation is set against the decode-time
    ones start (the response's first token), or None where there is nothing to set against: a resumed state
    (decode_kv) computes no prefix, a transplant's state is not the one its prefill made, and a re-tokenized
    prefix whose ids differ from the rollout's has no decode-time log-prob per token."""
    if source.kind.resumes or source.donor is not None or req.response_start is None:
        return None
    if (
        source.kind.retokenizes
        and req.text_prefix_ids is not None
        and tuple(req.text_prefix_ids) != tuple(req.prefix_ids)
    ):
        return None
    return req.response_start


class KeepLen(Protocol):
    def __call__(self, rollout: Rollout) -> int:
        """How many KV positions of ``rollout`` a later exact replay can need (0: store none)."""
        ...


class VerificationError(RuntimeError):
    """A stored prefix state is unreadable or corrupt; the message names the file."""
