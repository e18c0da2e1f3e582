"""The replay passes and the two branches of a pivot, defined once for the passes, the credit and the analysis.

A pass is named by what it is for; its spec says where its prefix state comes from (``source``: the engine's
prefix sources) and which noise stream its continuations draw (``noise``: passes with the same stream share
seeds, so only the prefix state can tell them apart).
"""

from __future__ import annotations

from dataclasses import dataclass

BRANCHES = ("orig", "sub")


@dataclass(frozen=True)
class PassSpec:
    """How a pass obtains its prefix state, and which noise stream its continuations use."""

    source: str
    noise: str
    purpose: str


PASSES: dict[str, PassSpec] = {
    "exact": PassSpec("decode_kv", "crn", "ground truth: resume from the verified decode-time KV"),
    "replica": PassSpec("decode_kv", "crn", "the same again, as an independent pass: the replica noise floor"),
    "refeed": PassSpec("refeed_ids", "crn", "prefix token ids fed again as a fresh prompt"),
    "refeed_text": PassSpec("refeed_text", "crn", "prefix decoded to text and re-tokenized, then prefilled"),
    "selector": PassSpec("decode_kv", "selector", "exact with fresh seeds: decides informativeness independently"),
    "replica_fresh": PassSpec("decode_kv", "fresh", "exact with fresh seeds: the Monte-Carlo floor"),
}
