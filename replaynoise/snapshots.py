"""A reference folder as a finished run leaves it: the snapshot that commits a run's small outputs, and the check
of a rerun against one (``compare``), which also names the commit that reproduces it when the rerun ran other
code. The commands are ``replaynoise.reference``'s."""

from __future__ import annotations

import csv
import fnmatch
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import polars as pl

from replaynoise.io import read_json, read_manifest, sha256_file, write_text
from replaynoise.report.headline import headline_rows
from replaynoise.report.tables import mismatch_lines, write_headline_tables
from replaynoise.vouching import (
    MANIFEST_FILE,
    check_destination,
    check_own_files,
    folder_problems,
    record_problems,
    require_intact,
    reseal,
    self_description_problems,
)

#: What a snapshot keeps of a run's manifest: small, human-readable outputs and the per-pivot tables every statistic
#: is computed from (credit, prefix mismatch, each row's first step). Replayed rows and KV files stay out; the
#: manifest still carries their checksums. The manifest and provenance.json are copied beside them.
SNAPSHOT_GLOBS = (
    "tables/*",
    "figures/*.png",
    "figures/*.pdf",
    "analysis/*/comparison.json",
    "analysis/*/channels.csv",
    "analysis/*/mismatch.parquet",
    "analysis/*/first_steps.parquet",
    "analysis/*/mechanism.json",
    "credit/*/*.parquet",
    "cost/cost.md",
    "cost/cost.csv",
    "training/*/log.csv",
)
RUN_RECORDS = ("MANIFEST.sha256", "provenance.json")


def snapshot(results: Path, reference: Path) -> list[Path]:
    """Copy what a finished run's manifest lists of ``SNAPSHOT_GLOBS`` (and the manifest and provenance) into
    ``reference``; returns the copied paths. A snapshot holds exactly what its manifest lists: outputs of earlier
    settings left in ``results`` are not copied. ``reference`` must be new, empty or an earlier snapshot (it holds
    a manifest); of an earlier snapshot only the files it manages are replaced, so a README or a reproduce.json
    beside them stays. Nothing is deleted before the new snapshot is complete beside it."""
    results, reference = Path(results), Path(reference)
    if not (results / "MANIFEST.sha256").is_file():
        raise FileNotFoundError(f"{results / 'MANIFEST.sha256'}: no manifest; run the workflow to the end first")
    check_destination(reference, [results], "snapshot", replaces_snapshot=True)
    if reference.exists() and (
        not reference.is_dir() or (any(reference.iterdir()) and not (reference / "MANIFEST.sha256").is_file())
    ):
        raise ValueError(
            f"{reference}: not empty and not an earlier snapshot (no MANIFEST.sha256); snapshot writes "
            "only into a new or empty folder or an earlier snapshot, so it never deletes a user's files"
        )
    listed = sorted(read_manifest(results / "MANIFEST.sha256"))
    chosen = [*RUN_RECORDS, *(rel for rel in listed if any(fnmatch.fnmatch(rel, g) for g in SNAPSHOT_GLOBS))]
    missing = [rel for rel in chosen if not (results / rel).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{results}: {len(missing)} file(s) the manifest lists are missing, e.g. "
            f"{missing[0]}; rerun the workflow (snakemake verify names them all)"
        )
    manifest = read_manifest(results / "MANIFEST.sha256")
    problems = [
        f"{results / rel}: differs from its manifest"
        for rel in chosen[len(RUN_RECORDS) :]
        if sha256_file(results / rel) != manifest[rel]
    ]
    problems += record_problems(results) + self_description_problems(results)
    if problems:
        raise ValueError(f"{results}: snapshot copies only what its records vouch for: " + "; ".join(problems[:10]))
    reference.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{reference.name}.", dir=reference.parent))
    try:
        for rel in chosen:
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(results / rel, staged / rel)
        if reference.exists():  # an earlier snapshot: its managed files give way to the new ones
            for old in [
                *RUN_RECORDS,
                *(p.relative_to(reference).as_posix() for g in SNAPSHOT_GLOBS for p in reference.glob(g)),
            ]:
                (reference / old).unlink(missing_ok=True)
        for rel in chosen:
            (reference / rel).parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged / rel, reference / rel)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return [reference / rel for rel in chosen]


@dataclass
class Comparison:
    """How a rerun's manifest relates to the reference's, path by path."""

    identical: list[str] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return not (self.differing or self.missing or self.extra)


def compare_manifests(reference: dict[str, str], rerun: dict[str, str]) -> Comparison:
    result = Comparison()
    for path, digest in sorted(reference.items()):
        if path not in rerun:
            result.missing.append(path)
        elif rerun[path] == digest:
            result.identical.append(path)
        else:
            result.differing.append(path)
    result.extra = sorted(set(rerun) - set(reference))
    return result


def table_differences(reference_csv: Path, rerun_csv: Path, limit: int = 20) -> list[str]:
    """Cell-level differences between two CSV tables of the same shape, largest numeric change first."""
    ref, new = (pl.read_csv(path, infer_schema_length=0, comment_prefix="#") for path in (reference_csv, rerun_csv))
    if ref.columns != new.columns or ref.height != new.height:
        return [f"shape differs: {ref.height} x {ref.columns} vs {new.height} x {new.columns}"]
    found = []
    for column in ref.columns:
        for row, (a, b) in enumerate(zip(ref[column].to_list(), new[column].to_list())):
            if a == b:
                continue
            try:
                delta = abs(float(b) - float(a))
            except (TypeError, ValueError):
                delta = float("inf")
            found.append((delta, f"row {row} {column}: {a} -> {b}"))
    found.sort(key=lambda item: -item[0])
    lines = [text for _, text in found[:limit]]
    if len(found) > limit:
        lines.append(f"... and {len(found) - limit} more cells")
    return lines


#: A reference folder's record of the commit whose code reproduces it, where its provenance.json cannot name it
#: (a run from a working tree whose changes were committed later): {"commit": full hash or null, "note": how it
#: was found, or why no commit is known}.
REPRODUCE_FILE = "reproduce.json"


def _git(folder: Path) -> dict:
    path = Path(folder) / "provenance.json"
    git = read_json(path).get("git") if path.is_file() else None
    return git if isinstance(git, dict) else {}


def reproducing_commit(reference: Path) -> tuple[str | None, str]:
    """(the commit whose code reproduces ``reference`` or None, where that is said): its ``reproduce.json``,
    else its provenance.json's commit when the run's tree was clean."""
    reference = Path(reference)
    if (reference / REPRODUCE_FILE).is_file():
        record = read_json(reference / REPRODUCE_FILE)
        commit = record.get("commit")
        return (str(commit) if commit else None), f"{reference / REPRODUCE_FILE}: {record.get('note', '')}".rstrip(": ")
    git = _git(reference)
    if git.get("commit") and not git.get("dirty"):
        return str(git["commit"]), f"{reference / 'provenance.json'}"
    if git.get("commit"):
        return None, (
            f"{reference / 'provenance.json'}: {git['commit']} with uncommitted changes; no "
            f"{REPRODUCE_FILE} names the commit that holds them"
        )
    return None, ""


def code_version_note(reference: Path, results: Path) -> str | None:
    """Why a rerun may differ before any number is read: its code is not the reference's. The engine's numerics
    change with its code (cache buckets, attention kernels), so a rerun on another commit is not a check of the
    reference; the note names the commit to check out. None where the rerun ran that commit, clean, or where
    neither folder records any code version."""
    commit, source = reproducing_commit(reference)
    git = _git(results)
    ran = git.get("commit")
    if commit is not None and ran and not git.get("dirty") and (ran.startswith(commit) or commit.startswith(ran)):
        return None
    if commit is None and not source:
        return None
    rerun = f"{ran}{' with uncommitted changes' if git.get('dirty') else ''}" if ran else "an unrecorded version"
    if commit is None:
        return f"Code version: no commit is known to reproduce the reference ({source}); this rerun ran {rerun}."
    return (
        f"Code version differs: the reference is reproduced by commit {commit} ({source}); this rerun ran "
        f"{rerun}. Check out {commit} to reproduce the reference; with other code its numbers can differ "
        "for that reason alone."
    )


def compare(reference: Path, results: Path, out: TextIO | None = None) -> bool:
    """Compare a rerun in ``results`` with the committed ``reference``; print a report; True if identical. Each
    folder's files are checked against its own manifest first: a comparison of manifests alone passes a
    reference whose committed tables were edited."""
    out = sys.stdout if out is None else out
    reference, results = Path(reference), Path(results)
    for folder in (reference, results):
        if not (folder / "MANIFEST.sha256").is_file():
            raise FileNotFoundError(f"{folder / 'MANIFEST.sha256'}: no manifest")
    edited = {folder: folder_problems(folder) for folder in (reference, results)}
    for names in edited.values():
        for line in names:
            print(f"  edited: {line}", file=out)
    if any(edited.values()):
        print(
            f"{sum(map(len, edited.values()))} file(s) differ from their own folder's records: the folders "
            "cannot be compared until they are restored (git checkout, or a rerun)",
            file=out,
        )
        return False
    hashes = [recorded_analysis_hash(folder) for folder in (reference, results)]
    other_settings = None not in hashes and hashes[0] != hashes[1]
    if other_settings:
        print(
            f"The analysis hashes differ ({reference}: {hashes[0]}, {results}: {hashes[1]}): the two runs had "
            "different protocol settings (compare 'config' in their provenance.json files), so their results "
            "are expected to differ; this is not last-bit drift.",
            file=out,
        )
    outcome = compare_manifests(
        read_manifest(reference / "MANIFEST.sha256"), read_manifest(results / "MANIFEST.sha256")
    )
    total = len(outcome.identical) + len(outcome.differing) + len(outcome.missing)
    print(
        f"{len(outcome.identical)} of {total} reference files identical (sha256), {len(outcome.differing)} "
        f"differ, {len(outcome.missing)} missing from the rerun, {len(outcome.extra)} only in the rerun",
        file=out,
    )
    note = code_version_note(reference, results)
    if note:
        print(note, file=out)
    _print_differences(outcome, reference, results, out)
    if not outcome.agrees and not other_settings:
        print(
            "Differences on a different CPU, GPU or library version can be last-bit drift of the kernels "
            "(compare 'hardware' and 'packages' in the two provenance.json files); on the same platform "
            "and pins they are a different result.",
            file=out,
        )
    return outcome.agrees


def _print_differences(outcome: Comparison, reference: Path, results: Path, out: TextIO) -> None:
    """Each file that differs, is missing or is extra, with the cells that changed of a table that differs."""
    for label, paths in (("differs", outcome.differing), ("missing", outcome.missing), ("extra", outcome.extra)):
        for path in paths:
            print(f"  {label}: {path}", file=out)
            if label == "differs" and path.endswith(".csv") and (reference / path).is_file():
                for line in table_differences(reference / path, results / path):
                    print(f"      {line}", file=out)


def recorded_analysis_hash(folder: Path) -> str | None:
    """The analysis hash a run's provenance.json records (None where it has none)."""
    provenance = Path(folder) / "provenance.json"
    return read_json(provenance).get("analysis_hash") if provenance.is_file() else None


#: How far a rebuilt number may move from the committed one and still be the same result (a real difference moves it
#: far more): another CPU's kernels move mostly last bits (1e-15), but an ill-conditioned fit magnifies them. On an
#: AVX2 EPYC (Zen 3) the near-separated logit of reference/gpu-vllm/ladder/smollm2 (88 log-odds per SD) rebuilt with
#: its p 2.7e-9 apart (a p moves by about z^2 times its z): the largest drift of any folder there; 1e-9 failed it
DRIFT_TOLERANCE = 1e-7


def _values(path: Path) -> list:
    """A JSON file's leaves or a CSV file's cells, in order, for a comparison value by value."""
    if path.suffix == ".json":
        leaves: list[Any] = []
        stack = [read_json(path)]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                leaves.append(tuple(sorted(node)))
                stack.extend(node[k] for k in sorted(node, reverse=True))
            elif isinstance(node, list):
                leaves.append(len(node))
                stack.extend(reversed(node))
            else:
                leaves.append(node)
        return leaves
    return [cell for row in csv.reader(path.read_text().splitlines()) for cell in [len(row), *row]]


def float_drift(reference_file: Path, rebuilt_file: Path) -> float | None:
    """The largest relative difference between two files' numbers where everything else in them is equal;
    None where anything else differs. Linear algebra on another CPU or BLAS moves the last bits of an OLS t (and
    more of an ill-conditioned fit's: ``DRIFT_TOLERANCE``); a statistic that is zero exactly comes out as 1e-17
    there, so magnitudes below 1e-6 count as 1e-6."""
    ref, new = _values(reference_file), _values(rebuilt_file)
    if len(ref) != len(new):
        return None
    worst = 0.0
    for a, b in zip(ref, new):
        if a == b:
            continue
        try:
            x, y = float(a), float(b)
        except (TypeError, ValueError):
            return None
        worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-6))
    return worst


def drift_only(committed: Path, rebuilt: Path) -> float | None:
    """The float drift of a rebuilt JSON or CSV file from its committed one where it is within ``DRIFT_TOLERANCE``
    (the same result); None where the committed file is absent, is of another kind, or differs by more."""
    if not committed.is_file() or rebuilt.suffix not in (".json", ".csv"):
        return None
    drift = float_drift(committed, rebuilt)
    return drift if drift is not None and drift <= DRIFT_TOLERANCE else None


HEADLINE_FILES = tuple(f"tables/headline.{ext}" for ext in ("csv", "md", "tex"))


def rewrite_manifest_lines(reference: Path, names: list[str]) -> None:
    """Set the manifest lines of ``names`` (paths relative to ``reference``) to the files' digests as they now
    stand, adding the lines of files the manifest did not list."""
    manifest_path = reference / MANIFEST_FILE
    entries = read_manifest(manifest_path)
    entries.update({name: sha256_file(reference / name) for name in names})
    write_text("".join(f"{digest}  {name}\n" for name, digest in entries.items()), manifest_path)
    reseal(reference)


def refresh_tables(reference: Path) -> list[Path]:
    """Rewrite a reference folder's headline tables from its committed comparisons, after a change of the table
    code alone, and their lines in its manifest (which vouches for the folder's files as they now stand).
    The committed comparisons are used, not recomputed ones, so every cell the old tables had keeps its bytes
    (a recomputation on another CPU moves the last bits of the OLS floats)."""
    reference = Path(reference)
    require_intact(reference, "tables", reads=["analysis/*/comparison.json"])
    check_own_files(reference, [*HEADLINE_FILES, MANIFEST_FILE], "tables")
    pooled = read_json(reference / "analysis" / "pooled" / "comparison.json")
    results = {c: read_json(reference / "analysis" / c / "comparison.json") for c in pooled["configs"]}
    csv_file, md, tex = tables = [reference / name for name in HEADLINE_FILES]
    everything = {**results, "pooled": pooled}
    write_headline_tables(
        headline_rows(everything), pooled["analysis_hash"], csv_file, md, tex, mismatch_lines(everything)
    )
    rewrite_manifest_lines(reference, list(HEADLINE_FILES))
    return tables
