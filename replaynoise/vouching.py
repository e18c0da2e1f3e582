"""What a run's or a reference folder's own records vouch for, checked before a command reads or writes one.

A reviewer's command trusts a folder only as far as its records go: every file it reads must be one its manifest
lists with the bytes it lists, provenance.json must carry the manifest's digest and a digest of its own fields, and
what a file says of itself (its pass, its configuration) must match its name. A command's destination must lie
outside the folders it reads and outside every folder a manifest vouches for, links resolved.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import polars as pl

from replaynoise.io import UnreadableFileError, read_json, read_manifest, sha256_file, write_json

MANIFEST_FILE = "MANIFEST.sha256"
PROVENANCE_FILE = "provenance.json"
#: provenance.json's seal: the sha256 of the manifest written with it, and of its own fields less this one
MANIFEST_DIGEST, RECORD_DIGEST = "manifest_sha256", "record_sha256"


def record_digest(record: dict) -> str:
    """The sha256 of a record's fields but its own digest, in a canonical JSON form."""
    fields = {key: value for key, value in record.items() if key != RECORD_DIGEST}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sealed(record: dict, manifest: Path) -> dict:
    """``record`` as provenance.json stores it: with the digest of ``manifest`` and of its own fields, so that an
    edited field, or a manifest rewritten after the run, no longer matches."""
    record = json.loads(json.dumps(record, default=str))  # as it reads back from the file
    record[MANIFEST_DIGEST] = sha256_file(manifest)
    record[RECORD_DIGEST] = record_digest(record)
    return record


def reseal(folder: Path) -> None:
    """Set a sealed provenance.json's manifest digest to its folder's manifest as it now stands (after a command
    rewrote manifest lines for files it computed from verified inputs); an unsealed record stays as it is."""
    from_file = Path(folder) / PROVENANCE_FILE
    if not from_file.is_file():
        return
    record = read_json(from_file)
    if isinstance(record, dict) and RECORD_DIGEST in record:
        write_json(sealed(record, Path(folder) / MANIFEST_FILE), from_file)


def record_problems(folder: Path, required: bool = False) -> list[str]:
    """A line per way ``folder``'s provenance.json fails its seal. A record without a seal (written before runs
    sealed theirs; git vouches for the committed ones) passes unless ``required``."""
    path, manifest = Path(folder) / PROVENANCE_FILE, Path(folder) / MANIFEST_FILE
    if not path.is_file():
        return [f"{path}: missing"] if required else []
    try:
        record = read_json(path)
    except UnreadableFileError as exc:
        return [str(exc)]
    if not isinstance(record, dict):
        return [f"{path}: not a JSON object"]
    if MANIFEST_DIGEST not in record and RECORD_DIGEST not in record:
        return (
            [f"{path}: fields {MANIFEST_DIGEST} and {RECORD_DIGEST} missing (an unsealed record)"] if required else []
        )
    problems = []
    if record.get(RECORD_DIGEST) != record_digest(record):
        problems.append(f"{path}: field {RECORD_DIGEST}: its fields were edited after the run (they hash otherwise)")
    if not manifest.is_file() or record.get(MANIFEST_DIGEST) != sha256_file(manifest):
        problems.append(f"{path}: field {MANIFEST_DIGEST}: {manifest} is not the manifest written with it")
    return problems


def _column_values(table: Path, column: str) -> list[Any] | None:
    """The distinct values of one column of a parquet file; None where the file has no such column."""
    try:
        if column not in pl.read_parquet_schema(table):
            return None
        return pl.read_parquet(table, columns=[column])[column].unique().sort().to_list()
    except (pl.exceptions.PolarsError, OSError) as exc:
        raise UnreadableFileError(f"{table}: not a readable parquet file ({exc})") from None


def _described(folder: Path, pattern: str) -> list[Path]:
    """The folder's own files matching ``pattern`` that its manifest lists (all of them, where it has none)."""
    manifest = folder / MANIFEST_FILE
    listed = read_manifest(manifest) if manifest.is_file() else None
    found = [p for p in sorted(folder.glob(pattern)) if p.is_file() and folder.resolve() in p.resolve().parents]
    return [p for p in found if listed is None or p.relative_to(folder).as_posix() in listed]


def _comparison_problems(path: Path, recorded: str | None, provenance: Path) -> list[str]:
    """How a comparison says it is another than its folder's, or of other settings than the run's record."""
    try:
        record = read_json(path)
    except UnreadableFileError as exc:
        return [str(exc)]
    if not isinstance(record, dict):
        return [f"{path}: not a JSON object"]
    problems = []
    if record.get("config") != path.parent.name:
        problems.append(f"{path}: field config is {record.get('config')!r}, not its folder {path.parent.name!r}")
    if recorded is not None and record.get("analysis_hash") != recorded:
        problems.append(
            f"{path}: field analysis_hash is {record.get('analysis_hash')!r}, not {provenance}'s {recorded!r}"
        )
    return problems


def self_description_problems(folder: Path) -> list[str]:
    """A line per file whose contents say it is another file than its name does: a credit table whose
    ``pass_name`` is not its pass, a comparison whose ``config`` is not its folder, or whose ``analysis_hash`` is
    not the one provenance.json records."""
    folder, problems = Path(folder), []
    for table in _described(folder, "credit/*/*.parquet"):
        try:
            names = _column_values(table, "pass_name")
        except UnreadableFileError as exc:
            problems.append(str(exc))
            continue
        if names is not None and names != [table.stem]:
            problems.append(f"{table}: column pass_name holds {names}, not the pass its name says ({table.stem!r})")
    provenance = folder / PROVENANCE_FILE
    try:
        record = read_json(provenance) if provenance.is_file() else {}
    except UnreadableFileError as exc:
        return [*problems, str(exc)]
    recorded = record.get("analysis_hash") if isinstance(record, dict) else None
    for path in _described(folder, "analysis/*/comparison.json"):
        problems += _comparison_problems(path, recorded, provenance)
    return problems


def edited_files(folder: Path, reads: Iterable[str] | None = None) -> list[str]:
    """The files in ``folder`` whose bytes its own manifest does not vouch for: every file the manifest lists that
    the folder holds must match it. With ``reads`` (globs relative to the folder), the files a command reads: each
    match must also be a plain file inside the folder that the manifest lists. Files a folder does not hold
    (replayed rows, KV) are vouched for by the manifest alone."""
    return [rel for rel, _ in _unvouched(Path(folder), reads)]


def _unvouched(folder: Path, reads: Iterable[str] | None) -> list[tuple[str, str]]:
    """(relative path, why) of each file ``edited_files`` names."""
    listed = read_manifest(folder / MANIFEST_FILE)
    if reads is None:
        found = [folder / rel for rel in listed if (folder / rel).is_file()]
    else:
        found = sorted({p for pattern in reads for p in folder.glob(pattern)})
    problems = []
    for path in found:
        rel = path.relative_to(folder).as_posix()
        if not path.is_file():
            problems.append((rel, "is not a file"))
        elif folder.resolve() not in path.resolve().parents:
            problems.append((rel, f"is a link to {path.resolve()}, outside the folder"))
        elif rel not in listed:
            problems.append((rel, "is not in its manifest"))
        elif sha256_file(path) != listed[rel]:
            problems.append((rel, "differs from its manifest"))
    return problems


def folder_problems(folder: Path, reads: Iterable[str] | None = None) -> list[str]:
    """Every way ``folder`` fails its own records: no manifest, a file edited, unlisted, a link out of the folder
    or not a file (of those it lists, or of those matching ``reads``), a provenance.json that fails its seal, a
    file that says it is another."""
    folder = Path(folder)
    manifest = folder / MANIFEST_FILE
    if not manifest.is_file():
        return [f"{manifest}: no manifest, so nothing vouches for the folder's files"]
    lines = [f"{folder / rel} {why}" for rel, why in _unvouched(folder, reads)]
    return lines + record_problems(folder) + self_description_problems(folder)


def require_intact(folder: Path, action: str, reads: Iterable[str] | None = None) -> None:
    """Refuse a folder its own records do not vouch for, by file and field, before ``action`` reads it."""
    problems = folder_problems(folder, reads)
    if problems:
        raise ValueError(
            f"{folder}: {action} reads only a folder its own records vouch for; restore it (git checkout, or a "
            f"rerun): " + "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        )


def _holds(folder: Path, path: Path) -> bool:
    """``folder`` is ``path`` or one of the folders above it (both resolved)."""
    folder, path = folder.resolve(), path.resolve()
    return folder == path or folder in path.parents


def check_destination(
    dest: Path, sources: list[Path], action: str, replaces_snapshot: bool = False, tree: bool = True
) -> None:
    """Refuse a destination a command would delete or write into that is a source, lies inside one, or lies in a
    folder a manifest vouches for (a run's or a reference's; but a snapshot's own earlier folder where
    ``replaces_snapshot``), links resolved. A command that writes a ``tree`` (and may replace it) is also refused one
    that is or holds a source or the current folder: ``snapshot results results`` once deleted every result; one
    that writes named files alone (a figure, a table) may write them beside its sources."""
    dest = Path(dest)
    for source in [*map(Path, sources), Path.cwd()]:
        what = "the current folder" if source == Path.cwd() else str(source)
        if tree and _holds(dest, source):
            raise ValueError(
                f"{dest}: {action} would write into {what}, which it is or holds; give a folder outside it"
            )
        if _holds(source, dest) and source != Path.cwd():
            raise ValueError(f"{dest}: {action} would write inside {what}; give a folder outside it")
    target = dest.resolve()
    for folder in [target, *target.parents]:
        if (folder / MANIFEST_FILE).is_file() and not (replaces_snapshot and folder == target):
            raise ValueError(
                f"{dest}: {action} would write into {folder}, a folder its {MANIFEST_FILE} vouches for (a run's "
                "or a reference's); give a folder outside it"
            )


def check_own_files(folder: Path, names: Iterable[str], action: str) -> None:
    """Refuse to write ``names`` (relative paths) of ``folder`` where a link would take the write elsewhere."""
    root = Path(folder).resolve()
    for name in names:
        if (Path(folder) / name).parent.resolve() != (root / name).parent:
            raise ValueError(f"{Path(folder) / name}: {action} would write through a link out of {folder}")
