"""Headline tables (CSV, Markdown, LaTeX) with the paper's published ranges alongside, and the paper's Table 1.

Every table carries the analysis-config hash, so a table can be traced to the exact settings that made it;
nulls print as "n/a" so that an undefined number is never mistaken for a zero. Every row names its
disagreement metric and conditioning: the paper's ranges are set only against rows of the paper's own
definitions (sign metric; main or treatment-independent conditioning), where they are comparable.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import polars as pl

from replaynoise.io import write_text
from replaynoise.report.summary import NA, aligned

#: The paper's figures (method.md section 5; abstract of arXiv 2606.15621). Shares are fractions, excess is pp.
PAPER_RANGES: dict[str, dict[str, Any]] = {
    "excess_pp": {
        "lo": 14.0,
        "hi": 28.0,
        "unit": "pp",
        "text": "14-28",
        "conditioning": "main",
        "label": "re-feed excess over replica floor (pp)",
    },
    "excess_pp_treatment_independent": {
        "lo": 7.0,
        "hi": 21.0,
        "unit": "pp",
        "text": "7-21",
        "conditioning": "treatment_independent",
        "label": "re-feed excess, treatment-independent conditioning (pp)",
    },
    "t": {"lo": 2.9, "hi": 6.4, "unit": "", "text": "2.9-6.4", "label": "problem-clustered t"},
    "replica_disagreement": {
        "lo": 0.09,
        "hi": 0.23,
        "unit": "share",
        "text": "9-23%",
        "label": "replica disagreement on eligible estimates",
    },
    "jaccard_refeed": {"lo": 0.34, "hi": 0.90, "unit": "", "text": "0.34-0.90", "label": "Jaccard re-feed vs exact"},
    "jaccard_replica_ceiling": {
        "lo": 0.63,
        "hi": 0.96,
        "unit": "",
        "text": "0.63-0.96",
        "label": "Jaccard replica ceiling",
    },
    "invariant_disagreement": {
        "lo": 0.0,
        "hi": 0.0,
        "unit": "share",
        "text": "0 (exactly)",
        "label": "batch-invariant run: all passes identical, both rates exactly 0",
    },
    "cache_hit_rate": {
        "lo": 1.0,
        "hi": 1.0,
        "unit": "share",
        "text": "100% over 3434 pivots",
        "n_pivots": 3434,
        "label": "exact-pass cache hits",
    },
    "compute_usd": {"lo": None, "hi": 10.0, "unit": "USD", "text": "< 10 USD", "label": "total compute"},
}


def _range_text(key: str) -> str:
    return PAPER_RANGES[key]["text"]


def paper_range(column: str, conditioning: str, disagreement_metric: str = "sign") -> str:
    """The paper's range for a headline column under a conditioning; "n/a" where the paper reports none.

    The paper's excess has one range per conditioning (main, treatment-independent); its t, floor and
    Jaccard ranges are over Table 1's main set. All are under the sign metric: a value-metric row gets "n/a",
    since counting magnitude changes makes much larger rates (pooled +24.1 pp instead of +18.7).
    """
    if conditioning not in ("main", "treatment_independent") or disagreement_metric != "sign":
        return NA
    if column == "excess_pp":
        return _range_text("excess_pp" if conditioning == "main" else "excess_pp_treatment_independent")
    if conditioning != "main":
        return NA
    key = {
        "floor": "replica_disagreement",
        "t_per_problem": "t",
        "jaccard_refeed": "jaccard_refeed",
        "jaccard_replica_ceiling": "jaccard_replica_ceiling",
    }.get(column)
    return _range_text(key) if key else NA


PAPER_COLUMNS = ("floor", "excess_pp", "t_per_problem", "jaccard_refeed", "jaccard_replica_ceiling")


def with_paper_columns(df: pl.DataFrame) -> pl.DataFrame:
    """Add ``paper_<column>`` string columns with the range that applies to each row's conditioning and metric."""
    conds, metrics = df["conditioning"].to_list(), df["metric"].to_list()
    return df.with_columns(
        pl.Series(f"paper_{col}", [paper_range(col, c, m) for c, m in zip(conds, metrics)], dtype=pl.String)
        for col in PAPER_COLUMNS
    )


# ------------------------------------------------------------------------------------------ formatting


def _pct(x: float | None) -> str:
    return NA if x is None else f"{100 * x:.1f}"


def _rate_with_polarity(rate: float | None, polarity: float | None) -> str:
    """A rate in % with its polarity-reversal share of n in parentheses, as the paper's Table 1 prints them."""
    return NA if rate is None else f"{_pct(rate)} ({_pct(polarity)})"


def _signed(digits: int) -> Callable[[float | None], str]:
    return lambda x: NA if x is None else f"{x:+.{digits}f}"


def _sign_split(r: dict) -> str:
    if r["problems_refeed_worse"] is None:
        return NA
    return f"{r['problems_refeed_worse']}/{r['problems_floor_worse']}/{r['problems_equal']}"


def _fixed(digits: int) -> Callable[[float | None], str]:
    return lambda x: NA if x is None else f"{x:.{digits}f}"


def _with_ci(row: dict, key: str, fmt: Callable[[float | None], str]) -> str:
    est, lo, hi = row.get(key), row.get(f"{key}_ci_lo"), row.get(f"{key}_ci_hi")
    if est is None:
        return NA
    if lo is None or hi is None:
        return fmt(est)
    return f"{fmt(est)} [{fmt(lo)}, {fmt(hi)}]"


def _resolved(r: dict) -> str:
    return NA if r.get("resolved") is None else ("yes" if r["resolved"] else "no")


def _problem_only(r: dict) -> str:
    lo, hi = r.get("excess_pp_problem_ci_lo"), r.get("excess_pp_problem_ci_hi")
    return NA if lo is None or hi is None else f"[{lo:+.1f}, {hi:+.1f}]"


def _pass_sd(r: dict) -> str:
    """The pass-level SD with its interval, or with its upper bound alone where its F test does not reject."""
    est, lo, hi = r.get("pass_sd_pp"), r.get("pass_sd_pp_ci_lo"), r.get("pass_sd_pp_ci_hi")
    if est is not None and lo is None and hi is not None:
        return f"{est:.1f} [up to {hi:.1f}]"
    return _with_ci(r, "pass_sd_pp", _fixed(1))


#: The columns of a replicated run (pairs of draws > 1), set after the excess.
def _replicated_display() -> list[tuple[str, Callable[[dict], str]]]:
    return [
        ("pairs", lambda r: NA if r.get("pairs") is None else str(r["pairs"])),
        ("problem-only CI", _problem_only),
        ("pass-level SD pp", _pass_sd),
        ("resolved", _resolved),
    ]


#: (header, cell function) of the human-readable tables; a replicated run's columns where one is shown.
def _display_columns(replicated: bool = False) -> list[tuple[str, Callable[[dict], str]]]:
    f2, f3 = _fixed(2), _fixed(3)
    return [
        ("config", lambda r: str(r["config"])),
        ("conditioning", lambda r: str(r["conditioning"])),
        ("metric", lambda r: str(r["metric"])),
        ("n (problems)", lambda r: NA if r["n"] is None else f"{r['n']} ({r['n_problems']})"),
        ("re-feed % (pol.)", lambda r: _rate_with_polarity(r["refeed_disagreement"], r["refeed_polarity_share"])),
        ("floor % (pol.)", lambda r: _rate_with_polarity(r["floor"], r["floor_polarity_share"])),
        ("paper floor", lambda r: r["paper_floor"]),
        ("excess pp", lambda r: _with_ci(r, "excess_pp", _signed(1))),
        *(_replicated_display() if replicated else []),
        ("paper excess pp", lambda r: r["paper_excess_pp"]),
        ("per-problem t", lambda r: f2(r["t_per_problem"])),
        ("paper t", lambda r: r["paper_t_per_problem"]),
        ("problems worse re-feed/floor/equal", _sign_split),
        ("OLS t", lambda r: f2(r["t"])),
        ("McNemar z", lambda r: f2(r["mcnemar_z"])),
        ("TI excess pp", lambda r: _with_ci(r, "ti_excess_pp", _signed(1))),
        ("TI per-problem t", lambda r: f2(r["ti_t_per_problem"])),
        ("Jaccard re-feed", lambda r: _with_ci(r, "jaccard_refeed", f2)),
        ("Jaccard ceiling", lambda r: _with_ci(r, "jaccard_replica_ceiling", f2)),
        ("paper Jaccard / ceiling", lambda r: f"{r['paper_jaccard_refeed']} / {r['paper_jaccard_replica_ceiling']}"),
        ("zero-crossing", lambda r: f2(r["share_zero_crossing"])),
        ("reversal", lambda r: f2(r["share_reversal"])),
        ("mean d", lambda r: _with_ci(r, "mean_diff", f3)),
    ]


def is_replicated(df: pl.DataFrame) -> bool:
    """Whether any row is over several pairs of draws (its table then shows their columns)."""
    return "pairs" in df.columns and bool((df["pairs"].fill_null(1) > 1).any())


def _cells(df: pl.DataFrame) -> tuple[list[str], list[list[str]], list[str]]:
    cols = _display_columns(is_replicated(df))
    rows, notes = [], []
    for r in with_paper_columns(df).iter_rows(named=True):
        rows.append([fn(r) for _, fn in cols])
        if r.get("note"):
            notes.append(f"{r['config']} / {r['conditioning']}: {r['note']}")
    return [h for h, _ in cols], rows, notes


REPLICATED_FOOTER = (
    "Replicated passes (pairs > 1): n (pivots per pair), the rates, the excess and the per-problem t are over the "
    "pairs of draws (replica r, refeed r); their intervals resample problems and cover the pass-to-pass noise (a "
    "crossed problems x pairs random-effects model, Satterthwaite t; docs/method.md); problem-only CI: the same "
    "excess with the draws held fixed, the interval one draw per pass can give; pass-level SD: the spread of a "
    "pair's excess the pass draw alone makes, with an interval where its F test (MS pairs / MS residual) rejects "
    "at the interval's level and its upper bound alone (up to) where it does not; resolved: the crossed interval "
    "excludes zero. The other columns are the first pair's."
)


def _footer_lines() -> list[str]:
    return [
        f"Paper: re-feed excess over replica floor {_range_text('excess_pp')} pp main, "
        f"{_range_text('excess_pp_treatment_independent')} pp treatment-independent; "
        f"t {_range_text('t')}; replica disagreement {_range_text('replica_disagreement')}; "
        f"Jaccard {_range_text('jaccard_refeed')} vs ceiling {_range_text('jaccard_replica_ceiling')}.",
        f"Paper: {PAPER_RANGES['invariant_disagreement']['label']}; "
        f"{PAPER_RANGES['cache_hit_rate']['label']} {_range_text('cache_hit_rate')}; "
        f"{PAPER_RANGES['compute_usd']['label']} {_range_text('compute_usd')}.",
        "The paper's ranges are under its own definitions (sign metric; main or treatment-independent "
        "conditioning) and are set only against rows of those definitions.",
        "Rates: re-feed % = D(exact, refeed), floor % = D(exact, replica), polarity-reversal share of n in "
        "parentheses. TI excess: the configuration's treatment-independent excess, with its interval and "
        "per-problem t (the same on each of its rows).",
        "Intervals: problem-cluster bootstrap (percentile). per-problem t (the paper's): one-sample t over "
        "per-problem rate differences, problems weighted equally; OLS t (ours): OLS on a constant, "
        "problem-clustered SE; McNemar z: unclustered, (b - c)/sqrt(b + c).",
    ]


def mismatch_lines(results: Mapping[str, dict]) -> list[str]:
    """One sentence per configuration setting its prefix mismatch beside its credit flips (``comparison.json →
    prefix_mismatch.sentence``); none for a comparison without the channel (the pooled one, older results)."""
    return [
        res["prefix_mismatch"]["sentence"]
        for res in results.values()
        if (res.get("prefix_mismatch") or {}).get("sentence")
    ]


def render_markdown(df: pl.DataFrame, analysis_hash: str, extra: Sequence[str] = ()) -> str:
    """The headline table; ``extra``: lines set after its footer (``mismatch_lines``)."""
    headers, rows, notes = _cells(df)
    lines = [
        f"<!-- analysis_hash: {analysis_hash} -->",
        "",
        f"Analysis hash: `{analysis_hash}`",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    lines += [""] + [f"- {line}" for line in _footer_lines()]
    lines += [f"- {REPLICATED_FOOTER}"] if is_replicated(df) else []
    lines += [f"- note: {n}" for n in notes]
    lines += [f"- prefix mismatch: {line}" for line in extra]
    return "\n".join(lines) + "\n"


_TEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "<": r"\textless{}",
    ">": r"\textgreater{}",
    "|": r"\textbar{}",
}


def tex_escape(text: str) -> str:
    return "".join(_TEX_ESCAPES.get(ch, ch) for ch in text)


def render_latex(df: pl.DataFrame, analysis_hash: str, extra: Sequence[str] = ()) -> str:
    """A booktabs tabular (needs \\usepackage{booktabs}); notes and paper ranges follow as text."""
    headers, rows, notes = _cells(df)
    lines = [
        f"% analysis_hash: {analysis_hash}",
        # the name every committed table carries (this module's before the report subpackage): a table's bytes
        # stay those of the committed runs, whose manifests vouch for them
        "% generated by replaynoise.tables; do not edit",
        r"\begin{tabular}{" + "ll" + "r" * (len(headers) - 2) + "}",
        r"\toprule",
        " & ".join(tex_escape(h) for h in headers) + r" \\",
        r"\midrule",
    ]
    lines += [" & ".join(tex_escape(c) for c in row) + r" \\" for row in rows]
    lines += [r"\bottomrule", r"\end{tabular}", "", r"\par\footnotesize"]
    lines += [tex_escape(line) + r"\\" for line in _footer_lines()]
    lines += [tex_escape(REPLICATED_FOOTER) + r"\\"] if is_replicated(df) else []
    lines += [tex_escape(f"Note: {n}") + r"\\" for n in notes]
    lines += [tex_escape(f"Prefix mismatch: {line}") + r"\\" for line in extra]
    lines.append(tex_escape(f"Analysis hash: {analysis_hash}"))
    return "\n".join(lines) + "\n"


def render_csv(df: pl.DataFrame, analysis_hash: str) -> str:
    """CSV with comment lines first (read back with ``pl.read_csv(path, comment_prefix="#")``)."""
    body = with_paper_columns(df).write_csv(null_value=NA)
    header = [f"# analysis_hash: {analysis_hash}"]
    header += [f"# paper {key}: {_range_text(key)} ({PAPER_RANGES[key]['label']})" for key in PAPER_RANGES]
    return "\n".join(header) + "\n" + body


def write_headline_tables(
    df: pl.DataFrame,
    analysis_hash: str,
    out_csv: str | os.PathLike,
    out_md: str | os.PathLike,
    out_tex: str | os.PathLike,
    extra: Sequence[str] = (),
) -> None:
    """Write the headline frame (``headline_rows``) as CSV, Markdown and LaTeX, atomically; ``extra``: lines
    the Markdown and LaTeX forms set after their footers."""
    write_text(render_csv(df, analysis_hash), out_csv)
    write_text(render_markdown(df, analysis_hash, extra), out_md)
    write_text(render_latex(df, analysis_hash, extra), out_tex)


# ------------------------------------------------------------------------------------- the paper's Table 1

#: Header and cell of each column of the paper's Table 1 (rates in % with one decimal, as the paper prints).
TABLE1_COLUMNS: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("configuration", lambda r: str(r["config"])),
    ("n", lambda r: "—" if r["n"] is None else str(r["n"])),
    ("re-feed % (pol.)", lambda r: _rate_with_polarity(r["refeed_disagreement"], r["refeed_polarity_share"])),
    ("floor % (pol.)", lambda r: _rate_with_polarity(r["floor"], r["floor_polarity_share"])),
    ("excess pp", lambda r: _signed(1)(r["excess_pp"])),
    ("t (per problem)", lambda r: _fixed(2)(r["t_per_problem"])),
    ("McNemar z", lambda r: _fixed(2)(r["mcnemar_z"])),
    ("TI excess pp", lambda r: _signed(1)(r["ti_excess_pp"])),
    (
        "Jaccard re-feed / ceiling",
        lambda r: f"{_fixed(2)(r['jaccard_refeed'])} / {_fixed(2)(r['jaccard_replica_ceiling'])}",
    ),
)


def render_table1(df: pl.DataFrame, conditioning: str) -> str:
    """The paper's Table 1 layout as aligned text, one row per configuration of ``df`` at ``conditioning``.

    An undefined statistic (e.g. t and z when nothing flips, as in the batch-invariant row) prints as "—",
    as in the paper.
    """
    rows = df.filter(pl.col("conditioning") == conditioning)
    if rows.height == 0:
        raise ValueError(f"no headline rows with conditioning {conditioning!r}")
    metrics = sorted(set(rows["metric"].to_list()))
    cells = [[h for h, _ in TABLE1_COLUMNS]]
    cells += [[fn(r).replace(NA, "—") for _, fn in TABLE1_COLUMNS] for r in rows.iter_rows(named=True)]
    lines = [
        f"Table 1 (conditioning {conditioning}, metric {', '.join(metrics)}; rates in %, "
        "polarity-reversal share of n in parentheses)"
    ]
    return "\n".join(lines + aligned(cells)) + "\n"
