"""The prefix mismatch channel: the frameworks' metrics against their direct formulas, the decode-time log-prob of
every sampled token in each HF rollout path, the re-feed's prefill log-probs (which must not change the pass), the
channel exactly zero under invariant kernels, and the link to credit flips."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import polars as pl
import pytest
import torch
from helpers import TINY_ON_SMOLLM2, clone_run, hf_engine, interior_rows, keep_all, snakemake
from tinymodel import VOCAB, Tokenizer, tiny_llama

from replaynoise.analysis.prefix_mismatch import (
    METRICS,
    credit_link,
    logit_link,
    mismatch_rows,
    mismatch_summary,
    token_metrics,
)
from replaynoise.engines.base import ContinuationRequest, RolloutRequest, SamplingSettings
from replaynoise.engines.hf.engine import HFEngine
from replaynoise.io import read_json, read_parquet

ROLLOUT = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=14)
CONTINUE = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=6)
SHAPE = dict(invariant_rows=4, invariant_context=64)
#: the engines of every HF path: (kernels, decode); the invariant static one is the batched invariant decoder
PATHS = [("stock", "dynamic"), ("stock", "static"), ("invariant", "dynamic"), ("invariant", "static")]


# ------------------------------------------------------------------------------------------------ metrics


def test_each_metric_matches_its_direct_formula():
    decode = np.array([-0.1, -2.3, -0.7, -4.0, -0.01])
    refeed = np.array([-0.12, -2.0, -0.7, -4.5, -0.02])
    p, q = np.exp(decode), np.exp(refeed)
    d = np.abs(p - q)
    out = token_metrics(decode, refeed)
    assert out["n_tokens"] == 5
    assert out["rollout_probs_diff_max"] == pytest.approx(d.max(), rel=1e-12)
    assert out["rollout_probs_diff_mean"] == pytest.approx(d.sum() / 5, rel=1e-12)
    assert out["rollout_probs_diff_std"] == pytest.approx(np.sqrt(((d - d.mean()) ** 2).sum() / 4), rel=1e-12)
    cov = ((p - p.mean()) * (q - q.mean())).sum()
    pearson = cov / np.sqrt(((p - p.mean()) ** 2).sum() * ((q - q.mean()) ** 2).sum())
    assert out["rollout_actor_probs_pearson_corr"] == pytest.approx(pearson, rel=1e-12)
    r = refeed - decode  # log pi_train - log pi_rollout, as verl's and NeMo-RL's k3
    assert out["k3_kl"] == pytest.approx(np.mean(np.exp(r) - r - 1), rel=1e-9)
    assert out["share_identical"] == pytest.approx(1 / 5)


def test_metrics_are_zero_on_identical_log_probs_and_undefined_where_they_must_be():
    same = token_metrics(np.array([-0.5, -1.5]), np.array([-0.5, -1.5]))
    assert same["rollout_probs_diff_max"] == same["k3_kl"] == same["rollout_probs_diff_std"] == 0.0
    assert same["share_identical"] == 1.0 and same["rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    one = token_metrics(np.array([-0.5]), np.array([-0.4]))
    assert one["rollout_probs_diff_std"] is None and one["rollout_actor_probs_pearson_corr"] is None
    assert all(token_metrics(np.zeros(0), np.zeros(0))[m] is None for m in METRICS)
    with pytest.raises(ValueError, match="differ in length: 2 and 1"):
        token_metrics(np.zeros(2), np.zeros(1))


# ------------------------------------------------------------------------------------------------ engines


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.bfloat16)


def engine(model, kernels: str, decode: str) -> HFEngine:
    return hf_engine(model, Tokenizer(), kernels=kernels, decode=decode, topk=VOCAB, **SHAPE)


def made(eng: HFEngine, kv_dir):
    reqs = [RolloutRequest(f"p{i}", tuple(range(1, 3 + 3 * i)), seed=100 + i) for i in range(5)]
    return eng.generate_rollouts(reqs, ROLLOUT, kv_dir, keep_all)


def rows_of(rollouts, scored: bool) -> list[ContinuationRequest]:
    """Two rows per pivot, at every interior position; the first row of each pivot measures it."""
    return interior_rows(
        rollouts,
        restep=lambda r, t, k: k == 0,
        response_start=lambda r, t, k: len(r.prompt_ids) if scored else None,
    )


@pytest.mark.parametrize("kernels,decode", PATHS)
def test_every_rollout_path_keeps_each_sampled_tokens_own_log_prob(model, kernels, decode, tmp_path):
    """The log-prob stored for each response token is the one the step's log-softmax gave it: with the top-k
    as wide as the vocabulary, the very entry of that token in the step's top-k, bit for bit."""
    for r in made(engine(model, kernels, decode), tmp_path):
        assert len(r.token_logprobs) == len(r.response_ids)
        for token, ids, values, own in zip(r.response_ids, r.topk_ids, r.topk_logprobs, r.token_logprobs):
            assert own == values[ids.index(token)]


@pytest.mark.parametrize("kernels,decode", PATHS)
def test_the_refeed_scores_its_prefix_once_per_pivot_without_changing_the_pass(model, kernels, decode, tmp_path):
    """A scored re-feed batch gives every row what the unscored one gives, and on each pivot's measuring row the
    log-probs its own prefill gave the prefix's response tokens: near the decode-time ones under stock kernels,
    the same bits under invariant kernels (the channel is exactly zero there)."""
    eng = engine(model, kernels, decode)
    rollouts = made(eng, tmp_path)
    plain, scored = rows_of(rollouts, False), rows_of(rollouts, True)
    a, b = eng.run_batch(plain, "refeed_ids", CONTINUE), eng.run_batch(scored, "refeed_ids", CONTINUE)
    for x, y in zip(a, b):
        assert (x.token_ids, x.next_topk_ids, x.next_topk_logprobs, x.next_digest, x.kv_maxdiff) == (
            y.token_ids,
            y.next_topk_ids,
            y.next_topk_logprobs,
            y.next_digest,
            y.kv_maxdiff,
        )
        assert x.prefix_logprobs is None
    by_id = {r.problem_id: r for r in rollouts}
    for req, res in zip(scored, b):
        if not req.restep:
            assert res.prefix_logprobs is None
            continue
        r, t = by_id[req.pivot_id.split("@")[0]], int(req.pivot_id.split("@")[1])
        decode_time = r.token_logprobs[:t]
        assert len(res.prefix_logprobs) == t
        if kernels == "invariant":
            assert res.prefix_logprobs == decode_time
        else:
            assert max(abs(u - v) for u, v in zip(res.prefix_logprobs, decode_time)) < 0.1
    resumed = eng.run_batch(scored, "decode_kv", CONTINUE)
    assert all(res.prefix_logprobs is None for res in resumed)  # no prefix computed: nothing to score


def test_a_retokenized_prefix_is_scored_only_where_its_ids_are_the_rollouts(model, tmp_path):
    eng = engine(model, "stock", "dynamic")
    rollouts = made(eng, tmp_path)
    rows = [req for req in rows_of(rollouts, True) if req.restep][:2]
    same = replace(rows[0], text_prefix_ids=rows[0].prefix_ids)
    other = replace(rows[1], text_prefix_ids=rows[1].prefix_ids[:-1] + (5,))
    out = eng.run_batch([same, other], "refeed_text", CONTINUE)
    assert out[0].prefix_logprobs is not None and out[1].prefix_logprobs is None


# ------------------------------------------------------------------------------------------------ analysis


def synthetic(n_problems: int = 10, per: int = 6, seed: int = 0):
    """Pivots whose re-feed flips its estimate more often the larger its prefix mismatch; the replica never."""
    rng = np.random.default_rng(seed)
    pivots, credit_rows, mism = [], {"exact": [], "replica": [], "refeed": []}, []
    for p in range(n_problems):
        for j in range(per):
            pid, k3 = f"q{p}.r0@{j + 1}", float(10 ** rng.uniform(-6, -1))
            flip = rng.random() < (0.8 if k3 > 1e-3 else 0.1)
            pivots.append({"pivot_id": pid, "problem_id": f"q{p}", "rollout": 0, "t": 2})
            base = {
                "pivot_id": pid,
                "problem_id": f"q{p}",
                "margin": 0.1,
                "t": 2,
                "k": 4,
                "eligible": True,
                "n_orig_correct": 3,
                "n_sub_correct": 1,
                "n_rows": 8,
            }
            credit_rows["exact"].append({**base, "a_hat": 0.5})
            credit_rows["replica"].append({**base, "a_hat": 0.5})
            credit_rows["refeed"].append({**base, "a_hat": -0.5 if flip else 0.5})
            mism.append(
                {
                    "pass": "refeed",
                    "pivot_id": pid,
                    "problem_id": f"q{p}",
                    "rollout": 0,
                    "t": 2,
                    "n_tokens": 2,
                    "share_identical": 0.0,
                    **{m: k3 for m in METRICS},
                    "decode_logprobs": [-0.5, -1.0],
                    "refeed_logprobs": [-0.5 - k3, -1.0 + k3],
                }
            )
    credit = {name: pl.DataFrame(rows) for name, rows in credit_rows.items()}
    return pl.DataFrame(pivots), credit, pl.DataFrame(mism)


def test_the_link_finds_flips_that_follow_the_mismatch():
    _, credit, mism = synthetic()
    link = credit_link(mism, credit, conditioning="main", metric="sign", min_eligible=10, ci=0.95)
    assert link["available"] and link["n"] == 60 and link["floor_flip_rate"] == 0.0
    assert link["auc"]["k3_kl"] > 0.7
    fit = link["logit"]["k3_kl"]
    assert fit["reason"] is None and fit["coef_per_sd"] > 0 and fit["ci_lo"] > 0 and fit["n_clusters"] == 10
    assert [b["n"] for b in link["bins"]] == [15] * 4
    assert link["bins"][-1]["refeed_flip_rate"] > link["bins"][0]["refeed_flip_rate"]


def test_a_link_whose_slope_runs_away_gives_its_reason_not_the_optimisers_last_digits():
    """reference/gpu-vllm/ladder/smollm2's largest-token-shift fit did not converge (odds ratio 3.5e127 per SD)
    and its digits moved between two CPUs: a mismatch that separates the flips gives no number."""
    rng = np.random.default_rng(0)
    mismatch = 10 ** rng.uniform(-8, -2, 80)
    clusters = np.arange(80) % 10
    separated = logit_link(mismatch > 1e-4, mismatch, clusters, 0.95)
    assert separated["reason"] == "the fit did not converge (separation)"
    assert separated["coef_per_sd"] is None and separated["odds_ratio_per_sd"] is None
    noisy = (mismatch > 1e-4) ^ (np.arange(80) < 6)  # six pivots on the wrong side: a finite slope
    fit = logit_link(noisy, mismatch, clusters, 0.95)
    assert fit["reason"] is None and 0 < fit["coef_per_sd"] < 20


def test_the_summary_pools_tokens_and_says_the_sentence_with_the_tables_excess():
    _, credit, mism = synthetic()
    comparison = {
        "metric": "sign",
        "conditionings": {"main": {"excess_pp": {"estimate": 12.34, "ci_lo": 2.0, "ci_hi": 25.56}}},
    }
    out = mismatch_summary(mism, credit, comparison, config="cfg", metric="sign", min_eligible=10, ci=0.95)
    pooled = out["passes"]["refeed"]
    assert pooled["n_pivots"] == 60 and pooled["n_tokens"] == 120
    assert set(out["not_scored"]) == {"exact", "replica"}
    frameworks = out["frameworks"]["passes"]["refeed"]  # NeMo-RL's and verl's set (tests/test_rl_metrics.py)
    assert frameworks["n_tokens"] == 120 and frameworks["k3_kl"] == pytest.approx(pooled["k3_kl"], rel=1e-12)
    assert frameworks["nemo_rl_alarm"] is (frameworks["token_mult_prob_error"] > 1.05)
    assert out["sentence"].startswith(
        f"cfg: at this configuration's mean k3_kl of {pooled['k3_kl']:.3g}, "
        "re-feed flips +12.3 pp [95% CI +2.0, +25.6] of decision-token credits "
        "beyond the floor"
    )


def test_mismatch_rows_set_the_passes_prefix_against_the_rollouts_tokens():
    rollouts = pl.DataFrame({"problem_id": ["q"], "rollout": [0], "response_logprobs": [[-0.1, -0.2, -0.3]]})
    pivots = pl.DataFrame({"pivot_id": ["q.r0@2"], "problem_id": ["q"], "rollout": [0], "t": [2]})
    refeed = pl.DataFrame({"pivot_id": ["q.r0@2"] * 2, "prefix_logprobs": [[-0.1, -0.25], None]})
    exact = pl.DataFrame(
        {"pivot_id": ["q.r0@2"], "prefix_logprobs": [None]}, schema_overrides={"prefix_logprobs": pl.List(pl.Float64)}
    )
    rows = mismatch_rows(rollouts, pivots, {"exact": exact, "refeed": refeed})
    assert rows["pass"].to_list() == ["refeed"] and rows["n_tokens"].to_list() == [2]
    assert rows["decode_logprobs"].to_list() == [[-0.1, -0.2]]
    bad = refeed.with_columns(pl.Series("prefix_logprobs", [[-0.1], None], dtype=pl.List(pl.Float64)))
    with pytest.raises(ValueError, match="pass 'refeed', pivot 'q.r0@2': 1 re-fed log-probs for a prefix of 2"):
        mismatch_rows(rollouts, pivots, {"refeed": bad})


# ------------------------------------------------------------------------------------------------ across engines


def tables_of(rollouts) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The rollouts and pivots tables of ``made``'s rollouts, a pivot at every interior response position."""
    frame = pl.DataFrame(
        [
            {
                "problem_id": r.problem_id,
                "rollout": r.rollout,
                "prompt_ids": r.prompt_ids,
                "response_ids": r.response_ids,
                "kv_file": r.kv_file,
                "kv_sha256": r.kv_sha256,
                "logits_digests": r.logits_digests,
                "response_logprobs": r.token_logprobs,
            }
            for r in rollouts
        ]
    )
    pivots = pl.DataFrame(
        [
            {
                "pivot_id": f"{r.problem_id}@{t}",
                "problem_id": r.problem_id,
                "rollout": r.rollout,
                "t": t,
                "orig_token": r.response_ids[t],
                "sub_token": (r.response_ids[t] + 1) % VOCAB,
            }
            for r in rollouts
            for t in range(1, len(r.response_ids) - 1)
        ]
    )
    return frame, pivots


def test_a_scorer_sets_its_prefill_against_the_rollouts_engine_once_per_pivot(model, tmp_path):
    """One configuration's rollouts scored by another's engine: one row per pivot, its prefix's response tokens;
    the same bits where the scorer computes as the rollouts' engine did (invariant kernels, the same weights),
    a measured gap where it computes in another dtype."""
    from replaynoise.analysis.cross_scoring import cross_mismatch

    rollouts, pivots = tables_of(made(engine(model, "invariant", "dynamic"), tmp_path))
    kwargs = dict(rollouts_config="a", seed=3, sampling=CONTINUE, batch_size=7)
    rows, summary = cross_mismatch(
        engine(model, "invariant", "dynamic"), rollouts, pivots, scorer_config="a-again", **kwargs
    )
    assert rows["pivot_id"].to_list() == sorted(pivots["pivot_id"].to_list())
    assert rows["pass"].unique().to_list() == ["a-again"]
    assert rows["n_tokens"].to_list() == [int(p.split("@")[1]) for p in rows["pivot_id"]]
    assert summary["metrics"]["zero"] and summary["metrics"]["k3_kl"] == 0.0
    assert summary["n_pivots_asked"] == pivots.height and set(summary["definitions"]) == set(METRICS)
    fp32 = hf_engine(tiny_llama(torch.float32), Tokenizer(), kernels="stock", decode="dynamic", topk=VOCAB, **SHAPE)
    other, summary = cross_mismatch(fp32, rollouts, pivots, scorer_config="b", **kwargs)
    assert other["pivot_id"].to_list() == rows["pivot_id"].to_list()
    assert not summary["metrics"]["zero"] and 0 < summary["metrics"]["k3_kl"] < 0.05


def test_the_workflow_scores_one_configurations_pivots_with_anothers_engine(smollm2_run, tmp_path):
    """A finished SmolLM2 run gains a second configuration of its model (its CPU matmuls in bf16, not fp32) and
    a cross pair: the scorer's one job reads the first configuration's rollouts and pivots, and nothing of
    theirs reruns."""
    run = clone_run(smollm2_run, tmp_path / "run")
    native = {**TINY_ON_SMOLLM2["configs"]["tiny"], "cpu_matmul": "native"}
    pair = {"rollouts": "tiny", "scorer": "tiny-native"}
    config = {
        **TINY_ON_SMOLLM2,
        "configs": {**TINY_ON_SMOLLM2["configs"], "tiny-native": native},
        "analysis": {**TINY_ON_SMOLLM2["analysis"], "cross_scoring": [pair]},
    }
    before = (run / "results" / "rollouts" / "tiny" / "rollouts.parquet").stat().st_mtime_ns
    proc = snakemake(run, config, "results/cross/tiny/tiny-native.json")
    jobs = proc.stdout + proc.stderr  # the plan's table of jobs, on stderr
    assert "cross_score" in jobs and "generate_rollouts" not in jobs and "select_pivots" not in jobs, jobs
    assert (run / "results" / "rollouts" / "tiny" / "rollouts.parquet").stat().st_mtime_ns == before
    pivots = read_parquet(run / "results" / "pivots" / "tiny.parquet")
    rows = read_parquet(run / "results" / "cross" / "tiny" / "tiny-native.parquet")
    summary = read_json(run / "results" / "cross" / "tiny" / "tiny-native.json")
    assert sorted(rows["pivot_id"].to_list()) == sorted(pivots["pivot_id"].to_list())
    assert rows["pass"].unique().to_list() == ["tiny-native"]
    assert (summary["rollouts"], summary["scorer"], summary["n_pivots_asked"]) == ("tiny", "tiny-native", pivots.height)
    assert summary["metrics"]["n_tokens"] == sum(rows["n_tokens"]) > 0 and summary["metrics"]["k3_kl"] > 0
