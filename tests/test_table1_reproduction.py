"""The paper's Table 1 and the numbers of its text, reproduced from its published per-pivot records.

The records (tests/data/paper-records, thaw-ai/thaw, Apache-2.0; see NOTICE) go through the reanalysis
adapter and then through the very compare_passes / headline_rows code our own runs use; every cell is
compared at the paper's rounding (rates in % with one decimal, t and z with two, Jaccard with two).
The expected numbers are those of shared/notes/paper-protocol.md, section 12.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest

from replaynoise import paper_records, reanalyze
from replaynoise.report.headline import headline_rows

DATA = Path(__file__).resolve().parent / "data" / "paper-records"

#: label -> (n, re-feed %, re-feed polarity %, floor %, floor polarity %, excess pp, t_clust, McNemar z,
#: treatment-independent excess pp, Jaccard re-feed, Jaccard ceiling). None: the paper prints "—".
PAPER_TABLE1 = {
    "Main pooled (t=.7, K=4)": (636, "33.8", "3.9", "15.1", "1.1", "+18.7", "5.51", "8.61", "+11.7", "0.68", "0.84"),
    "K=8": (490, "35.7", "4.9", "10.4", "1.0", "+25.3", "6.36", "9.68", "+19.0", "0.68", "0.87"),
    "K=16 (10 problems)": (239, "36.8", "5.9", "23.0", "5.9", "+13.8", "2.87", "3.71", "+7.4", "0.90", "0.96"),
    "Greedy cont. (t=0, K=1)": (189, "40.2", "0.5", "13.8", "0.0", "+26.5", "3.64", "5.66", "+11.9", "0.59", "0.83"),
    "GRPO ckpt (t=.7, K=4)": (373, "35.4", "3.8", "9.1", "1.1", "+26.3", "5.50", "8.66", "+17.1", "0.66", "0.88"),
    "Phi-4-mini (t=.7, K=4)": (370, "48.6", "6.2", "20.8", "3.0", "+27.8", "3.47", "7.79", "+21.1", "0.34", "0.63"),
    "Batch-invariant kernels": (106, "0.0", "0.0", "0.0", "0.0", "+0.0", None, None, "+0.0", "1.00", "1.00"),
}
ROWS = list(PAPER_TABLE1)
POOLED, BATCHINV = ROWS[0], ROWS[-1]


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def fixed(x: float | None, digits: int = 2) -> str | None:
    return None if x is None else f"{x:.{digits}f}"


@pytest.fixture(scope="module")
def paper() -> tuple[dict, dict, pl.DataFrame]:
    """All seven rows with the default (the paper's) settings: comparisons, credit frames, headline rows."""
    results, credits = reanalyze.table1(DATA)
    assert list(results) == ROWS
    return results, credits, headline_rows(results)


def main_row(paper, label: str) -> dict:
    return paper[2].filter((pl.col("config") == label) & (pl.col("conditioning") == "main")).row(0, named=True)


def main_block(paper, label: str) -> dict:
    return paper[0][label]["conditionings"]["main"]


# ---------------------------------------------------------------------------------------- Table 1 cells


@pytest.mark.parametrize("label", ROWS)
def test_table1_n(paper, label) -> None:
    row = main_row(paper, label)
    assert row["n"] == PAPER_TABLE1[label][0]
    assert row["metric"] == "sign" and paper[0][label]["metric"] == "sign"


@pytest.mark.parametrize("label", ROWS)
def test_table1_refeed_rate_and_polarity(paper, label) -> None:
    row = main_row(paper, label)
    assert (pct(row["refeed_disagreement"]), pct(row["refeed_polarity_share"])) == PAPER_TABLE1[label][1:3]


@pytest.mark.parametrize("label", ROWS)
def test_table1_floor_rate_and_polarity(paper, label) -> None:
    row = main_row(paper, label)
    assert (pct(row["floor"]), pct(row["floor_polarity_share"])) == PAPER_TABLE1[label][3:5]


@pytest.mark.parametrize("label", ROWS)
def test_table1_excess(paper, label) -> None:
    assert f"{main_row(paper, label)['excess_pp']:+.1f}" == PAPER_TABLE1[label][5]


@pytest.mark.parametrize("label", ROWS)
def test_table1_per_problem_t(paper, label) -> None:
    assert fixed(main_row(paper, label)["t_per_problem"]) == PAPER_TABLE1[label][6]


@pytest.mark.parametrize("label", ROWS)
def test_table1_mcnemar_z(paper, label) -> None:
    assert fixed(main_row(paper, label)["mcnemar_z"]) == PAPER_TABLE1[label][7]


@pytest.mark.parametrize("label", ROWS)
def test_table1_treatment_independent_excess(paper, label) -> None:
    row = main_row(paper, label)
    assert f"{row['ti_excess_pp']:+.1f}" == PAPER_TABLE1[label][8]
    ti = paper[0][label]["conditionings"]["treatment_independent"]
    assert ti["excess_pp"]["estimate"] == row["ti_excess_pp"]


@pytest.mark.parametrize("label", ROWS)
def test_table1_jaccard_refeed_and_ceiling(paper, label) -> None:
    """The paper's Jaccard is over all recorded pivots; for θ = 0.5 > 0 that equals the one over main."""
    row = main_row(paper, label)
    every = paper[0][label]["selection_all_pivots"]
    assert every["theta"] == 0.5
    for stat, expected in (
        (row["jaccard_refeed"], PAPER_TABLE1[label][9]),
        (row["jaccard_replica_ceiling"], PAPER_TABLE1[label][10]),
    ):
        assert fixed(stat) == expected
    assert every["jaccard_refeed"]["estimate"] == pytest.approx(row["jaccard_refeed"])
    assert every["jaccard_replica_ceiling"]["estimate"] == pytest.approx(row["jaccard_replica_ceiling"])


# --------------------------------------------------------------------------------------- numbers in the text


@pytest.mark.parametrize("label, worse", [(POOLED, (29, 5)), ("K=8", (19, 0)), ("GRPO ckpt (t=.7, K=4)", (16, 2))])
def test_table1_per_problem_sign_split(paper, label, worse) -> None:
    row = main_row(paper, label)
    assert (row["problems_refeed_worse"], row["problems_floor_worse"]) == worse


def test_table1_pooled_mean_zero_test(paper) -> None:
    test = main_block(paper, POOLED)["mean_diff"]["unclustered"]
    assert (fixed(test["mean"], 3), fixed(test["t"])) == ("-0.011", "-1.23")
    assert (f"{test['ci_lo']:+.3f}", f"{test['ci_hi']:+.3f}") == ("-0.029", "+0.006")
    # ours beside it (docs/paper-vs-ours point 25): clustered t -1.43
    assert fixed(main_block(paper, POOLED)["mean_diff"]["cluster"]["t"]) == "-1.43"


def test_table1_pooled_margin_split(paper) -> None:
    split = main_block(paper, POOLED)["margin_split"]
    assert split["split"] == 0.3
    assert (pct(split["below"]["refeed"]), pct(split["at_or_above"]["refeed"])) == ("34.2", "33.6")
    assert (pct(split["below"]["floor"]), pct(split["at_or_above"]["floor"])) == ("12.0", "16.9")


def test_table1_pooled_eligibility_sources(paper) -> None:
    sources = main_block(paper, POOLED)["eligibility_sources"]
    assert (sources["n"], sources["only_refeed"], sources["only_replica"]) == (636, 77, 18)


def test_table1_batch_invariant_row_is_exactly_zero(paper) -> None:
    results, credits, _ = paper
    res, credit = results[BATCHINV], credits[BATCHINV]
    assert res["n_pivots"] == 395
    main = res["conditionings"]["main"]
    assert main["n"] == 106
    for metric in ("sign", "value"):
        dis = main["by_metric"][metric]["disagreement"]
        assert dis["exact_vs_refeed"]["n_disagree"] == dis["exact_vs_replica"]["n_disagree"] == 0, metric
        assert main["by_metric"][metric]["excess_pp"]["estimate"] == 0.0
    assert main["per_problem_t"]["t"] is None and main["mcnemar"]["z"] is None
    # identical estimates on all 395 pivots, bit for bit
    exact = credit["exact"]["a_hat"].to_numpy()
    for name in ("replica", "refeed"):
        assert np.array_equal(exact.view(np.int64), credit[name]["a_hat"].to_numpy().view(np.int64)), name
    assert main["selection"]["at_theta"]["jaccard_refeed"]["estimate"] == 1.0
    assert res["probe"]["refeed"]["bit_exact_share"] == res["probe"]["replica"]["bit_exact_share"] == 1.0


def test_table1_cache_verification_and_probes(paper) -> None:
    """100% of pivots verified; probe channel: bit-exact 61-94% (replica) vs 2.6-5.7% (re-feed), pooled p90
    3.7e-3 vs 4.8e-2, pooled 32-token divergence 22.8% (re-feed) vs 7.9% (replica), replica 2-14%."""
    results = paper[0]
    c2_stock = [label for label in ROWS if label not in (BATCHINV, "Greedy cont. (t=0, K=1)", "GRPO ckpt (t=.7, K=4)")]
    assert sum(results[label]["verification"]["verified"] for label in c2_stock) == 3434
    assert all(results[label]["verification"]["rate"] == 1.0 for label in ROWS)
    stock = [results[label]["probe"] for label in ROWS if label != BATCHINV]
    replica = [p["replica"]["bit_exact_share"] for p in stock]
    refeed = [p["refeed"]["bit_exact_share"] for p in stock]
    assert (round(100 * min(replica)), round(100 * max(replica))) == (61, 94)
    assert (pct(min(refeed)), pct(max(refeed))) == ("2.6", "5.7")
    divergence = [p["replica"]["divergence_share"] for p in stock]
    assert (round(100 * min(divergence)), round(100 * max(divergence))) == (2, 14)
    pooled = results[POOLED]["probe"]
    assert (f"{pooled['replica']['p90_abs_delta']:.1e}", f"{pooled['refeed']['p90_abs_delta']:.1e}") == (
        "3.7e-03",
        "4.8e-02",
    )
    assert (pct(pooled["refeed"]["divergence_share"]), pct(pooled["replica"]["divergence_share"])) == ("22.8", "7.9")


def test_table1_our_definitions_on_the_same_records(paper) -> None:
    """What our definitions give on the paper's data (shared/notes/paper-vs-ours.md, points 1, 22, 23)."""
    pooled, k8 = main_block(paper, POOLED), main_block(paper, "K=8")
    value = pooled["by_metric"]["value"]
    assert (
        pct(value["disagreement"]["exact_vs_refeed"]["estimate"]),
        pct(value["disagreement"]["exact_vs_replica"]["estimate"]),
    ) == ("47.2", "23.1")
    assert f"{value['excess_pp']['estimate']:+.1f}" == "+24.1"
    assert f"{k8['by_metric']['value']['excess_pp']['estimate']:+.1f}" == "+43.5"
    none = {label: paper[0][label]["conditionings"]["none"]["excess_pp"]["estimate"] for label in (POOLED, "K=8")}
    assert (f"{none[POOLED]:+.1f}", f"{none['K=8']:+.1f}") == ("+7.6", "+15.8")
    ols = {label: main_row(paper, label)["t"] for label in (POOLED, "K=16 (10 problems)", "Greedy cont. (t=0, K=1)")}
    assert [fixed(t) for t in ols.values()] == ["4.98", "2.30", "3.34"]
    # our own conditionings cannot be formed from these files, and say why
    for cond, needle in (("informative", "per-branch success counts"), ("selector", "selector")):
        block = paper[0][POOLED]["conditionings"][cond]
        assert block["available"] is False and needle in block["reason"]


# --------------------------------------------------------------------------------------------- the command


def test_table1_reanalyze_command_on_one_file(tmp_path, capsys) -> None:
    out = tmp_path / "k16"
    rc = reanalyze.main([str(DATA / "c2-k16.json.gz"), "--out", str(out), "--label", "K=16", "--n-boot", "50"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Table 1 (conditioning main, metric sign" in printed
    line = next(ln for ln in printed.splitlines() if ln.startswith("K=16"))
    assert line.split()[:7] == ["K=16", "239", "36.8", "(5.9)", "23.0", "(5.9)", "+13.8"]
    for name in (
        "comparison.json",
        "headline.csv",
        "headline.md",
        "headline.tex",
        "table1.txt",
        "figures/disagreement.png",
        "figures/disagreement_vs_margin.pdf",
    ):
        assert (out / name).is_file(), name
    md = (out / "headline.md").read_text()
    assert "| K=16 | main | sign | 239 (10) | 36.8 (5.9) | 23.0 (5.9) |" in md


def test_table1_reanalyze_prints_all_seven_rows(capsys) -> None:
    assert reanalyze.main(["--table1", str(DATA), "--n-boot", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    body = {label: next(ln for ln in lines if ln.startswith(label)) for label in ROWS}
    for label, expected in PAPER_TABLE1.items():
        cells = body[label][len(label) :].split()
        assert cells[:7] == [
            str(expected[0]),
            expected[1],
            f"({expected[2]})",
            expected[3],
            f"({expected[4]})",
            expected[5],
            expected[6] or "—",
        ], label


def test_table1_reanalyze_refuses_bad_input(tmp_path, capsys) -> None:
    assert reanalyze.main(["--table1", str(tmp_path)]) == 2
    assert "missing the paper's file(s)" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{"config": {"k": 4}, "pivots": [{"problem_id": 1, "rollout": 0, "abs_pos": 16, "margin": 0.5,'
        ' "A_exact1": 0.3, "A_exact2": 0.25, "A_refeed": 0.25}]}'
    )
    assert reanalyze.main([str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "A_exact1" in err and "0.3 is not a multiple of 1/K" in err and not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="0.3 is not a multiple of 1/K in \\[-1, 1\\] for K=4"):
        paper_records.records_frame([bad])
