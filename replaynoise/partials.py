"""Partial reference folders: what a run cut short by its time limit finished, kept as a folder of its own.

`python -m replaynoise.reference partial RESULTS CAMPAIGN FOLDER` copies the per-pivot credit tables, pivots,
problems, logs and timings, compares exact with the whole pairs of draws that finished (exact with replica draw r and
refeed draw r, for r = 1 .. R) and writes its headline tables, ``partial.json`` (the configuration, and which passes
ran and which the comparison uses) and a manifest. It also keeps each gathered pass's rows, in the columns
``ROW_COLUMNS`` names (ids, verification, cache hits, answers, the first step's digest; tokens and log-probs left out
for size), which cache counts and first-step shares are computed from; its comparison records the exact pivots'
verification and every pass's cache reads from them, as a finished run's does. ``reference.rebuild`` recomputes
such a folder as it does a finished one; what needs the rows' tokens or log-probs (the channels, the prefix
mismatch) is not there.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import polars as pl
import yaml

from replaynoise.analysis.comparison import CACHE_COLUMNS, cache_summary, compare_passes
from replaynoise.analysis.verification import check_verified, verification_summary
from replaynoise.config import analysis_hash, validate_config
from replaynoise.generation.continuations import continuation_seed
from replaynoise.generation.passes import pass_spec, replicate_pairs, run_passes
from replaynoise.io import read_json, read_parquet, write_json, write_parquet
from replaynoise.provenance import write_manifest
from replaynoise.report.headline import headline_rows
from replaynoise.report.tables import write_headline_tables
from replaynoise.settings import AnalysisSettings
from replaynoise.vouching import check_destination, self_description_problems

PARTIAL_FILE = "partial.json"
#: a pass row's columns its continuation seed is derived from, with the seed
SEED_COLUMNS = {"pivot_id", "branch", "k", "seed"}
#: what a cut-short run's results keep in a partial reference folder (``partial``), as far as the run made them
PARTIAL_PARTS = ("credit", "pivots", "problems", "logs", "benchmarks")
#: the columns of a pass's rows (``replay``'s row schema) that a partial folder keeps, in rows/<configuration>/
ROW_COLUMNS = (
    "pivot_id",
    "problem_id",
    "branch",
    "k",
    "seed",
    "batch_id",
    "prefix_source",
    "verified",
    "prefix_len",
    "answer",
    "correct",
    "finish_reason",
    "n_tokens",
    "next_digest",
    "cached_tokens",
    "expected_cached_tokens",
    "tail_tokens",
)


def whole_pairs(present: list[str]) -> list[str]:
    """The passes a comparison of a cut-short run can use: exact and the pairs (replica draw r, refeed draw r) whose
    both draws finished, r = 1 .. R without a gap; a draw whose partner did not finish is left out."""
    pairs = replicate_pairs(present)
    if "exact" not in present or not pairs:
        raise ValueError(f"passes {sorted(present)}: no exact pass with a whole pair of replica and refeed draws")
    return ["exact", *(name for pair in pairs for name in pair)]


def rebuild_partial(reference: Path, out: Path) -> list[Path]:
    """A partial folder's comparison and headline tables (see ``partial``), recomputed into ``out``."""
    record = read_json(reference / PARTIAL_FILE)
    config, name = record["config"], record["configuration"]
    stats = AnalysisSettings.of(config["analysis"], config["seed"])
    credits = {p: read_parquet(reference / "credit" / name / f"{p}.parquet") for p in record["passes_compared"]}
    result = compare_passes(credits, stats)
    result.update(config=name, kernels=config["configs"][name]["kernels"], analysis_hash=analysis_hash(config))
    # what a finished run's compare step records from its rows, where the kept rows hold it: how many exact pivots
    # resumed a verified decode-time state, and every pass run's cache reads (the unpaired draws' too)
    result["verification"] = verification_summary(credits["exact"])
    check_verified(result["verification"], stats.min_verified)  # as a finished run's compare step stops
    kept = [reference / "rows" / name / f"{p}.parquet" for p in record["passes_run"]]
    rows = {f.stem: read_parquet(f) for f in kept if f.is_file()}
    if rows and all(set(frame.columns) >= CACHE_COLUMNS for frame in rows.values()):
        result["prefix_cache"] = cache_summary(rows)
    written = [out / "analysis" / name / "comparison.json"]
    write_json(result, written[0])
    tables = [out / "tables" / f"headline.{ext}" for ext in ("csv", "md", "tex")]
    csv_file, md, tex = tables
    write_headline_tables(headline_rows({name: result}), result["analysis_hash"], csv_file, md, tex, [])
    return written + tables


def campaign_problems(results: Path, config: dict, name: str, present: list[str]) -> list[str]:
    """A line per way the run's files say they were made by another campaign than ``config``: a credit table whose
    pass or K is not the campaign's, a pass's row whose seed is not the one the campaign's root seed derives."""
    problems = self_description_problems(results)
    for pass_name in present:
        credit = results / "credit" / name / f"{pass_name}.parquet"
        ks = read_parquet(credit, columns=["k"])["k"].unique().to_list()
        if ks != [config["replay"]["k"]]:
            problems.append(f"{credit}: column k holds {ks}, the campaign's replay.k is {config['replay']['k']}")
        rows_file = results / "passes" / name / f"{pass_name}.parquet"
        if not rows_file.is_file() or not set(pl.read_parquet_schema(rows_file)) >= SEED_COLUMNS:
            continue
        rows = read_parquet(rows_file, columns=list(SEED_COLUMNS)).filter(pl.col("k") >= 0).head(1)
        for row in rows.iter_rows(named=True):
            noise = pass_spec(pass_name).noise
            expected = continuation_seed(config["seed"], name, row["pivot_id"], row["branch"], row["k"], noise)
            if row["seed"] != expected:
                problems.append(
                    f"{rows_file}: column seed of pivot {row['pivot_id']} is not what the campaign's seed "
                    f"{config['seed']} derives: the run was made with another seed"
                )
    return problems


def partial(results: Path, campaign: Path, reference: Path, note: str = "") -> list[Path]:
    """Keep a cut-short run of ``campaign`` (its one configuration) from ``results`` as the partial reference folder
    ``reference``: what finished (``PARTIAL_PARTS``, the passes' rows in ``ROW_COLUMNS``), ``partial.json``, the
    comparison of the whole pairs of draws, its tables and a manifest. Returns the files written. Refused, before
    anything is written, where exact verified fewer pivots than ``analysis.min_verified`` asks, as the workflow's
    compare step refuses a finished run."""
    results, reference = Path(results), Path(reference)
    config = validate_config(yaml.safe_load(Path(campaign).read_text()))
    if len(config["configs"]) != 1:
        raise ValueError(
            f"{campaign}: a partial folder keeps one configuration, this file has {sorted(config['configs'])}"
        )
    name = next(iter(config["configs"]))
    planned = run_passes(config["replay"])
    present = [p for p in planned if (results / "credit" / name / f"{p}.parquet").is_file()]
    compared = whole_pairs(present)
    problems = campaign_problems(results, config, name, present)
    if problems:
        raise ValueError(f"{campaign}: not the campaign of the run in {results}: " + "; ".join(problems[:10]))
    stats = AnalysisSettings.of(config["analysis"], config["seed"])
    check_verified(verification_summary(read_parquet(results / "credit" / name / "exact.parquet")), stats.min_verified)
    check_destination(reference, [results], "partial")
    if reference.exists() and any(reference.iterdir()):
        raise ValueError(f"{reference}: not empty; partial writes a new folder")
    for part in PARTIAL_PARTS:
        if (results / part).is_dir():
            shutil.copytree(results / part, reference / part)
    for gathered in sorted((results / "passes" / name).glob("*.parquet")):
        rows = read_parquet(gathered)
        write_parquet(
            rows.select([c for c in ROW_COLUMNS if c in rows.columns]), reference / "rows" / name / gathered.name
        )
    record = {
        "campaign": Path(campaign).as_posix(),
        "configuration": name,
        "passes_planned": planned,
        "passes_run": present,
        "passes_compared": compared,
        "note": note,
        "config": config,
    }
    write_json(record, reference / PARTIAL_FILE)
    written = rebuild_partial(reference, reference)
    write_manifest([reference], reference, reference / "MANIFEST.sha256")
    return written
