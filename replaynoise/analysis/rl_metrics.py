"""The RL frameworks' own train-inference mismatch metrics and alarms, computed from a pass pair's log-probs.

NeMo-RL and verl each log a set of numbers for the gap between the rollout engine's log-probs and the trainer's
recomputation of them, and raise an alarm (NeMo-RL) or a health warning (verl) past fixed thresholds. The re-feed
is that recomputation, so the same numbers over a pass's re-fed prefixes say whether a user's dashboard would have
flagged the gap that flips credit. Each pivot's prefix is one sequence, as a response is one in the frameworks'
batches; "rollout" is the decode-time log-prob, "training" the re-fed one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import polars as pl

#: verl's bound on a log ratio before it is exponentiated (``SAFETY_BOUND`` in its rollout-correction helper).
SAFETY_BOUND = 20.0
#: verl's default token-level importance-weight threshold (``rollout_is_threshold``), the lower one its reciprocal.
IS_THRESHOLD = 2.0
#: NeMo-RL's alarm on its decode-vs-prefill check (mean exp(|delta log p|) over tokens).
TOKEN_MULT_PROB_ALARM = 1.05
#: verl's health checks of its rollout-correction metrics: (metric, low, high); a value outside [low, high] warns.
HEALTH = {
    "is_mean": ("is_mean", 0.5, 2.0),
    "ess": ("ess", 0.3, None),
    "kl": ("abs_kl", None, 0.1),
    "chi2_token": ("chi2_token", None, 1.0),
}
_VERL = "verl/trainer/ppo/rollout_corr_helper.py"
DEFINITIONS = {
    "n_sequences": "pivots whose prefix holds at least one response token (each prefix one sequence)",
    "n_tokens": "prefix response tokens over those sequences",
    "token_mult_prob_error": "mean over tokens of exp(|log p_train - log p_rollout|) (NeMo-RL; "
    f"tools/model_diagnostics/2.long_generation_decode_vs_prefill.py alarms above {TOKEN_MULT_PROB_ALARM})",
    "gen_kl_error": "mean over tokens of exp(r) - 1 - r, r = log p_train - log p_rollout: NeMo-RL's "
    "calculate_kl(logprobs=generation, logprobs_reference=prev) with its default k3 type, no clamp, masked mean "
    "over the batch's tokens (nemo_rl/algorithms/loss_functions.py); the same number as k3_kl",
    "kl": f"mean over tokens of log p_rollout - log p_train (verl compute_offpolicy_metrics, {_VERL})",
    "k3_kl": "mean over tokens of exp(r) - r - 1, r = log p_train - log p_rollout (verl, same function)",
    "log_ppl_diff": "mean over sequences of (mean log p_rollout - mean log p_train) over the sequence's tokens "
    "(verl, same function)",
    "ppl_ratio": "mean over sequences of exp(that sequence's log_ppl_diff) (verl, same function)",
    "chi2_token": f"mean over tokens of exp(2 clip(r, +-{SAFETY_BOUND:g})) - 1 (verl, same function)",
    "chi2_seq": f"mean over sequences of exp(2 clip(sum of r, +-{SAFETY_BOUND:g})) - 1 (verl, same function)",
    "is_mean": f"mean over tokens of the token IS weight min(exp(clip(r)), {IS_THRESHOLD:g}) (verl "
    "rollout_is_mean, rollout_is='token', its default threshold)",
    "ess": "1 / mean over tokens of (w / mean w)^2, w the truncated token IS weights (verl "
    "rollout_is_eff_sample_size: the effective sample size as a share of the tokens)",
    "is_share_high": f"share of tokens whose untruncated IS weight exp(clip(r)) exceeds {IS_THRESHOLD:g} (verl "
    "rollout_is_ratio_fraction_high)",
    "is_share_low": f"share of tokens whose untruncated IS weight is below 1/{IS_THRESHOLD:g} (verl "
    "rollout_is_ratio_fraction_low)",
    "sequences_past_alarm": f"share of sequences whose own token_mult_prob_error exceeds {TOKEN_MULT_PROB_ALARM}",
    "nemo_rl_alarm": f"token_mult_prob_error > {TOKEN_MULT_PROB_ALARM}",
    "verl_health": "verl's health checks that warn (docs/algo/rollout_corr.md): is_mean outside [0.5, 2], "
    "ess < 0.3, |kl| > 0.1, chi2_token > 1; with token truncation at 2 is_mean cannot exceed 2",
}
#: The numbers ``framework_metrics`` gives, in the tables' order.
METRICS = tuple(name for name in DEFINITIONS if name not in ("nemo_rl_alarm", "verl_health"))


def _pairs(rollout: Sequence[Any], train: Sequence[Any]) -> list[tuple[np.ndarray, np.ndarray]]:
    if len(rollout) != len(train):
        raise ValueError(f"{len(rollout)} rollout sequences against {len(train)} training ones")
    pairs = []
    for i, (a, b) in enumerate(zip(rollout, train)):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            raise ValueError(f"sequence {i}: {a.size} rollout log-probs against {b.size} training ones")
        if a.size:
            pairs.append((a, b))
    return pairs


def framework_metrics(rollout: Sequence[Any], train: Sequence[Any]) -> dict[str, Any]:
    """NeMo-RL's and verl's metrics (``DEFINITIONS``) over sequences of log-probs, token means pooled over every
    sequence as the frameworks pool a batch; sequences with no token are left out, as a pivot at the response's
    start has no prefix to compare. Every metric ``None`` where no token is left. Sums run over the sequences in
    the order given."""
    pairs = _pairs(rollout, train)
    out: dict[str, Any] = dict.fromkeys(METRICS)
    out.update(n_sequences=len(pairs), n_tokens=sum(a.size for a, _ in pairs))
    if not pairs:
        return out
    r = np.concatenate([b - a for a, b in pairs])  # log(pi_train / pi_rollout), as both frameworks take it
    clipped = np.clip(r, -SAFETY_BOUND, SAFETY_BOUND)
    seq_log_ppl = np.array([a.mean() - b.mean() for a, b in pairs])
    seq_sum = np.clip(np.array([(b - a).sum() for a, b in pairs]), -SAFETY_BOUND, SAFETY_BOUND)
    seq_error = np.array([np.exp(np.abs(b - a)).mean() for a, b in pairs])
    raw = np.exp(clipped)
    weights = np.minimum(raw, IS_THRESHOLD)
    k3 = float(np.mean(np.expm1(r) - r))  # expm1: no cancellation at tiny r
    out.update(
        token_mult_prob_error=float(np.mean(np.exp(np.abs(r)))),
        gen_kl_error=k3,
        kl=float(np.mean(-r)),
        k3_kl=k3,
        log_ppl_diff=float(seq_log_ppl.mean()),
        ppl_ratio=float(np.exp(seq_log_ppl).mean()),
        chi2_token=float(np.mean(np.expm1(2.0 * clipped))),
        chi2_seq=float(np.mean(np.expm1(2.0 * seq_sum))),
        is_mean=float(weights.mean()),
        ess=float(1.0 / np.mean(np.square(weights / weights.mean()))),
        is_share_high=float(np.mean(raw > IS_THRESHOLD)),
        is_share_low=float(np.mean(raw < 1.0 / IS_THRESHOLD)),
        sequences_past_alarm=float(np.mean(seq_error > TOKEN_MULT_PROB_ALARM)),
    )
    return out


def alarms(metrics: dict[str, Any]) -> dict[str, Any]:
    """Whether NeMo-RL's alarm fires and which of verl's health checks warn on ``metrics`` (``framework_metrics``);
    ``None`` where there is no token to judge."""
    if metrics.get("token_mult_prob_error") is None:
        return {"nemo_rl_alarm": None, "verl_health": None}
    values = {**metrics, "abs_kl": abs(metrics["kl"])}
    warned = []
    for name, (key, low, high) in HEALTH.items():
        value = values[key]
        if (low is not None and value < low) or (high is not None and value > high):
            warned.append(name)
    return {"nemo_rl_alarm": bool(metrics["token_mult_prob_error"] > TOKEN_MULT_PROB_ALARM), "verl_health": warned}


def frameworks_by_pass(mismatch: pl.DataFrame) -> dict[str, dict[str, Any]]:
    """Per pass of a mismatch table (``prefix_mismatch.mismatch_rows``: one row per pass and pivot, with the
    prefix's decode-time and re-fed log-probs) the frameworks' metrics over its pivots, in pivot order, and their
    alarms."""
    out = {}
    for name in sorted(set(mismatch["pass"].to_list())):
        rows = mismatch.filter(pl.col("pass") == name).sort("pivot_id")
        metrics = framework_metrics(rows["decode_logprobs"].to_list(), rows["refeed_logprobs"].to_list())
        out[name] = {**metrics, **alarms(metrics)}
    return out
