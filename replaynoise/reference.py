"""Committed reference results, and the check of a rerun against them.

A reviewer reruns a campaign and asks one question: are these the numbers in the repository? The manifest
answers it for every output, KV files included, since it holds their sha256 even where the files themselves
are too large to commit. Where a table differs, the check also prints which cells changed and by how much,
so a reviewer can tell a platform's last-bit drift from a different result.

    python -m replaynoise.reference snapshot results reference/cpu   # after a campaign, to commit
    python -m replaynoise.reference compare reference/cpu results    # after a rerun; exit 1 on a difference
    python -m replaynoise.reference rebuild reference/gpu/qwen /tmp/qwen  # on CPU; exit 1 on a difference
    python -m replaynoise.reference figure reference/gpu reference/gpu/smollm2 reference/gpu/qwen ...

`rebuild` recomputes a reference folder's statistics, tables and figures from its committed per-pivot credit
tables and configuration alone, and checks each rebuilt file against the folder's manifest: a reader needs no
GPU to see that the committed numbers follow from the committed pivots. What needs the replayed rows (the
channels, the probe, the verification and the cache counts; not committed, their sha256 is in the manifest) is
taken as committed.

`tables` rewrites a reference folder's headline tables from its committed comparisons after a change of the
table code alone. `compare` also names the commit that reproduces the reference (its ``reproduce.json``, or its
clean provenance) when the rerun ran other code.

`figure` redraws the channel-agreement figure of several reference folders together (one run's workflow draws
only its own configurations), from their committed analysis files alone, so a reader can rebuild it on CPU.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl

from replaynoise import control_report, figures, plan
from replaynoise.analysis import compare_passes, comparison_settings
from replaynoise.config import analysis_hash
from replaynoise.io import read_json, read_manifest, read_parquet, sha256_file, write_json
from replaynoise.mismatch import mismatch_summary
from replaynoise.passes import run_passes
from replaynoise.pooling import pooled_comparison
from replaynoise.tables import headline_rows, mismatch_lines, write_headline_tables

#: How far a rebuilt number may move from the committed one and still be the same result (last-bit drift of
#: floating point on another CPU; a real difference in a pivot moves a rate by 1/n, far more)
DRIFT_TOLERANCE = 1e-9
#: comparison.json entries computed from the replayed rows (the prefix mismatch from every prefix token's two
#: log-probs), which a reference folder does not hold
FROM_ROWS = ("probe", "verification", "prefix_cache", "controls", "prefix_mismatch")

#: What a snapshot keeps of a run's manifest: small, human-readable outputs and the per-pivot tables every statistic
#: is computed from (credit, prefix mismatch). Replayed rows and KV files stay out; the manifest still carries their
#: checksums. The manifest and provenance.json are copied beside them.
SNAPSHOT_GLOBS = (
    "tables/*", "figures/*.png", "figures/*.pdf", "analysis/*/comparison.json", "analysis/*/channels.csv",
    "analysis/*/mismatch.parquet", "credit/*/*.parquet", "cost/cost.md", "cost/cost.csv", "training/*/log.csv",
)
RUN_RECORDS = ("MANIFEST.sha256", "provenance.json")


def _holds(folder: Path, path: Path) -> bool:
    """``folder`` is ``path`` or one of the folders above it (both resolved)."""
    folder, path = folder.resolve(), path.resolve()
    return folder == path or folder in path.parents


def check_destination(dest: Path, sources: list[Path], action: str) -> None:
    """Refuse a destination a command would delete or write into that is a source, lies inside one, or is (or
    holds) a source or the current folder: ``snapshot results results`` once deleted every result."""
    for source in [*sources, Path.cwd()]:
        what = "the current folder" if source == Path.cwd() else str(source)
        if _holds(dest, source):
            raise ValueError(f"{dest}: {action} would write into {what}, which it is or holds; give a folder "
                             "outside it")
        if _holds(source, dest) and source != Path.cwd():
            raise ValueError(f"{dest}: {action} would write inside {what}; give a folder outside it")


def snapshot(results: Path, reference: Path) -> list[Path]:
    """Copy what a finished run's manifest lists of ``SNAPSHOT_GLOBS`` (and the manifest and provenance) into
    ``reference``; returns the copied paths. A snapshot holds exactly what its manifest lists: outputs of earlier
    settings left in ``results`` are not copied. ``reference`` must be new, empty or an earlier snapshot (it holds
    a manifest); of an earlier snapshot only the files it manages are replaced, so a README or a reproduce.json
    beside them stays. Nothing is deleted before the new snapshot is complete beside it."""
    results, reference = Path(results), Path(reference)
    if not (results / "MANIFEST.sha256").is_file():
        raise FileNotFoundError(f"{results / 'MANIFEST.sha256'}: no manifest; run the workflow to the end first")
    check_destination(reference, [results], "snapshot")
    if reference.exists() and (not reference.is_dir() or (any(reference.iterdir())
                                                         and not (reference / "MANIFEST.sha256").is_file())):
        raise ValueError(f"{reference}: not empty and not an earlier snapshot (no MANIFEST.sha256); snapshot writes "
                         "only into a new or empty folder or an earlier snapshot, so it never deletes a user's files")
    listed = sorted(read_manifest(results / "MANIFEST.sha256"))
    chosen = [*RUN_RECORDS, *(rel for rel in listed if any(fnmatch.fnmatch(rel, g) for g in SNAPSHOT_GLOBS))]
    missing = [rel for rel in chosen if not (results / rel).is_file()]
    if missing:
        raise FileNotFoundError(f"{results}: {len(missing)} file(s) the manifest lists are missing, e.g. "
                                f"{missing[0]}; rerun the workflow (snakemake verify names them all)")
    reference.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{reference.name}.", dir=reference.parent))
    try:
        for rel in chosen:
            (staged / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(results / rel, staged / rel)
        if reference.exists():  # an earlier snapshot: its managed files give way to the new ones
            for old in [*RUN_RECORDS, *(p.relative_to(reference).as_posix() for g in SNAPSHOT_GLOBS
                                        for p in reference.glob(g))]:
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
        return None, (f"{reference / 'provenance.json'}: {git['commit']} with uncommitted changes; no "
                      f"{REPRODUCE_FILE} names the commit that holds them")
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
    return (f"Code version differs: the reference is reproduced by commit {commit} ({source}); this rerun ran "
            f"{rerun}. Check out {commit} to reproduce the reference; with other code its numbers can differ "
            "for that reason alone.")


def edited_files(folder: Path) -> list[str]:
    """The files in ``folder`` whose bytes its own manifest does not vouch for (an edited table, a comparison
    rewritten by hand): every file the manifest lists that the folder holds must match it. Files a folder does
    not hold (replayed rows, KV) are vouched for by the manifest alone."""
    folder = Path(folder)
    return [rel for rel, digest in read_manifest(folder / "MANIFEST.sha256").items()
            if (folder / rel).is_file() and sha256_file(folder / rel) != digest]


def compare(reference: Path, results: Path, out=None) -> bool:
    """Compare a rerun in ``results`` with the committed ``reference``; print a report; True if identical. Each
    folder's files are checked against its own manifest first: a comparison of manifests alone passes a
    reference whose committed tables were edited."""
    out = sys.stdout if out is None else out
    reference, results = Path(reference), Path(results)
    for folder in (reference, results):
        if not (folder / "MANIFEST.sha256").is_file():
            raise FileNotFoundError(f"{folder / 'MANIFEST.sha256'}: no manifest")
    edited = {folder: edited_files(folder) for folder in (reference, results)}
    for folder, names in edited.items():
        for rel in names:
            print(f"  edited: {folder / rel} differs from {folder / 'MANIFEST.sha256'}", file=out)
    if any(edited.values()):
        print(f"{sum(map(len, edited.values()))} file(s) differ from their own folder's manifest: the folders "
              "cannot be compared until they are restored (git checkout, or a rerun)", file=out)
        return False
    hashes = [recorded_analysis_hash(folder) for folder in (reference, results)]
    other_settings = None not in hashes and hashes[0] != hashes[1]
    if other_settings:
        print(f"The analysis hashes differ ({reference}: {hashes[0]}, {results}: {hashes[1]}): the two runs had "
              "different protocol settings (compare 'config' in their provenance.json files), so their results "
              "are expected to differ; this is not last-bit drift.", file=out)
    outcome = compare_manifests(read_manifest(reference / "MANIFEST.sha256"),
                                read_manifest(results / "MANIFEST.sha256"))
    total = len(outcome.identical) + len(outcome.differing) + len(outcome.missing)
    print(f"{len(outcome.identical)} of {total} reference files identical (sha256), {len(outcome.differing)} "
          f"differ, {len(outcome.missing)} missing from the rerun, {len(outcome.extra)} only in the rerun", file=out)
    note = code_version_note(reference, results)
    if note:
        print(note, file=out)
    for label, paths in (("differs", outcome.differing), ("missing", outcome.missing), ("extra", outcome.extra)):
        for path in paths:
            print(f"  {label}: {path}", file=out)
            if label == "differs" and path.endswith(".csv") and (reference / path).is_file():
                for line in table_differences(reference / path, results / path):
                    print(f"      {line}", file=out)
    if not outcome.agrees and not other_settings:
        print("Differences on a different CPU, GPU or library version can be last-bit drift of the kernels "
              "(compare 'hardware' and 'packages' in the two provenance.json files); on the same platform "
              "and pins they are a different result.", file=out)
    return outcome.agrees


def recorded_analysis_hash(folder: Path) -> str | None:
    """The analysis hash a run's provenance.json records (None where it has none)."""
    provenance = Path(folder) / "provenance.json"
    return read_json(provenance).get("analysis_hash") if provenance.is_file() else None


def channel_data(folders: list[Path]) -> dict[str, tuple[dict, pl.DataFrame]]:
    """Every configuration's comparison and channels, folder by folder in the order given (the figure's row
    order), configurations by name within a folder; the pooled analysis has no channels and is left out."""
    data: dict[str, tuple[dict, pl.DataFrame]] = {}
    for folder in folders:
        found = sorted(p.parent for p in (folder / "analysis").glob("*/channels.csv"))
        if not found:
            raise FileNotFoundError(f"{folder}: no analysis/<config>/channels.csv (not a reference folder?)")
        for config in found:
            if config.name in data:
                raise ValueError(f"configuration {config.name!r} is in two of the folders given ({folder})")
            data[config.name] = (read_json(config / "comparison.json"), pl.read_csv(config / "channels.csv"))
    return data


def rebuild(reference: Path, out: Path) -> list[Path]:
    """Recompute ``reference``'s comparisons, headline tables and figures into ``out`` (a results-like tree)
    as the workflow's rules do, from its credit tables and recorded configuration; returns the files written."""
    reference, out = Path(reference), Path(out)
    check_destination(out, [reference], "rebuild")
    config = read_json(reference / "provenance.json")["config"]
    pooled_ref = read_json(reference / "analysis" / "pooled" / "comparison.json")
    configs, passes = list(pooled_ref["configs"]), run_passes(config["replay"])
    if pooled_ref["analysis_hash"] != analysis_hash(config):
        raise ValueError(f"{reference}: provenance.json's configuration has analysis hash {analysis_hash(config)}, "
                         f"the committed analysis {pooled_ref['analysis_hash']}")
    credits = {c: {p: read_parquet(reference / "credit" / c / f"{p}.parquet") for p in passes} for c in configs}
    stats = comparison_settings(config["analysis"], config["seed"])
    committed = channel_data([reference])
    written, comparisons = [], {}
    for c in configs:
        result = compare_passes(credits[c], **stats)
        result.update({key: committed[c][0][key] for key in FROM_ROWS if key in committed[c][0]})
        result.update(config=c, kernels=committed[c][0]["kernels"], analysis_hash=pooled_ref["analysis_hash"])
        mismatch = reference / "analysis" / c / "mismatch.parquet"
        if mismatch.is_file():  # the per-pivot prefix mismatch is committed: its link to the flips is recomputed
            result["prefix_mismatch"] = mismatch_summary(read_parquet(mismatch), credits[c], result, config=c,
                                                         metric=stats["metric"], min_eligible=stats["min_eligible"],
                                                         ci=stats["ci"])
        comparisons[c] = result
        written.append(out / "analysis" / c / "comparison.json")
        write_json(result, written[-1])
    pooled = pooled_comparison(credits, {c: config["configs"][c] for c in configs}, config["analysis"],
                               config["seed"], pooled_ref["analysis_hash"])
    written.append(out / "analysis" / "pooled" / "comparison.json")
    write_json(pooled, written[-1])
    tables = [out / "tables" / f"headline.{ext}" for ext in ("csv", "md", "tex")]
    everything = {**comparisons, "pooled": pooled}
    write_headline_tables(headline_rows(everything), pooled_ref["analysis_hash"], *tables, mismatch_lines(everything))
    written += tables
    drawn = {name: comparisons for name in plan.FROM_COMPARISONS} | {name: credits for name in plan.FROM_CREDIT}
    drawn["channel_agreement"] = {c: (comparisons[c], committed[c][1]) for c in configs}
    for name, data in drawn.items():
        png, pdf = out / "figures" / f"{name}.png", out / "figures" / f"{name}.pdf"
        getattr(figures, f"plot_{name}")(data, png, pdf, **plan.plot_options(name, config))
        written += [png, pdf]
    controls = plan.control_outputs(passes)  # from the committed controls block
    for name in controls["figures"]:
        png, pdf = out / "figures" / f"{name}.png", out / "figures" / f"{name}.pdf"
        getattr(control_report, f"plot_{name}")(comparisons, png, pdf)
        written += [png, pdf]
    for name in controls["tables"]:
        csv_file, md = out / "tables" / f"{name}.csv", out / "tables" / f"{name}.md"
        getattr(control_report, f"write_{name}_table")(comparisons, pooled_ref["analysis_hash"], csv_file, md)
        written += [csv_file, md]
    return written


HEADLINE_FILES = tuple(f"tables/headline.{ext}" for ext in ("csv", "md", "tex"))


def _rewrite_manifest_lines(reference: Path, names: list[str]) -> None:
    """Set the manifest lines of ``names`` (paths relative to ``reference``) to the files' digests as they now
    stand, adding the lines of files the manifest did not list."""
    manifest_path = reference / "MANIFEST.sha256"
    entries = read_manifest(manifest_path)
    entries.update({name: sha256_file(reference / name) for name in names})
    manifest_path.write_text("".join(f"{digest}  {name}\n" for name, digest in entries.items()))


def reanalyze(reference: Path, commit: str | None) -> list[str]:
    """Recompute a reference folder's analysis (comparisons, pooled comparison, tables, figures) from its committed
    credit tables with the code as it now stands, after a change of the analysis code that moves them (a pooling
    rule, a new statistic): the rebuilt files replace the committed ones, their manifest lines follow, and
    ``reproduce.json`` records which commit's analysis they are. What the replayed rows made (credit tables,
    channels, the probe, the cache counts) is kept as the run left it. Returns the files that changed."""
    reference = Path(reference)
    with tempfile.TemporaryDirectory(prefix="reanalyze-") as tmp:
        out = Path(tmp)
        changed, figures_drawn = [], []
        for path in rebuild(reference, out):
            rel = path.relative_to(out).as_posix()
            target = reference / rel
            if target.is_file() and sha256_file(target) == sha256_file(path):
                continue
            if rel.startswith("figures/") and target.is_file():
                figures_drawn.append((rel, path))  # redrawn only where a number changed (matplotlib moves bytes)
                continue
            drift = float_drift(target, path) if target.is_file() and path.suffix in (".json", ".csv") else None
            if drift is None or drift > DRIFT_TOLERANCE:  # last-bit drift of this CPU keeps the run's own file
                changed.append(rel)
        if changed:
            changed += [rel for rel, _ in figures_drawn]
        for rel in changed:
            (reference / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out / rel, reference / rel)
    if changed:
        _rewrite_manifest_lines(reference, changed)
        record_path = reference / REPRODUCE_FILE
        record = read_json(record_path) if record_path.is_file() else {"commit": reproducing_commit(reference)[0]}
        note = (f"{', '.join(sorted(changed))} recomputed from the committed credit tables by the analysis code of "
                f"{commit or 'the working tree'} (python -m replaynoise.reference reanalyze); every other file is "
                "the run's own.")
        record["note"] = f"{record.get('note', '')} {note}".strip()
        write_json(record, record_path)
    return changed


def refresh_tables(reference: Path) -> list[Path]:
    """Rewrite a reference folder's headline tables from its committed comparisons, after a change of the table
    code alone, and their lines in its manifest (which vouches for the folder's files as they now stand).
    The committed comparisons are used, not recomputed ones, so every cell the old tables had keeps its bytes
    (a recomputation on another CPU moves the last bits of the OLS floats)."""
    reference = Path(reference)
    pooled = read_json(reference / "analysis" / "pooled" / "comparison.json")
    results = {c: read_json(reference / "analysis" / c / "comparison.json") for c in pooled["configs"]}
    tables = [reference / name for name in HEADLINE_FILES]
    everything = {**results, "pooled": pooled}
    write_headline_tables(headline_rows(everything), pooled["analysis_hash"], *tables, mismatch_lines(everything))
    _rewrite_manifest_lines(reference, list(HEADLINE_FILES))
    return tables


def _values(path: Path) -> list:
    """A JSON file's leaves or a CSV file's cells, in order, for a comparison value by value."""
    if path.suffix == ".json":
        leaves, stack = [], [read_json(path)]
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
    None where anything else differs. Linear algebra on another CPU or BLAS moves the last bits of an OLS t; a
    statistic that is zero exactly comes out as 1e-17 there, so magnitudes below 1e-6 count as 1e-6."""
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


def check_rebuild(reference: Path, out: Path, written: list[Path], report=None) -> bool:
    """Each rebuilt file against the reference manifest (and the committed credit tables against it too,
    since the rebuild rests on them); prints what differs, table cells included. True if every number agrees
    (bitwise, or within last-bit float drift); a figure that differs is named but does not fail the check,
    since a change of the drawing code since the run changes its bytes and none of its numbers."""
    report = sys.stdout if report is None else report
    manifest = read_manifest(Path(reference) / "MANIFEST.sha256")
    edited = edited_files(Path(reference))
    for rel in edited:
        print(f"  edited: {Path(reference) / rel} differs from its manifest", file=report)
    if edited:
        print(f"{len(edited)} committed file(s) of {reference} differ from its MANIFEST.sha256: a rebuild checks "
              "what the folder holds, so it fails", file=report)
    checked = [(p.relative_to(out).as_posix(), p) for p in written]
    checked += [(p.relative_to(reference).as_posix(), p) for p in sorted(Path(reference).glob("credit/*/*.parquet"))]
    differing = [(rel, path) for rel, path in checked if manifest.get(rel) != sha256_file(path)]
    print(f"{len(checked) - len(differing)} of {len(checked)} rebuilt files and credit tables identical to "
          f"{reference}/MANIFEST.sha256 (sha256)", file=report)
    failed = False
    for rel, path in differing:
        committed = Path(reference) / rel
        drift = float_drift(committed, path) if committed.is_file() and path.suffix in (".json", ".csv") else None
        if drift is not None and drift <= DRIFT_TOLERANCE:
            print(f"  last-bit float drift only (largest relative difference {drift:.1e}): {rel}", file=report)
            continue
        figure = rel.startswith("figures/")
        failed |= not figure
        state = "absent from the manifest" if rel not in manifest else "differs"
        note = (" (a figure: its bytes follow the drawing code and matplotlib too; see provenance.json)" if figure
                else "")
        print(f"  {state}: {rel}{note}", file=report)
        if rel.endswith(".csv") and committed.is_file():
            for line in table_differences(committed, path):
                print(f"      {line}", file=report)
    return not failed and not edited


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replaynoise.reference", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="copy a finished run's small outputs into a reference folder")
    snap.add_argument("results", type=Path)
    snap.add_argument("reference", type=Path)
    check = sub.add_parser("compare", help="check a rerun against a reference folder (exit 1 on a difference)")
    check.add_argument("reference", type=Path)
    check.add_argument("results", type=Path)
    again = sub.add_parser("rebuild", help="recompute a reference folder's statistics, tables and figures from its "
                           "credit tables into OUT and check them against its manifest (exit 1 on a difference)")
    again.add_argument("reference", type=Path)
    again.add_argument("out", type=Path)
    redo = sub.add_parser("reanalyze", help="recompute a reference folder's analysis, tables and figures from its "
                          "credit tables with the code as it now stands, with their manifest lines and a note in "
                          "reproduce.json")
    redo.add_argument("reference", type=Path)
    redo.add_argument("--commit", default=None, help="the commit whose analysis code this is (for the note)")
    retable = sub.add_parser("tables", help="rewrite a reference folder's headline tables from its committed "
                             "comparisons (after a change of the table code) and their manifest lines")
    retable.add_argument("reference", type=Path)
    fig = sub.add_parser("figure", help="draw the channel-agreement figure of several reference folders into OUT")
    fig.add_argument("out", type=Path)
    fig.add_argument("folders", type=Path, nargs="+")
    args = parser.parse_args(argv)
    try:
        if args.command == "snapshot":
            copied = snapshot(args.results, args.reference)
            print(f"{len(copied)} files copied to {args.reference}")
            return 0
        if args.command == "rebuild":
            return 0 if check_rebuild(args.reference, args.out, rebuild(args.reference, args.out)) else 1
        if args.command == "reanalyze":
            changed = reanalyze(args.reference, args.commit)
            print(f"{len(changed)} files recomputed in {args.reference}: {', '.join(changed) or 'none'}")
            return 0
        if args.command == "tables":
            written = refresh_tables(args.reference)
            print(f"{len(written)} tables rewritten in {args.reference}, with their manifest lines")
            return 0
        if args.command == "figure":
            args.out.mkdir(parents=True, exist_ok=True)
            data = channel_data(args.folders)
            figures.plot_channel_agreement(data, args.out / "channel_agreement.png", args.out / "channel_agreement.pdf")
            print(f"{len(data)} configurations drawn to {args.out}/channel_agreement.{{png,pdf}}")
            return 0
        return 0 if compare(args.reference, args.results) else 1
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
