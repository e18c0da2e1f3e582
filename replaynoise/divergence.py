"""Where two runs of one campaign part: their manifests compared file by file in pipeline order (problems, rollouts,
pivots, each pass, credit, analysis), the first file that differs, the first row that differs where both runs hold
its table, and whether the two runs' headline statistics agree within their intervals. A rerun that differs is
explained by its earliest difference; everything after it follows from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from replaynoise.generation.passes import run_passes
from replaynoise.io import read_json, read_manifest
from replaynoise.report.headline import headline_rows
from replaynoise.snapshots import compare_manifests

#: The results' top folders in the order the pipeline makes them; a folder not named sorts last.
STAGES = ("models", "problems", "training", "rollouts", "pivots", "passes", "credit", "analysis", "tables", "figures")
#: Columns that name a row of the pipeline's tables, in the order they are reported (those a table has).
ROW_KEYS = ("pass", "pass_name", "problem_id", "rollout", "pivot_id", "branch", "k", "t")
#: The headline statistics compared between two runs, each with its interval.
STATISTICS = ("floor", "refeed_disagreement", "excess_pp")


def path_order(rel: str, passes: list[str]) -> tuple:
    """A results path's place in pipeline order: its stage, then (passes and credit) its pass in the run's order,
    then a shard before the table gathered from it."""
    parts = rel.split("/")
    stage = STAGES.index(parts[0]) if parts[0] in STAGES else len(STAGES)
    name = parts[2].removesuffix(".parquet") if len(parts) > 2 and parts[0] in ("passes", "credit") else None
    pass_rank = passes.index(name) if name in passes else len(passes)
    gathered = 0 if "shards" in parts or (name is not None and len(parts) > 3) else 1
    return stage, pass_rank, gathered, rel


def _pass_of(rel: str, passes: list[str]) -> str | None:
    parts = rel.split("/")
    if parts[0] in ("passes", "credit") and len(parts) > 2:
        name = parts[2].removesuffix(".parquet")
        return name if name in passes else None
    return None


def _same(a: Any, b: Any) -> bool:
    """Values equal to the bit as their reprs show them (a NaN equals a NaN; 0.0 and -0.0 differ)."""
    return repr(a) == repr(b)


def first_row_difference(reference: Path, rerun: Path) -> dict[str, Any] | None:
    """The first row of ``reference``'s table (a parquet file) that the rerun's lacks or holds with other values,
    named by its key columns (``ROW_KEYS``), with the columns that differ; then the first row only the rerun has.
    None where every row agrees (the files differ in their encoding alone)."""
    ref, new = pl.read_parquet(reference), pl.read_parquet(rerun)
    if ref.columns != new.columns:
        return {"columns_reference": ref.columns, "columns_rerun": new.columns}
    keys = [c for c in ROW_KEYS if c in ref.columns]
    ref_rows, new_rows = ref.to_dicts(), new.to_dicts()
    for rows in (ref_rows, new_rows):  # no key, or one that does not name a row: rows by position
        if len({tuple(r[k] for k in keys) for r in rows}) != len(rows):
            keys = []
    if not keys:
        keys = ["position"]
        ref_rows, new_rows = ([{**r, "position": i} for i, r in enumerate(rows)] for rows in (ref_rows, new_rows))
    index = {tuple(r[k] for k in keys): r for r in new_rows}
    for i, row in enumerate(ref_rows):
        other = index.pop(tuple(row[k] for k in keys), None)
        if other is None or not all(_same(row[c], other[c]) for c in ref.columns):
            return {
                "row": i,
                "key": {k: row[k] for k in keys},
                "columns": [c for c in ref.columns if other is None or not _same(row[c], other[c])],
                "only_in": "reference" if other is None else None,
            }
    for row in index.values():
        return {"row": None, "key": {k: row[k] for k in keys}, "columns": [], "only_in": "rerun"}
    return None


def _rows_where_held(rel: str, reference: Path, results: Path, passes: list[str]) -> tuple[str, dict | None] | None:
    """The first differing row of ``rel``, or where the reference holds only its checksum (a pass's rows), of the
    same pass's credit table, which a reference keeps: (the table read, its first differing row). None where
    neither folder pair holds a table to read."""
    candidates = [rel]
    name = _pass_of(rel, passes)
    if name is not None:
        candidates.append(f"credit/{rel.split('/')[1]}/{name}.parquet")
    for candidate in candidates:
        if candidate.endswith(".parquet") and (reference / candidate).is_file() and (results / candidate).is_file():
            return candidate, first_row_difference(reference / candidate, results / candidate)
    return None


def divergence(reference: Path, results: Path, replay: dict) -> dict[str, Any]:
    """The two manifests compared file by file: counts, every file that differs, is missing or extra, each stage's
    count of such files, and the first in pipeline order with its pass and first differing row where available."""
    reference, results = Path(reference), Path(results)
    passes = run_passes(replay)
    outcome = compare_manifests(
        read_manifest(reference / "MANIFEST.sha256"), read_manifest(results / "MANIFEST.sha256")
    )
    labelled = [(rel, "differs") for rel in outcome.differing] + [(rel, "missing") for rel in outcome.missing]
    labelled += [(rel, "extra") for rel in outcome.extra]
    labelled.sort(key=lambda item: path_order(item[0], passes))
    stages: dict[str, int] = {}
    for rel, _ in labelled:
        stages[rel.split("/")[0]] = stages.get(rel.split("/")[0], 0) + 1
    found: dict[str, Any] = {
        "identical": len(outcome.identical),
        "compared": len(outcome.identical) + len(outcome.differing) + len(outcome.missing),
        "differing": outcome.differing,
        "missing": outcome.missing,
        "extra": outcome.extra,
        "stages": stages,
        "first": None,
    }
    if labelled:
        rel, state = labelled[0]
        first: dict[str, Any] = {"file": rel, "state": state, "stage": rel.split("/")[0], "pass": _pass_of(rel, passes)}
        first_pass = next((p for p in map(lambda item: _pass_of(item[0], passes), labelled) if p), None)
        first["first_pass_differing"] = first_pass
        held = _rows_where_held(rel, reference, results, passes) if state == "differs" else None
        first["rows"] = {"table": held[0], "first_difference": held[1]} if held else None
        found["first"] = first
    return found


def _headline(folder: Path) -> dict[tuple[str, str], dict]:
    pooled = read_json(folder / "analysis" / "pooled" / "comparison.json")
    results = {c: read_json(folder / "analysis" / c / "comparison.json") for c in pooled["configs"]}
    rows = headline_rows({**results, "pooled": pooled}).to_dicts()
    return {(r["config"], r["conditioning"]): r for r in rows}


def statistics_agreement(reference: Path, results: Path) -> dict[str, Any]:
    """Each headline statistic (``STATISTICS``) of every configuration and conditioning both runs report: the two
    estimates with their intervals, and whether each estimate lies in the other's interval ("agree"), or why not
    compared. ``agree`` overall: every comparable statistic agrees."""
    try:
        ref, new = _headline(Path(reference)), _headline(Path(results))
    except (FileNotFoundError, KeyError) as exc:
        return {"agree": None, "reason": f"not compared: {exc}", "rows": []}
    rows = []
    for key in [k for k in ref if k in new]:
        for stat in STATISTICS:
            a, b = ref[key], new[key]
            values = [a[stat], a[f"{stat}_ci_lo"], a[f"{stat}_ci_hi"], b[stat], b[f"{stat}_ci_lo"], b[f"{stat}_ci_hi"]]
            comparable = None not in values
            agree = comparable and values[4] <= values[0] <= values[5] and values[1] <= values[3] <= values[2]
            rows.append(
                {
                    "config": key[0],
                    "conditioning": key[1],
                    "statistic": stat,
                    "reference": values[:3],
                    "rerun": values[3:],
                    "agree": agree if comparable else None,
                }
            )
    judged = [r["agree"] for r in rows if r["agree"] is not None]
    return {"agree": all(judged) if judged else None, "rows": rows}
