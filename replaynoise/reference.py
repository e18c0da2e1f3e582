"""Committed reference results, and the check of a rerun against them.

A reviewer reruns a campaign and asks one question: are these the numbers in the repository? The manifest
answers it for every output, KV files included, since it holds their sha256 even where the files themselves
are too large to commit. Where a table differs, the check also prints which cells changed and by how much,
so a reviewer can tell a platform's last-bit drift from a different result.

    python -m replaynoise.reference snapshot results reference/cpu   # after a campaign, to commit
    python -m replaynoise.reference compare reference/cpu results    # after a rerun; exit 1 on a difference
"""

from __future__ import annotations

import argparse
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: What a snapshot keeps: small, human-readable outputs. Parquet tables and KV files stay out; the manifest
#: still carries their checksums.
SNAPSHOT_GLOBS = (
    "MANIFEST.sha256", "provenance.json", "tables/*", "figures/*.png", "figures/*.pdf",
    "analysis/*/comparison.json", "analysis/*/channels.csv", "cost/cost.md", "cost/cost.csv",
)


def snapshot(results: Path, reference: Path) -> list[Path]:
    """Copy the small outputs of ``results`` into ``reference`` (emptied first); returns the copied paths."""
    results, reference = Path(results), Path(reference)
    if not (results / "MANIFEST.sha256").is_file():
        raise FileNotFoundError(f"{results / 'MANIFEST.sha256'}: no manifest; run the workflow to the end first")
    if reference.exists():
        shutil.rmtree(reference)
    copied = []
    for pattern in SNAPSHOT_GLOBS:
        for path in sorted(results.glob(pattern)):
            target = reference / path.relative_to(results)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
            copied.append(target)
    return copied


def read_manifest(path: Path) -> dict[str, str]:
    """``sha256sum`` lines as {relative path: digest}."""
    entries = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or len(parts[0]) != 64:
            raise ValueError(f"{path}:{number}: not a sha256sum line: {line!r}")
        entries[parts[1].lstrip("*")] = parts[0]
    return entries


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
    import polars as pl

    ref, new = pl.read_csv(reference_csv, infer_schema_length=0), pl.read_csv(rerun_csv, infer_schema_length=0)
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


def compare(reference: Path, results: Path, out=None) -> bool:
    """Compare a rerun in ``results`` with the committed ``reference``; print a report; True if identical."""
    out = sys.stdout if out is None else out
    reference, results = Path(reference), Path(results)
    for folder in (reference, results):
        if not (folder / "MANIFEST.sha256").is_file():
            raise FileNotFoundError(f"{folder / 'MANIFEST.sha256'}: no manifest")
    outcome = compare_manifests(read_manifest(reference / "MANIFEST.sha256"), read_manifest(results / "MANIFEST.sha256"))
    total = len(outcome.identical) + len(outcome.differing) + len(outcome.missing)
    print(f"{len(outcome.identical)} of {total} reference files identical (sha256), {len(outcome.differing)} "
          f"differ, {len(outcome.missing)} missing from the rerun, {len(outcome.extra)} only in the rerun", file=out)
    for label, paths in (("differs", outcome.differing), ("missing", outcome.missing), ("extra", outcome.extra)):
        for path in paths:
            print(f"  {label}: {path}", file=out)
            if label == "differs" and path.endswith(".csv") and (reference / path).is_file():
                for line in table_differences(reference / path, results / path):
                    print(f"      {line}", file=out)
    if not outcome.agrees:
        print("Differences on a different CPU, GPU or library version can be last-bit drift of the kernels "
              "(compare 'hardware' and 'packages' in the two provenance.json files); on the same platform "
              "and pins they are a different result.", file=out)
    return outcome.agrees


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replaynoise.reference", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="copy a finished run's small outputs into a reference folder")
    snap.add_argument("results", type=Path)
    snap.add_argument("reference", type=Path)
    check = sub.add_parser("compare", help="check a rerun against a reference folder (exit 1 on a difference)")
    check.add_argument("reference", type=Path)
    check.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "snapshot":
            copied = snapshot(args.results, args.reference)
            print(f"{len(copied)} files copied to {args.reference}")
            return 0
        return 0 if compare(args.reference, args.results) else 1
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
