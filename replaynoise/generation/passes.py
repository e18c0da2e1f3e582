"""The replay passes and the two branches of a pivot, defined once for the passes, the credit and the analysis.

A pass is named by what it is for; its spec says where its prefix state comes from (``source``: a
``PrefixSource``, which the engine builds), which noise stream its continuations draw (``noise``: passes with
the same stream share seeds, so only the prefix state can tell them apart) and whose batch layout it runs in
(``schedule``: a control pass borrows the layout of the pass it changes one thing of, so that thing is all that
differs).

Besides the three passes of the measurement, two families of controls ask *why* re-feeding moves the credit
(docs/method.md section 7): cache transplants (the recipient pass's own state with another pass's KV swapped
in, all layers or a range of them) and fixed-prefix precision arms (the re-fed prefix, or the continuation,
computed in float32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from replaynoise.engines.base import PrefixSource
from replaynoise.settings import replicates

BRANCHES = ("orig", "sub")
#: The passes every run has: the measurement (exact, its replica, the re-feed).
REQUIRED_PASSES = ("exact", "replica", "refeed")


@dataclass(frozen=True)
class PassSpec:
    """How a pass obtains its prefix state, which noise stream its continuations use and whose batch layout
    (schedule) it runs in; for a transplant, which pass's cache it takes (donor) into which pass (recipient)."""

    source: PrefixSource
    noise: str
    purpose: str
    #: the pass whose schedule seed packs this pass's batches (None: its own)
    schedule: str | None = None
    donor: str | None = None
    recipient: str | None = None
    #: a fixed-prefix precision arm: (name of the arm, the pass it is compared with)
    precision: tuple[str, str] | None = None
    #: rows per batch, whatever replay.batch_size says (None: that)
    batch_rows: int | None = None
    #: the replay key that sizes a seeded sample of the pivots this pass runs on (None: every pivot)
    sample_key: str | None = None
    #: the pass it is the replica of, whose disagreement with it the figures and the floors table show
    reference: str = "exact"
    #: (the pass it draws again, which draw): a replicated design's draws of replica and refeed
    draw: tuple[str, int] | None = None


PASSES: dict[str, PassSpec] = {
    "exact": PassSpec(PrefixSource("decode_kv"), "crn", "ground truth: resume from the verified decode-time KV"),
    "replica": PassSpec(
        PrefixSource("decode_kv"), "crn", "the same again, as an independent pass: the replica noise floor"
    ),
    "refeed": PassSpec(PrefixSource("refeed_ids"), "crn", "prefix token ids fed again as a fresh prompt"),
    "refeed_text": PassSpec(
        PrefixSource("refeed_text"), "crn", "prefix decoded to text and re-tokenized, then prefilled"
    ),
    "refeed_cached": PassSpec(
        PrefixSource("refeed_ids", prompt_cached=True),
        "crn",
        "refeed with the prompt's KV from a prefill of the prompt alone, as a prefix cache serves it, and only "
        "the response recomputed on top (HF engine)",
        schedule="refeed",
    ),
    "selector": PassSpec(
        PrefixSource("decode_kv"), "selector", "exact with fresh seeds: decides informativeness independently"
    ),
    # the two controls the paper names as its own limitations
    # the re-feed's second draw (replay.replicates), kept under the name it had before replicates existed, so
    # that every run that listed it keeps its files and fingerprint
    "refeed_replica": PassSpec(
        PrefixSource("refeed_ids", tag="replica"),
        "crn",
        "the re-feed again, as an independent pass (other batch compositions, its prefixes "
        "prefilled anew): the re-feed's own floor",
        reference="refeed",
        draw=("refeed", 2),
    ),
    "replica_fresh": PassSpec(PrefixSource("decode_kv"), "fresh", "exact with fresh seeds: the Monte-Carlo floor"),
    "serial": PassSpec(
        PrefixSource("decode_kv"),
        "crn",
        "exact, one request at a time, on a seeded sample of the pivots: batch-of-one kernels against "
        "the batched exact pass",
        batch_rows=1,
        sample_key="serial_pivots",
    ),
    # cache transplants (HF engine): the recipient's own state is built, then the donor's KV swapped in
    "transplant_decode": PassSpec(
        PrefixSource("refeed_ids", donor="decode_kv"),
        "crn",
        "refeed (its prefill, batch layout and first forward) with the decode-time KV swapped in",
        schedule="refeed",
        donor="exact",
        recipient="refeed",
    ),
    "transplant_refeed": PassSpec(
        PrefixSource("decode_kv", donor="refeed_ids"),
        "crn",
        "exact (its batch layout and first forward) with the re-fed KV swapped in",
        schedule="exact",
        donor="refeed",
        recipient="exact",
    ),
    # fixed-prefix precision controls (HF engine)
    "refeed_fp32": PassSpec(
        PrefixSource("refeed_ids", prefix_dtype="float32"),
        "crn",
        "refeed with the prefix prefilled in float32, its KV cast back to the model's dtype",
        schedule="refeed",
        precision=("prefix in float32", "exact"),
    ),
    "exact_fp32cont": PassSpec(
        PrefixSource("decode_kv", continuation_dtype="float32"),
        "crn",
        "exact with the continuation decoded in float32 (the decode-time KV cast up)",
        schedule="exact",
    ),
    "refeed_fp32cont": PassSpec(
        PrefixSource("refeed_ids", continuation_dtype="float32"),
        "crn",
        "refeed with the continuation decoded in float32 (the re-fed KV cast up)",
        schedule="refeed",
        precision=("continuation in float32", "exact_fp32cont"),
    ),
}
#: The controls of the paper's own limitations, which plan the floors table (replica_fresh joins it where it runs).
FLOOR_CONTROLS = ("refeed_replica", "serial")
#: Passes that measure a floor of the pass they replicate (``PassSpec.reference``), in the floors table's order.
FLOOR_PASSES = ("replica_fresh", "refeed_replica", "serial")
#: The passes a replicated design draws again (``replay.replicates``), in the order their draws pair up: draw r of
#: replica with draw r of refeed.
REPLICATED = ("replica", "refeed")
#: Draw r >= 2 of a replicated pass: ``replica_r<r>``, ``refeed_r<r>`` (refeed's second is ``refeed_replica``).
DRAW_PASS = re.compile(r"(replica|refeed)_r(\d+)")
#: Per-layer transplants, a family of names: ``transplant_refeed_lo<L>`` swaps the re-fed KV into the exact pass
#: for layers [0, L) only, ``transplant_refeed_hi<L>`` for layers [L, n).
LAYER_PASS = re.compile(r"transplant_refeed_(lo|hi)(\d+)")


def draw_name(base: str, draw: int) -> str:
    """The pass that is draw ``draw`` (1, 2, ...) of ``base`` (replica or refeed). Each draw is a pass of its own:
    its name seeds its batch schedule and, for a re-feed, tags its prefills (vLLM: its cache salt), so no draw
    reads another's state and every draw is one step, cached on its own."""
    if base not in REPLICATED or draw < 1:
        raise ValueError(f"no draw {draw} of {base!r}: draws are 1, 2, ... of {REPLICATED}")
    if draw == 1:
        return base
    return "refeed_replica" if (base, draw) == ("refeed", 2) else f"{base}_r{draw}"


def replicate_passes(replicates: int) -> list[str]:
    """The passes ``replay.replicates`` adds: draws 2..R of replica and of refeed."""
    return [draw_name(base, r) for base in REPLICATED for r in range(2, replicates + 1)]


def run_passes(replay: dict) -> list[str]:
    """Every pass a run makes from its replay block: ``passes`` and the draws ``replicates`` adds (absent: 1),
    in the canonical order."""
    return canonical_order(sorted(set(replay["passes"]) | set(replicate_passes(replicates(replay)))))


def draws(passes: list[str], base: str) -> list[str]:
    """The draws of ``base`` among ``passes``, draw 1 first, as far as they run without a gap."""
    found = []
    while draw_name(base, len(found) + 1) in passes:
        found.append(draw_name(base, len(found) + 1))
    return found


def replay_draws(passes: list[str]) -> list[str]:
    """Exact and every draw of replica and of refeed among ``passes``: what the mechanism step reads (controls left
    out: they may replay a sample of the pivots, or no decode-time state at all)."""
    return ["exact", *draws(passes, "replica"), *draws(passes, "refeed")]


def replicate_pairs(passes: list[str]) -> list[tuple[str, str]]:
    """The (replica draw, refeed draw) pairs of a run: draw r with draw r, as many as both passes have."""
    replica, refeed = draws(passes, "replica"), draws(passes, "refeed")
    return list(zip(replica, refeed))


def pass_spec(name: str) -> PassSpec:
    """The spec of a pass named in ``replay.passes`` (a fixed name, a draw of a replicated pass or one of the
    per-layer family)."""
    if name in PASSES:
        return PASSES[name]
    drawn = DRAW_PASS.fullmatch(name)
    if drawn is not None:
        base, r = drawn.group(1), int(drawn.group(2))
        if r < 2 or draw_name(base, r) != name:
            raise ValueError(f"unknown pass {name!r}: draw {r} of {base} is named {draw_name(base, r)!r}")
        first = PASSES[base]
        source = PrefixSource(first.source.kind, tag=f"r{r}") if base == "refeed" else first.source
        return PassSpec(
            source,
            first.noise,
            f"{base}, draw {r}: {first.purpose}",
            reference="exact" if base == "replica" else "refeed",
            draw=(base, r),
        )
    match = LAYER_PASS.fullmatch(name)
    if match is None:
        raise ValueError(
            f"unknown pass {name!r}; expected one of {sorted(PASSES)} or "
            "transplant_refeed_lo<L> / transplant_refeed_hi<L>"
        )
    side, layer = match.group(1), int(match.group(2))
    layers = (0, layer) if side == "lo" else (layer, None)
    where = f"[0, {layer})" if side == "lo" else f"[{layer}, n)"
    return PassSpec(
        PrefixSource("decode_kv", donor="refeed_ids", layers=layers),
        "crn",
        f"exact with the re-fed KV swapped in for layers {where} only",
        schedule="exact",
        donor="refeed",
        recipient="exact",
    )


def schedule_of(name: str) -> str:
    """The pass whose batch layout pass ``name`` runs in."""
    return pass_spec(name).schedule or name


#: The order a pass list is kept in, whatever order it was written in: the measurement's passes first (as in the
#: default), each followed by its further draws, then the others in the order PASSES defines them, per-layer
#: transplants after transplant_refeed (all lo<L>, then all hi<L>, each by L). Every committed campaign lists its
#: passes in this order, so normalising leaves their analysis hashes as they were, while a reordered list no longer
#: reruns the analysis.
_FIXED_RANK = {name: i for i, name in enumerate(PASSES)}


def canonical_order(names: list[str]) -> list[str]:
    """``names`` in the canonical pass order (a pass list is a set; its order must not change any result)."""

    def rank(name: str) -> tuple:
        spec_draw = PASSES[name].draw if name in PASSES else None
        drawn = DRAW_PASS.fullmatch(name)
        if spec_draw is not None or drawn is not None:  # draw r, right after the pass it draws again
            base, r = spec_draw or (drawn.group(1), int(drawn.group(2)))
            return (_FIXED_RANK[base], 1, r, name)
        match = LAYER_PASS.fullmatch(name)
        if match is None:
            return (_FIXED_RANK.get(name, len(PASSES)), 0, 0, name)
        return (_FIXED_RANK["transplant_refeed"], 1 if match.group(1) == "lo" else 2, int(match.group(2)), name)

    return sorted(names, key=rank)
