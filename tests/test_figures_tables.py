"""Headline tables carry the hash and the paper's ranges; figures render, also without data, reproducibly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from helpers import REPO, analysis_settings

from replaynoise.analysis.comparison import compare_passes
from replaynoise.analysis.conditionings import CONDITIONINGS, eligible_frame
from replaynoise.analysis.credit import CREDIT_COLUMNS
from replaynoise.config import validate_config
from replaynoise.plan import plot_options
from replaynoise.report import credit_figures, figures
from replaynoise.report.headline import HEADLINE_SCHEMA, headline_rows
from replaynoise.report.summary import run_summary
from replaynoise.report.tables import (
    PAPER_RANGES,
    paper_range,
    render_table1,
    tex_escape,
    write_headline_tables,
)

DEFAULT_CONFIG = validate_config(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))

K = 4
HASH = "deadbeef01234567"


def synthetic_credit(seed: int, n_pivots: int = 90) -> dict[str, pl.DataFrame]:
    """Credit frames for exact, replica, refeed: replica jitters rarely, refeed more often."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, K + 1, size=(n_pivots, 2))
    margins = rng.uniform(0, 0.2, size=n_pivots)
    out = {}
    for name, rate in (("exact", 0.0), ("replica", 0.1), ("refeed", 0.35)):
        jitter = rng.integers(-1, 2, size=(n_pivots, 2)) * (rng.random((n_pivots, 1)) < rate)
        counts = np.clip(base + jitter, 0, K)
        out[name] = pl.DataFrame(
            {
                "pivot_id": [f"v{i}" for i in range(n_pivots)],
                "problem_id": [f"q{i // 3}" for i in range(n_pivots)],
                "pass_name": name,
                "t": list(range(n_pivots)),
                "margin": margins,
                "prefix_len": 20,
                "rollout_correct": True,
                "k": K,
                "n_orig_correct": counts[:, 0],
                "n_sub_correct": counts[:, 1],
                "n_rows": 2 * K,
                "n_finished": 2 * K,
                "verified": True,
                "eligible": True,
                "a_hat": (counts[:, 0] - counts[:, 1]) / K,
            }
        ).select(CREDIT_COLUMNS)
    return out


@pytest.fixture(scope="module")
def data() -> tuple[dict, dict]:
    credits = {"cfg_a": synthetic_credit(1), "cfg_b": synthetic_credit(2)}
    settings = analysis_settings(n_boot=100, seed=0, min_eligible=10)
    results = {cfg: compare_passes(c, settings) for cfg, c in credits.items()}
    results["tiny"] = compare_passes(synthetic_credit(3, n_pivots=4), settings)
    return credits, results


# ------------------------------------------------------------------------------------------------- tables


def test_tables_carry_hash_paper_ranges_and_na(tmp_path: Path, data) -> None:
    _, results = data
    df = headline_rows(results)
    out = {ext: tmp_path / f"headline.{ext}" for ext in ("csv", "md", "tex")}
    write_headline_tables(df, HASH, out["csv"], out["md"], out["tex"])
    texts = {ext: p.read_text() for ext, p in out.items()}
    for ext, text in texts.items():
        assert HASH in text, ext
        for needle in (
            "14-28",
            "7-21",
            "2.9-6.4",
            "9-23\\%" if ext == "tex" else "9-23%",
            "0.34-0.90",
            "0.63-0.96",
            "3434",
        ):
            assert needle in text, (ext, needle)
    assert texts["csv"].startswith(f"# analysis_hash: {HASH}\n")
    assert texts["md"].startswith(f"<!-- analysis_hash: {HASH} -->")
    assert texts["tex"].startswith(f"% analysis_hash: {HASH}")
    # the "tiny" configuration has too few pivots: its numbers print as n/a, with the note
    back = pl.read_csv(out["csv"], comment_prefix="#", null_values="n/a", schema_overrides=HEADLINE_SCHEMA)
    assert back.height == 3 * len(CONDITIONINGS) and set(HEADLINE_SCHEMA) <= set(back.columns)
    assert set(back["metric"].to_list()) == {"sign"} and set(back["conditioning"].to_list()) == set(CONDITIONINGS)
    tiny = back.filter((pl.col("config") == "tiny") & (pl.col("conditioning") == "main")).row(0, named=True)
    assert tiny["floor"] is None and tiny["excess_pp"] is None and "too few eligible pivots" in tiny["note"]
    main = back.filter((pl.col("config") == "cfg_a") & (pl.col("conditioning") == "main")).row(0, named=True)
    assert main["paper_excess_pp"] == "14-28" and main["paper_jaccard_replica_ceiling"] == "0.63-0.96"
    assert main["paper_t_per_problem"] == "2.9-6.4"
    header = next(line for line in texts["md"].splitlines() if line.startswith("| config |"))
    for column in (
        "metric",
        "re-feed % (pol.)",
        "floor % (pol.)",
        "per-problem t",
        "OLS t",
        "McNemar z",
        "TI excess pp",
        "Jaccard re-feed",
        "Jaccard ceiling",
    ):
        assert f"| {column} |" in header, column
    assert main["excess_pp"] == pytest.approx(
        df.filter((pl.col("config") == "cfg_a") & (pl.col("conditioning") == "main"))["excess_pp"][0]
    )
    md_tiny = next(line for line in texts["md"].splitlines() if line.startswith("| tiny | main |"))
    assert md_tiny.count("n/a") >= 8 and "None" not in texts["md"]
    assert r"\toprule" in texts["tex"] and r"\bottomrule" in texts["tex"]
    assert r"cfg\_a & main" in texts["tex"] and "None" not in texts["tex"]


def test_paper_ranges_by_conditioning() -> None:
    assert PAPER_RANGES["excess_pp"]["lo"] == 14 and PAPER_RANGES["excess_pp"]["hi"] == 28
    assert PAPER_RANGES["cache_hit_rate"]["n_pivots"] == 3434
    assert paper_range("excess_pp", "main") == "14-28"
    assert paper_range("excess_pp", "treatment_independent") == "7-21"
    assert paper_range("excess_pp", "none") == "n/a"
    assert paper_range("excess_pp", "informative") == "n/a"
    assert paper_range("excess_pp", "main", "value") == "n/a"  # the paper's ranges are sign-metric numbers
    assert paper_range("t_per_problem", "main") == "2.9-6.4"
    assert tex_escape("a_b & 50% < 1") == r"a\_b \& 50\% \textless{} 1"


# ------------------------------------------------------------------------------------------------ figures


def _all_figures(credits, results, out: Path) -> list[Path]:
    calls = [
        (figures.plot_disagreement, results),
        (figures.plot_kinds_of_change, results),
        (figures.plot_jaccard_sweep, results),
        (credit_figures.plot_diff_histogram, credits),
        (credit_figures.plot_disagreement_vs_margin, credits),
    ]
    paths = []
    for i, (fn, arg) in enumerate(calls, start=1):
        png, pdf = out / f"fig{i}.png", out / f"fig{i}.pdf"
        fn(arg, png, pdf, **plot_options(fn.__name__.removeprefix("plot_"), DEFAULT_CONFIG))
        paths += [png, pdf]
    return paths


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, data) -> list[Path]:
    credits, results = data
    return _all_figures(credits, results, tmp_path_factory.mktemp("figures"))


def test_figures_are_written_and_byte_reproducible(tmp_path: Path, data, rendered) -> None:
    credits, results = data
    first = rendered
    second = _all_figures(credits, results, tmp_path / "b")
    for p, q in zip(first, second):
        assert p.read_bytes()[:4] == (b"\x89PNG" if p.suffix == ".png" else b"%PDF")
        assert p.stat().st_size > 5000
        assert p.read_bytes() == q.read_bytes(), p.name
    assert b"CreationDate" not in first[1].read_bytes()
    assert not list(first[0].parent.glob(".*tmp"))  # atomic writes leave no temporaries


def test_figures_without_data_say_so(tmp_path: Path, data, rendered) -> None:
    _, results = data
    empty = _all_figures(None, None, tmp_path / "none")
    also_empty = _all_figures({}, {"tiny": results["tiny"]}, tmp_path / "tiny")
    real = rendered
    for p, q, r in zip(empty, also_empty, real):
        assert p.exists() and q.exists()
        if p.suffix == ".png" and p.name in ("fig1.png", "fig2.png", "fig3.png"):
            # too few pivots is not the same as no data: the figure quotes the analysis' note instead
            assert p.read_bytes() != q.read_bytes()
        assert p.read_bytes() != r.read_bytes()


def test_margin_bins_cover_all_pivots(data) -> None:
    credits, _ = data
    sel = eligible_frame(credits["cfg_a"], "none")
    edges = credit_figures.margin_bins(sel["margin"].to_numpy(), 4)
    e, r = sel["a_hat__exact"].to_numpy(), sel["a_hat__refeed"].to_numpy()
    for metric, expected in (("sign", (np.sign(e) != np.sign(r)).mean()), ("value", (e != r).mean())):
        table = credit_figures.disagreement_by_margin(sel, edges, metric)
        assert table["n"].sum() == sel.height and table.height == 4
        overall = (table["refeed"] * table["n"]).sum() / table["n"].sum()
        assert overall == pytest.approx(expected), metric


def test_empty_figure_says_why_in_the_analysis_words():
    from replaynoise.report.figures import NO_DATA, _no_data_message

    results = {
        "cfg": {
            "conditionings": {
                "main": {"available": True, "n": 4, "note": "too few eligible pivots (n=4 < min_eligible=10)"}
            }
        }
    }
    assert _no_data_message(results, "main") == "cfg: too few eligible pivots (n=4 < min_eligible=10)"
    assert _no_data_message({}, "main") == NO_DATA


def test_table1_layout_names_metric_and_prints_undefined_as_dash(data) -> None:
    _, results = data
    text = render_table1(headline_rows(results), "main")
    lines = text.splitlines()
    assert "conditioning main, metric sign" in lines[0]
    assert lines[1].split()[:2] == ["configuration", "n"] and "McNemar z" in lines[1]
    tiny = next(line for line in lines if line.startswith("tiny"))
    assert "—" in tiny and "n/a" not in text
    with pytest.raises(ValueError, match="'nope'"):
        render_table1(headline_rows(results), conditioning="nope")


def _channels(shares: dict[tuple[str, str], float]) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {"pass_a": "exact", "pass_b": other, "channel": channel, "n": 10, "share_identical": share}
            for (other, channel), share in shares.items()
        ]
    )


def test_channel_agreement_reads_each_channel_and_marks_what_was_not_measured() -> None:
    channels = _channels({("replica", "token_ids"): 1.0, ("refeed", "token_ids"): 0.75, ("refeed", "a_hat"): 0.5})
    comparison = {"probe": {"refeed": {"bit_exact_share": 0.0}, "replica": {"bit_exact_share": 1.0}}}
    refeed = figures.channel_shares(comparison, channels, "refeed")
    assert refeed[:2] == [0.0, 0.75] and refeed[4] == 0.5 and np.isnan(refeed[2]) and np.isnan(refeed[3])
    assert np.isnan(figures.channel_shares({"probe": {}}, channels, "replica")[0])  # probe_tokens 0: no probe
    compared_none = _channels({("refeed", "token_ids"): None})  # a channel over no rows has a null share
    assert np.isnan(figures.channel_shares(comparison, compared_none, "refeed")[1])


def test_channel_agreement_figure_has_numbers_where_credit_statistics_have_none(tmp_path: Path, data) -> None:
    """The tiny fixture's configuration is below min_eligible: its credit figures only quote the note, while
    the channel figure still draws its bars."""
    _, results = data
    channels = _channels({("replica", "token_ids"): 1.0, ("refeed", "token_ids"): 0.6})
    drawn, other, empty = (tmp_path / f"{n}.png" for n in ("drawn", "other", "empty"))
    figures.plot_channel_agreement({"tiny": (results["tiny"], channels)}, drawn, tmp_path / "drawn.pdf")
    figures.plot_channel_agreement(
        {"tiny": (results["tiny"], _channels({("refeed", "token_ids"): 0.2}))}, other, tmp_path / "other.pdf"
    )
    figures.plot_channel_agreement({"tiny": (results["tiny"], channels.clear())}, empty, tmp_path / "empty.pdf")
    assert drawn.read_bytes()[:4] == b"\x89PNG" and drawn.stat().st_size > empty.stat().st_size
    assert drawn.read_bytes() != other.read_bytes() != empty.read_bytes()


def test_run_summary_prints_the_main_rows_with_numbers_or_the_analysis_note(tmp_path: Path) -> None:
    path = tmp_path / "headline.csv"
    path.write_text(
        "# analysis_hash: x\nconfig,conditioning,metric,n,n_problems,refeed_disagreement,floor,excess_pp,"
        "excess_pp_ci_lo,excess_pp_ci_hi,t_per_problem,note\n"
        "a,main,sign,466,108,0.23,0.0,23.0,18.2,27.6,8.14,n/a\n"
        "a,none,sign,900,120,0.1,0.0,10.0,8.0,12.0,5.0,n/a\n"
        "b,main,sign,4,2,n/a,n/a,n/a,n/a,n/a,n/a,too few eligible pivots (n=4 < min_eligible=10)\n"
    )
    text = run_summary(path, "main")
    lines = text.splitlines()
    assert "main conditioning, sign metric" in lines[0]
    assert lines[3].split() == ["a", "466", "(108)", "23.0", "0.0", "+23.0", "[+18.2,", "+27.6]", "8.14"]
    assert lines[4].split() == ["b", "4", "(2)", "n/a", "n/a", "n/a", "n/a"]
    assert lines[5] == "  b: too few eligible pivots (n=4 < min_eligible=10)"
    # one sentence per row of what it means: one draw per pass resolves nothing; a row without numbers says why
    assert lines[6].startswith("  a: the interval over problems excludes 0") and "not resolved" in lines[6]
    assert lines[7] == "  b: no interval (too few eligible pivots (n=4 < min_eligible=10))."
    assert "excludes 0 means re-feeding moved credit" in lines[8] and "replay.replicates: 3" in lines[9]
    assert len(lines) == 10
    # on CPU it adds that a run this small demonstrates the measurement and may include zero
    assert "may include 0 on some CPUs" in run_summary(path, "main", cpu=True).splitlines()[-1]
    # a replicated run: the pairs and whether the crossed interval excludes zero
    path.write_text(
        "# analysis_hash: x\nconfig,conditioning,metric,n,n_problems,refeed_disagreement,floor,excess_pp,"
        "excess_pp_ci_lo,excess_pp_ci_hi,t_per_problem,note,pairs,resolved\n"
        "a,main,sign,466,108,0.23,0.0,23.0,-1.2,47.6,8.14,n/a,3,false\n"
    )
    lines = run_summary(path, "main").splitlines()
    assert lines[1].split()[-2:] == ["pairs", "resolved"] and lines[3].split()[-2:] == ["3", "no"]
    assert "includes 0: no excess is resolved" in lines[4]
    assert "covers the pass-to-pass noise too" in lines[6]
