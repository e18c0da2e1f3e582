"""NeMo-RL's and verl's mismatch metrics and alarms: each against a value worked by hand, against verl's own function
(its outputs on fixed batches, tests/data/verl_rollout_corr.json, made by benchmarks/verl_rollout_corr.py with
verl 0.9.1), against a transcription of NeMo-RL's formulas, in the mismatch channel's summary, and the alarms table
of the committed runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from replaynoise.analysis.prefix_mismatch import MISMATCH_SCHEMA
from replaynoise.analysis.rl_metrics import METRICS, alarms, framework_metrics, frameworks_by_pass
from replaynoise.report.alarms import alarm_rows, markdown

REPO = Path(__file__).resolve().parents[1]
FIXTURE = json.loads((REPO / "tests" / "data" / "verl_rollout_corr.json").read_text())
#: our name -> verl's logged name (rollout_corr/...)
VERL_NAMES = {
    "kl": "kl",
    "k3_kl": "k3_kl",
    "log_ppl_diff": "log_ppl_diff",
    "ppl_ratio": "ppl_ratio",
    "chi2_token": "chi2_token",
    "chi2_seq": "chi2_seq",
    "is_mean": "rollout_is_mean",
    "ess": "rollout_is_eff_sample_size",
    "is_share_high": "rollout_is_ratio_fraction_high",
    "is_share_low": "rollout_is_ratio_fraction_low",
}

# two sequences; log ratios r = log p_train - log p_rollout of ln 3, 0 and -ln 4 (an empty third is left out)
ROLLOUT = [[-1.0, -2.0], [-0.5], []]
TRAIN = [[-1.0 + math.log(3), -2.0], [-0.5 - math.log(4)], []]


def test_each_metric_on_a_hand_worked_example():
    m = framework_metrics(ROLLOUT, TRAIN)
    ln3, ln4 = math.log(3), math.log(4)
    assert (m["n_sequences"], m["n_tokens"]) == (2, 3)
    expected = {
        "token_mult_prob_error": (3 + 1 + 4) / 3,
        "kl": (-ln3 + ln4) / 3,
        "k3_kl": ((3 - ln3 - 1) + 0 + (0.25 + ln4 - 1)) / 3,
        "log_ppl_diff": (-ln3 / 2 + ln4) / 2,
        "ppl_ratio": (1 / math.sqrt(3) + 4) / 2,
        "chi2_token": (9 + 1 + 1 / 16) / 3 - 1,
        "chi2_seq": (9 + 1 / 16) / 2 - 1,
        "is_mean": (2 + 1 + 0.25) / 3,  # the weight of 3 truncated at 2
        "ess": ((2 + 1 + 0.25) / 3) ** 2 / ((4 + 1 + 1 / 16) / 3),
        "is_share_high": 1 / 3,
        "is_share_low": 1 / 3,
        "sequences_past_alarm": 1.0,  # each sequence's own error: 2 and 4
    }
    for name, value in expected.items():
        assert m[name] == pytest.approx(value, rel=1e-12), name
    assert m["gen_kl_error"] == m["k3_kl"]
    assert alarms(m) == {"nemo_rl_alarm": True, "verl_health": ["chi2_token"]}


def test_the_log_ratio_is_clamped_where_verl_clamps_it():
    m = framework_metrics([[-30.0, -1.0]], [[-5.0, -1.0]])  # r = 25 on the first token
    assert m["chi2_token"] == pytest.approx((math.exp(40) + 1) / 2 - 1, rel=1e-12)
    assert m["chi2_seq"] == pytest.approx(math.exp(40) - 1, rel=1e-12)
    assert m["kl"] == -12.5 and m["is_share_high"] == 0.5


def test_equal_log_probs_are_quiet_and_no_token_gives_no_metric():
    m = framework_metrics([[-0.3, -2.0]], [[-0.3, -2.0]])
    assert m["token_mult_prob_error"] == 1.0 and m["k3_kl"] == m["kl"] == m["chi2_token"] == m["chi2_seq"] == 0.0
    assert m["ess"] == m["is_mean"] == m["ppl_ratio"] == 1.0
    assert alarms(m) == {"nemo_rl_alarm": False, "verl_health": []}
    empty = framework_metrics([[]], [[]])
    assert empty["n_tokens"] == 0 and all(empty[k] is None for k in METRICS if k not in ("n_sequences", "n_tokens"))
    assert alarms(empty) == {"nemo_rl_alarm": None, "verl_health": None}
    with pytest.raises(ValueError, match="sequence 0: 2 rollout log-probs against 1"):
        framework_metrics([[-1.0, -1.0]], [[-1.0]])


@pytest.mark.parametrize(
    "changes,warned",
    [
        ({"is_mean": 0.49}, ["is_mean"]),
        ({"ess": 0.29}, ["ess"]),
        ({"kl": -0.11}, ["kl"]),
        ({"kl": 0.11}, ["kl"]),
        ({"chi2_token": 1.01}, ["chi2_token"]),
        ({"is_mean": 0.5, "ess": 0.3, "kl": 0.1, "chi2_token": 1.0}, []),  # the bounds themselves are healthy
    ],
)
def test_each_verl_health_check_warns_past_its_own_bound(changes, warned):
    healthy = {"token_mult_prob_error": 1.05, "is_mean": 1.0, "ess": 1.0, "kl": 0.0, "chi2_token": 0.0}
    assert alarms(healthy | changes) == {"nemo_rl_alarm": False, "verl_health": warned}


@pytest.mark.parametrize("case", sorted(FIXTURE["cases"]))
def test_each_verl_metric_matches_verls_own_function(case):
    """verl's compute_rollout_correction_and_rejection_mask on the same padded batch: agreement to verl's own
    guards (it adds 1e-8 to every masked mean's count), while a token-pooled log_ppl_diff would not agree."""
    data = FIXTURE["cases"][case]
    ours = framework_metrics(data["rollout"], data["train"])
    for name, theirs in VERL_NAMES.items():
        assert ours[name] == pytest.approx(data["verl"][f"rollout_corr/{theirs}"], rel=1e-7, abs=1e-9), name
    if case == "large-gaps":
        pooled = np.mean(np.concatenate(data["rollout"]) - np.concatenate(data["train"]))
        assert pooled != pytest.approx(data["verl"]["rollout_corr/log_ppl_diff"], rel=1e-3)


def test_the_fixture_exercises_verls_thresholds_and_clamp():
    verl = {case: FIXTURE["cases"][case]["verl"] for case in FIXTURE["cases"]}
    assert FIXTURE["verl_version"] == "0.9.1"
    assert verl["large-gaps"]["rollout_corr/rollout_is_ratio_fraction_high"] > 0
    assert verl["large-gaps"]["rollout_corr/rollout_is_ratio_fraction_low"] > 0
    sums = [
        sum(b - a for a, b in zip(*pair))
        for pair in zip(*(FIXTURE["cases"]["past-clamp"][k] for k in ("rollout", "train")))
    ]
    assert max(abs(s) for s in sums) > 20


def test_nemo_rl_formulas_as_its_code_writes_them():
    """NeMo-RL's token_mult_prob_error (exp of the absolute log-prob error, masked mean) and gen_kl_error
    (calculate_kl(logprobs=generation, logprobs_reference=prev), k3: logr = reference - logprobs,
    exp(logr) - 1 - logr, masked mean over the batch's tokens), transcribed on a padded batch."""
    data = FIXTURE["cases"]["large-gaps"]
    width = max(len(a) for a in data["rollout"])
    gen, prev, mask = (np.zeros((len(data["rollout"]), width)) for _ in range(3))
    for i, (a, b) in enumerate(zip(data["rollout"], data["train"])):
        gen[i, : len(a)], prev[i, : len(b)], mask[i, : len(a)] = a, b, 1.0
    logr = prev - gen
    gen_kl_error = ((np.exp(logr) - 1 - logr) * mask).sum() / mask.sum()
    mult_prob_error = (np.exp(np.abs(gen - prev)) * mask).sum() / mask.sum()
    ours = framework_metrics(data["rollout"], data["train"])
    assert ours["gen_kl_error"] == pytest.approx(gen_kl_error, rel=1e-12)
    assert ours["token_mult_prob_error"] == pytest.approx(mult_prob_error, rel=1e-12)


def _mismatch(rows: list[tuple[str, str, list[float], list[float]]]) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {
                "pass": p,
                "pivot_id": v,
                "problem_id": "a",
                "rollout": 0,
                "t": len(d),
                "decode_logprobs": d,
                "refeed_logprobs": r,
            }
            for p, v, d, r in rows
        ],
        schema=MISMATCH_SCHEMA,
    )


def test_per_pass_metrics_do_not_depend_on_row_order():
    rows = [("refeed", "a/0@2", *pair) for pair in zip(ROLLOUT[:1], TRAIN[:1])]
    rows += [("refeed", "a/0@1", ROLLOUT[1], TRAIN[1]), ("refeed_r3", "a/0@1", [-1.0], [-1.0])]
    frame = _mismatch(rows)
    by_pass = frameworks_by_pass(frame)
    assert by_pass == frameworks_by_pass(frame.reverse())
    assert by_pass["refeed"]["token_mult_prob_error"] == pytest.approx(8 / 3)
    assert by_pass["refeed_r3"]["verl_health"] == [] and by_pass["refeed_r3"]["nemo_rl_alarm"] is False


def test_the_committed_alarms_table_is_what_the_committed_runs_give():
    """Every committed run that kept its prefixes' log-probs is in the table with its metrics and credit, those that
    did not with their k3_kl; the committed table is what the code makes of them now."""
    out = REPO / "benchmarks" / "results" / "rl-alarms-2026-12-07"
    committed = json.loads((out / "alarms.json").read_text())
    rows = alarm_rows([Path("reference"), Path("benchmarks/results")], REPO)
    assert json.loads(json.dumps(rows)) == committed["rows"]
    assert (out / "alarms.md").read_text() == markdown(rows, committed["command"])
    kept = {r["run"] for r in rows if r["kind"] != "log-probs not kept (k3_kl only)"}
    tables = {p.parent.relative_to(REPO).as_posix() for p in REPO.glob("reference/**/mismatch.parquet")}
    assert tables <= kept
    sglang = next(r for r in rows if r["run"].endswith("1.5b-sglang") and r["pass"] == "refeed")
    assert sglang["excess"]["estimate"] > 20 and sglang["nemo_rl_alarm"] is False and sglang["verl_health"] == []
