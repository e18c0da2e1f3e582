"""Reanalysis of published per-pivot records (the paper's result files) with this pipeline's own statistics.

    python -m replaynoise.reanalyze FILE... [--out DIR] [--label NAME] [--k K]
    python -m replaynoise.reanalyze --table1 DIR [--out DIR]

The paper (thaw-ai/thaw, ``benchmarks/results/*/*.json``; Table 1's files are in tests/data/paper-records/)
stores one record per pivot with the three estimates Â^exact1, Â^exact2, Â^refeed. This module is only an
adapter: it maps the records to our credit frames (exact = A_exact1, replica = A_exact2, refeed = A_refeed;
the problem is the cluster) and a per-pivot probe frame, and then calls the very ``compare_passes``,
``headline_rows`` and table and figure functions our own runs use, so that a number reproduced from the
paper's files is evidence that our statistics are the paper's, not a second implementation of them.

What the records cannot give is reported as unavailable, never guessed: they hold no per-branch success
counts (so our ``informative`` conditioning cannot be formed), no selector pass, and no finish reasons (so
eligibility is the paper's ``graded`` rule: every pivot with its exact state verified).
Several files given together are pooled into one configuration, as the paper pools primary + screened.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import polars as pl

from replaynoise.analysis.comparison import compare_passes
from replaynoise.analysis.conditionings import PAPER_CONDITIONING
from replaynoise.analysis.credit import CREDIT_COLUMNS, eligible_expr
from replaynoise.analysis.probes import PROBE_SCHEMA
from replaynoise.analysis.verification import verification_summary
from replaynoise.config import load_schema
from replaynoise.io import stable_hash, write_json, write_text
from replaynoise.paper_records import (
    PASS_KEYS,
    PROBE_SUFFIXES,
    records_frame,
)
from replaynoise.plan import FROM_CREDIT, plot_options
from replaynoise.report.headline import headline_rows
from replaynoise.report.plots import PLOTS
from replaynoise.report.tables import render_table1, write_headline_tables
from replaynoise.settings import AnalysisSettings

#: The paper's Table 1: row label and the files behind it (names of tests/data/paper-records/README.md).
TABLE1_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Main pooled (t=.7, K=4)", ("c2-primary", "c2-screened")),
    ("K=8", ("c2-k8",)),
    ("K=16 (10 problems)", ("c2-k16",)),
    ("Greedy cont. (t=0, K=1)", ("c1-temp0",)),
    ("GRPO ckpt (t=.7, K=4)", ("c1-grpo",)),
    ("Phi-4-mini (t=.7, K=4)", ("c2-phi",)),
    ("Batch-invariant kernels", ("c2-batchinv",)),
)
#: The fewest bootstrap resamples an interval is computed from: the schema's minimum of analysis.n_boot.
MIN_BOOT = load_schema()["properties"]["analysis"]["properties"]["n_boot"]["minimum"]
FIGURES = ("disagreement", "kinds_of_change", "jaccard_sweep", "diff_histogram", "disagreement_vs_margin")


# ------------------------------------------------------------------------------------------------ adapter


def credit_frames(records: pl.DataFrame, k: int) -> dict[str, pl.DataFrame]:
    """Our credit frames (``CREDIT_COLUMNS``) of exact, replica and refeed from the records.

    Per-branch counts and finish counts are unknown (null); every continuation was graded, so a pivot has its
    2K rows, and eligibility is the pipeline's own ``graded`` rule on the records' verification.
    """
    null_int = pl.lit(None, dtype=pl.Int64)
    out = {}
    for name in PASS_KEYS:
        out[name] = (
            records.select(
                "pivot_id",
                "problem_id",
                pl.lit(name, dtype=pl.String).alias("pass_name"),
                "t",
                "margin",
                "prefix_len",
                "rollout_correct",
                "k",
                null_int.alias("n_orig_correct"),
                null_int.alias("n_sub_correct"),
                pl.lit(2 * k, dtype=pl.Int64).alias("n_rows"),
                null_int.alias("n_finished"),
                "verified",
                pl.col(f"a_hat__{name}").alias("a_hat"),
            )
            .with_columns(eligible_expr("graded", k).alias("eligible"))
            .select(CREDIT_COLUMNS)
        )
    return out


def probe_frame(records: pl.DataFrame) -> pl.DataFrame:
    """The per-pivot probe frame (``probes.PROBE_SCHEMA``) from the records' greedy_* keys (max over arms,
    vs exact1, as ``probes.probe_deltas`` computes it from our pass frames)."""
    parts = [
        records.select(
            "pivot_id",
            pl.lit(name, dtype=pl.String).alias("pass_name"),
            pl.col(f"probe_delta__{name}").alias("max_abs_delta"),
            pl.col(f"probe_diverged__{name}").alias("diverged"),
        ).filter(pl.col("max_abs_delta").is_not_null() | pl.col("diverged").is_not_null())
        for name in PROBE_SUFFIXES
    ]
    return pl.concat(parts).select(list(PROBE_SCHEMA)).cast(PROBE_SCHEMA)


# ------------------------------------------------------------------------------------------------ analysis


def default_settings() -> dict:
    """The analysis settings of the embedded default (schema defaults): the paper's definitions."""
    schema = load_schema()["properties"]
    settings = {key: spec["default"] for key, spec in schema["analysis"]["properties"].items() if "default" in spec}
    settings["seed"] = schema["seed"]["default"]
    return settings


def reanalyze(
    paths: Sequence[str | Path], *, label: str, k: int | None = None, settings: dict | None = None
) -> tuple[dict, dict[str, pl.DataFrame]]:
    """The comparison (``compare_passes`` output, plus sources) and the credit frames of one configuration."""
    s = default_settings() | (settings or {})
    if s["n_boot"] < MIN_BOOT:
        raise ValueError(
            f"--n-boot (analysis.n_boot) is {s['n_boot']}; at least {MIN_BOOT} bootstrap resamples are "
            "needed for an interval"
        )
    records, info = records_frame(paths, k)
    credit = credit_frames(records, info["k"])
    result = compare_passes(
        credit,
        AnalysisSettings.of(s, s["seed"]),
        probes=probe_frame(records),
        probe_reason="not recorded in these files",
    )
    analysis_hash = stable_hash({"settings": s, "files": [f["sha256"] for f in info["files"]], "k": info["k"]})
    result.update(
        config=label,
        reanalysis=True,
        sources=info,
        analysis_hash=analysis_hash,
        eligibility="graded",
        verification=verification_summary(credit["exact"]),
    )
    return result, credit


def write_outputs(
    results: dict[str, dict], credits: dict[str, dict[str, pl.DataFrame]], out: Path, draw: bool = True
) -> list[Path]:
    """comparison.json per configuration (in its own folder when several), the headline tables, figures."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for label, result in results.items():
        target = out / "comparison.json" if len(results) == 1 else out / _slug(label) / "comparison.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        write_json(result, target)
        written.append(target)
    table = headline_rows(results)
    analysis_hash = stable_hash([r["analysis_hash"] for r in results.values()])
    paths = [out / f"headline.{ext}" for ext in ("csv", "md", "tex")]
    write_headline_tables(table, analysis_hash, *paths)
    write_text(render_table1(table, PAPER_CONDITIONING), out / "table1.txt")
    written += [*paths, out / "table1.txt"]
    if draw:
        # drawn as the embedded default draws them (the schema's figures block), at the records' metric
        figures = {key: spec["default"] for key, spec in load_schema()["properties"]["figures"]["properties"].items()}
        shown = {"figures": figures, "analysis": {"metric": next(iter(results.values()))["metric"]}}
        (out / "figures").mkdir(exist_ok=True)
        for name in FIGURES:
            png, pdf = out / "figures" / f"{name}.png", out / "figures" / f"{name}.pdf"
            PLOTS[name](credits if name in FROM_CREDIT else results, png, pdf, **plot_options(name, shown))
            written += [png, pdf]
    return written


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label).strip("_")


def table1_files(directory: str | Path) -> list[tuple[str, list[Path]]]:
    """The files of each Table 1 row in ``directory`` (NAME.json.gz or NAME.json); all missing ones named."""
    directory = Path(directory)
    rows, missing = [], []
    for label, stems in TABLE1_ROWS:
        paths = []
        for stem in stems:
            found = [p for p in (directory / f"{stem}.json.gz", directory / f"{stem}.json") if p.is_file()]
            if found:
                paths.append(found[0])
            else:
                missing.append(f"{stem}.json.gz")
        rows.append((label, paths))
    if missing:
        raise FileNotFoundError(
            f"{directory}: missing the paper's file(s) {missing} (names as in tests/data/paper-records/)"
        )
    return rows


def table1(directory: str | Path, settings: dict | None = None) -> tuple[dict[str, dict], dict]:
    """All seven rows of the paper's Table 1 from its files: label -> comparison, label -> credit frames."""
    results, credits = {}, {}
    for label, paths in table1_files(directory):
        results[label], credits[label] = reanalyze(paths, label=label, settings=settings)
    return results, credits


# ---------------------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m replaynoise.reanalyze", description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="per-pivot result files (gz or plain JSON), pooled into one row")
    ap.add_argument("--table1", metavar="DIR", help="a folder with the paper's files: print all of Table 1")
    ap.add_argument(
        "--out",
        metavar="DIR",
        help="where to write comparison.json, the tables and figures "
        "(default results/reanalysis/LABEL; --table1: none)",
    )
    ap.add_argument("--label", help="the configuration's name (default: the files' names)")
    ap.add_argument("--k", type=int, help="continuations per arm, if the files' config lacks it")
    ap.add_argument("--metric", choices=("sign", "value"), help="headline disagreement metric (default sign)")
    ap.add_argument("--n-boot", type=int, help="bootstrap resamples (default: analysis.n_boot)")
    ap.add_argument("--no-figures", action="store_true", help="write no figures")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if bool(args.files) == bool(args.table1):
        _parser().error("give result FILEs or --table1 DIR (not both)")
    settings = {key: value for key, value in (("metric", args.metric), ("n_boot", args.n_boot)) if value is not None}
    try:
        if args.table1:
            if args.k is not None or args.label is not None:
                raise ValueError("--k and --label apply to FILEs, not to --table1")
            results, credits = table1(args.table1, settings)
            out = Path(args.out) if args.out else None
        else:
            label = args.label or "+".join(Path(f).name.split(".")[0] for f in args.files)
            result, credit = reanalyze(args.files, label=label, k=args.k, settings=settings)
            results, credits = {label: result}, {label: credit}
            out = Path(args.out) if args.out else Path("results") / "reanalysis" / _slug(label)
    except (ValueError, FileNotFoundError) as exc:
        print(f"reanalyze: error: {exc}", file=sys.stderr)
        return 2
    print(render_table1(headline_rows(results), PAPER_CONDITIONING), end="")
    if out is not None:
        written = write_outputs(results, credits, out, draw=not args.no_figures)
        print(f"wrote {len(written)} files under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
