"""The prefix mismatch across engines: one configuration's rollouts scored by another configuration's engine.

RL's common setup samples with one engine and trains with another (a vLLM sampler beside an HF/FSDP trainer), so
the gap its frameworks monitor lies between two engines, not between one engine's decode and its own prefill. The
scorer re-feeds each pivot's prefix as the refeed pass builds it, and the log-probs its prefill gives the prefix's
response tokens are set against those the rollouts' engine sampled them with, under the metrics of ``mismatch``.
Nothing is decoded beyond the one token a request must ask for: the prefill is the measurement.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import polars as pl

from replaynoise.analysis.prefix_mismatch import DEFINITIONS, METRICS, mismatch_rows, pooled_metrics
from replaynoise.engines.base import ContinuationRequest, Engine, SamplingSettings
from replaynoise.generation.passes import BRANCHES, pass_spec
from replaynoise.generation.replay import build_requests

log = logging.getLogger(__name__)

SCORED_SCHEMA = {"pivot_id": pl.Utf8, "prefix_logprobs": pl.List(pl.Float64)}


def scoring_requests(
    pivots: pl.DataFrame, rollouts: pl.DataFrame, *, seed: int, config_name: str
) -> list[ContinuationRequest]:
    """One request per pivot, its original branch: the pivot's prefix is what is scored, and once is enough.
    Without the rollouts' stored KV: the scorer's prefix state is its own, and its KV (another dtype, another
    engine) is not the one to measure against the decode-time KV."""
    requests = build_requests(pivots, rollouts, pass_name="refeed", k=1, seed=seed, config_name=config_name)
    return [replace(req, kv_file=None, kv_sha256=None) for req in requests if req.branch == BRANCHES[0]]


def score_prefixes(
    engine: Engine, requests: list[ContinuationRequest], sampling: SamplingSettings, batch_size: int
) -> pl.DataFrame:
    """Each request's prefix re-fed by ``engine`` as the refeed pass feeds it, in batches of ``batch_size``:
    (pivot_id, the log-probs its prefill gave the prefix's response tokens)."""
    one_token = SamplingSettings(sampling.temperature, sampling.top_p, 1)
    ids, scored = [], []
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        for req, res in zip(batch, engine.run_batch(batch, pass_spec("refeed").source, one_token), strict=True):
            ids.append(req.pivot_id)
            scored.append(res.prefix_logprobs)
        log.info("scored %d of %d prefixes", len(ids), len(requests))
    return pl.DataFrame({"pivot_id": ids, "prefix_logprobs": scored}, schema=SCORED_SCHEMA)


def cross_mismatch(
    engine: Engine,
    rollouts: pl.DataFrame,
    pivots: pl.DataFrame,
    *,
    rollouts_config: str,
    scorer_config: str,
    seed: int,
    sampling: SamplingSettings,
    batch_size: int,
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """The per-pivot rows (``prefix_mismatch.mismatch_rows``, the pass column naming the scorer) and the summary: the
    metrics over all scored tokens, as a framework pools a batch, with their definitions."""
    requests = scoring_requests(pivots, rollouts, seed=seed, config_name=rollouts_config)
    scored = score_prefixes(engine, requests, sampling, batch_size)
    rows = mismatch_rows(rollouts, pivots, {scorer_config: scored})
    summary = {
        "rollouts": rollouts_config,
        "scorer": scorer_config,
        "n_pivots_asked": len(requests),
        "metrics": pooled_metrics(rows),
        "definitions": {name: DEFINITIONS[name] for name in METRICS},
        "note": "p_decode: the rollouts' engine, as it sampled each token; p_refeed: the scorer's prefill",
    }
    return rows, summary
