"""Committed reference results, and the check of a rerun against them.

A reviewer reruns a campaign and asks one question: are these the numbers in the repository? The manifest
answers it for every output, KV files included, since it holds their sha256 even where the files themselves
are too large to commit. Where a table differs, the check also prints which cells changed and by how much,
so a reviewer can tell a platform's last-bit drift from a different result.

    python -m replaynoise.reference snapshot results reference/cpu   # after a campaign, to commit
    python -m replaynoise.reference compare reference/cpu results    # after a rerun; exit 1 on a difference
    python -m replaynoise.reference reproduce reference/gpu/qwen --workdir W  # replaynoise.reproduction
    python -m replaynoise.reference rebuild reference/gpu/qwen /tmp/qwen  # on CPU; exit 1 on a difference
    python -m replaynoise.reference figure reference/gpu reference/gpu/smollm2 reference/gpu/qwen ...
    python -m replaynoise.reference partial results config/campaigns/X.yaml reference/X-partial  # a cut-short run
    python -m replaynoise.reference contrast reference/A-vs-B.md reference/A reference/B  # two runs' excesses
    python -m replaynoise.reference combine reference/A reference/A-again --out reference/  # runs of one campaign

`rebuild` recomputes a reference folder's statistics, tables and figures from its committed per-pivot credit
tables and configuration alone, and checks each rebuilt file against the folder's manifest: a reader needs no
GPU to see that the committed numbers follow from the committed pivots. What needs the replayed rows (the
channels, the probe, the verification and the cache counts; not committed, their sha256 is in the manifest) is
taken as committed.

`tables` rewrites a reference folder's headline tables from its committed comparisons after a change of the
table code alone. `compare` also names the commit that reproduces the reference (its ``reproduce.json``, or its
clean provenance) when the rerun ran other code.
`partial` keeps what a cut-short run finished; `contrast` sets two folders' excesses side by side; `combine` gives
the excess over runs of one campaign, its interval over problems, pass draws and runs; `figure` redraws the
channel-agreement figure of several folders from their committed analysis files alone.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import polars as pl

from replaynoise import plan
from replaynoise.analysis.comparison import compare_passes
from replaynoise.analysis.pooling import pooled_comparison
from replaynoise.analysis.prefix_mismatch import mismatch_summary
from replaynoise.config import analysis_hash
from replaynoise.generation.passes import run_passes
from replaynoise.io import (
    UnreadableFileError,
    read_json,
    read_manifest,
    read_parquet,
    sha256_file,
    write_json,
    write_text,
)
from replaynoise.partials import PARTIAL_FILE, partial, rebuild_partial
from replaynoise.report import controls as report_controls
from replaynoise.report.combined import add_combine_parser, combine_command
from replaynoise.report.contrasts import contrast_lines
from replaynoise.report.headline import headline_rows
from replaynoise.report.plots import PLOTS
from replaynoise.report.tables import mismatch_lines, write_headline_tables
from replaynoise.reproduction import add_rerun_parsers, parse_arguments, rerun_command
from replaynoise.settings import AnalysisSettings
from replaynoise.snapshots import (
    REPRODUCE_FILE,
    drift_only,
    refresh_tables,
    reproducing_commit,
    rewrite_manifest_lines,
    snapshot,
    table_differences,
)
from replaynoise.vouching import (
    MANIFEST_FILE,
    check_destination,
    check_own_files,
    folder_problems,
    require_intact,
)

#: comparison.json entries computed from the replayed rows (the prefix mismatch from every prefix token's two
#: log-probs), which a reference folder does not hold
FROM_ROWS = ("probe", "verification", "prefix_cache", "controls", "prefix_mismatch")


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


def rebuilt_mismatch(table: Path, credit: dict, result: dict, held: dict, stats: AnalysisSettings) -> dict:
    """The prefix mismatch summary from a committed table, less the blocks added to it since the run (the
    frameworks' metrics): a rebuild recomputes what the run's comparison holds."""
    link: dict[str, Any] = {"metric": stats.metric, "min_eligible": stats.min_eligible, "ci": stats.ci}
    summary = mismatch_summary(read_parquet(table), credit, result, config=result["config"], **link)
    return {key: value for key, value in summary.items() if key in (held.get("prefix_mismatch") or summary)}


def rebuild(reference: Path, out: Path) -> list[Path]:
    """Recompute ``reference``'s comparisons, headline tables and figures into ``out`` (a results-like tree)
    as the workflow's rules do, from its credit tables and recorded configuration; returns the files written."""
    reference, out = Path(reference), Path(out)
    check_destination(out, [reference], "rebuild")
    if (reference / PARTIAL_FILE).is_file():
        return rebuild_partial(reference, out)
    config = read_json(reference / "provenance.json")["config"]
    pooled_ref = read_json(reference / "analysis" / "pooled" / "comparison.json")
    configs, passes = list(pooled_ref["configs"]), run_passes(config["replay"])
    if pooled_ref["analysis_hash"] != analysis_hash(config):
        raise ValueError(
            f"{reference}: provenance.json's configuration has analysis hash {analysis_hash(config)}, "
            f"the committed analysis {pooled_ref['analysis_hash']}"
        )
    credits = {c: {p: read_parquet(reference / "credit" / c / f"{p}.parquet") for p in passes} for c in configs}
    stats = AnalysisSettings.of(config["analysis"], config["seed"])
    committed = channel_data([reference])
    written, comparisons = [], {}
    for c in configs:
        result = compare_passes(credits[c], stats)
        result.update({key: committed[c][0][key] for key in FROM_ROWS if key in committed[c][0]})
        result.update(config=c, kernels=committed[c][0]["kernels"], analysis_hash=pooled_ref["analysis_hash"])
        mismatch = reference / "analysis" / c / "mismatch.parquet"
        if mismatch.is_file():  # the per-pivot prefix mismatch is committed: its link to the flips is recomputed
            result["prefix_mismatch"] = rebuilt_mismatch(mismatch, credits[c], result, committed[c][0], stats)
        comparisons[c] = result
        written.append(out / "analysis" / c / "comparison.json")
        write_json(result, written[-1])
    pooled = pooled_comparison(credits, {c: config["configs"][c] for c in configs}, stats, pooled_ref["analysis_hash"])
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
        PLOTS[name](data, png, pdf, **plan.plot_options(name, config))
        written += [png, pdf]
    controls = plan.control_outputs(passes)  # from the committed controls block
    for name in controls["figures"]:
        png, pdf = out / "figures" / f"{name}.png", out / "figures" / f"{name}.pdf"
        getattr(report_controls, f"plot_{name}")(comparisons, png, pdf)
        written += [png, pdf]
    for name in controls["tables"]:
        csv_file, md = out / "tables" / f"{name}.csv", out / "tables" / f"{name}.md"
        getattr(report_controls, f"write_{name}_table")(comparisons, pooled_ref["analysis_hash"], csv_file, md)
        written += [csv_file, md]
    return written


def reanalyze(reference: Path, commit: str | None) -> list[str]:
    """Recompute a reference folder's analysis (comparisons, pooled comparison, tables, figures) from its committed
    credit tables with the code as it now stands, after a change of the analysis code that moves them (a pooling
    rule, a new statistic): the rebuilt files replace the committed ones, their manifest lines follow, and
    ``reproduce.json`` records which commit's analysis they are. What the replayed rows made (credit tables,
    channels, the probe, the cache counts) is kept as the run left it. Returns the files that changed."""
    reference = Path(reference)
    require_intact(reference, "reanalyze")
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
            if drift_only(target, path) is None:  # this CPU's float drift keeps the run's own file
                changed.append(rel)
        if changed:
            changed += [rel for rel, _ in figures_drawn]
        check_own_files(reference, [*changed, MANIFEST_FILE, REPRODUCE_FILE], "reanalyze")
        for rel in changed:
            (reference / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out / rel, reference / rel)
    if changed:
        rewrite_manifest_lines(reference, changed)
        record_path = reference / REPRODUCE_FILE
        record = read_json(record_path) if record_path.is_file() else {"commit": reproducing_commit(reference)[0]}
        note = (
            f"{', '.join(sorted(changed))} recomputed from the committed credit tables by the analysis code of "
            f"{commit or 'the working tree'} (python -m replaynoise.reference reanalyze); every other file is "
            "the run's own."
        )
        record["note"] = f"{record.get('note', '')} {note}".strip()
        write_json(record, record_path)
    return changed


def check_rebuild(reference: Path, out: Path, written: list[Path], report=None) -> bool:
    """Each rebuilt file against the reference manifest (and the committed credit tables against it too,
    since the rebuild rests on them); prints what differs, table cells included. True if every number agrees
    (bitwise, or within float drift, ``DRIFT_TOLERANCE``); a figure that differs is named but does not fail the check,
    since a change of the drawing code since the run changes its bytes and none of its numbers."""
    report = sys.stdout if report is None else report
    manifest = read_manifest(Path(reference) / MANIFEST_FILE)
    checked = [(p.relative_to(out).as_posix(), p) for p in written]
    checked += [(p.relative_to(reference).as_posix(), p) for p in sorted(Path(reference).glob("credit/*/*.parquet"))]
    differing = [(rel, path) for rel, path in checked if manifest.get(rel) != sha256_file(path)]
    print(
        f"{len(checked) - len(differing)} of {len(checked)} rebuilt files and credit tables identical to "
        f"{reference}/MANIFEST.sha256 (sha256)",
        file=report,
    )
    failed = False
    for rel, path in differing:
        committed = Path(reference) / rel
        drift = drift_only(committed, path)
        if drift is not None:
            print(f"  float drift only (largest relative difference {drift:.1e}): {rel}", file=report)
            continue
        figure = rel.startswith("figures/")
        failed |= not figure
        state = "absent from the manifest" if rel not in manifest else "differs"
        note = (
            " (a figure: its bytes follow the drawing code and matplotlib too; see provenance.json)" if figure else ""
        )
        print(f"  {state}: {rel}{note}", file=report)
        if rel.endswith(".csv") and committed.is_file():
            for line in table_differences(committed, path):
                print(f"      {line}", file=report)
    return not failed


def intact_or_said(reference: Path, report=None) -> bool:
    """Whether ``reference`` is what its own records vouch for; where not, each problem printed: a rebuild checks
    what the folder holds, so it fails."""
    problems = folder_problems(Path(reference))
    for line in problems:
        print(f"  edited: {line}", file=report)
    if problems:
        print(
            f"{len(problems)} problem(s) with {reference} against its MANIFEST.sha256 and provenance.json: a rebuild "
            "checks what the folder holds, so it fails",
            file=report,
        )
    return not problems


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m replaynoise.reference", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="copy a finished run's small outputs into a reference folder")
    snap.add_argument("results", type=Path)
    snap.add_argument("reference", type=Path)
    add_rerun_parsers(sub)  # compare, reproduce
    again = sub.add_parser(
        "rebuild",
        help="recompute a reference folder's statistics, tables and figures from its "
        "credit tables into OUT and check them against its manifest (exit 1 on a difference)",
    )
    again.add_argument("reference", type=Path)
    again.add_argument("out", type=Path)
    redo = sub.add_parser(
        "reanalyze",
        help="recompute a reference folder's analysis, tables and figures from its "
        "credit tables with the code as it now stands, with their manifest lines and a note in "
        "reproduce.json",
    )
    redo.add_argument("reference", type=Path)
    redo.add_argument("--commit", default=None, help="the commit whose analysis code this is (for the note)")
    retable = sub.add_parser(
        "tables",
        help="rewrite a reference folder's headline tables from its committed "
        "comparisons (after a change of the table code) and their manifest lines",
    )
    retable.add_argument("reference", type=Path)
    cut = sub.add_parser(
        "partial",
        help="keep what a run cut short finished (credit tables, pivots, logs) as a new reference folder, "
        "with the comparison of its whole pairs of draws",
    )
    cut.add_argument("results", type=Path)
    cut.add_argument("campaign", type=Path, help="the run's configuration file (one configuration)")
    cut.add_argument("reference", type=Path)
    cut.add_argument("--note", default="", help="why the run stopped, for partial.json")
    vs = sub.add_parser("contrast", help="write two reference folders' excesses and their difference to OUT")
    vs.add_argument("out", type=Path)
    vs.add_argument("first", type=Path)
    vs.add_argument("second", type=Path)
    add_combine_parser(sub)
    fig = sub.add_parser("figure", help="draw the channel-agreement figure of several reference folders into OUT")
    fig.add_argument("out", type=Path)
    fig.add_argument("folders", type=Path, nargs="+")
    return parser


def _snapshot(args: argparse.Namespace, argv: list[str] | None) -> int:
    copied = snapshot(args.results, args.reference)
    print(f"{len(copied)} files copied to {args.reference}")
    return 0


def _rebuild(args: argparse.Namespace, argv: list[str] | None) -> int:
    """A folder its records do not vouch for fails; it is still rebuilt where it can be, so that the numbers an edit
    moves are named too."""
    intact = intact_or_said(args.reference, sys.stdout)
    try:
        agrees = check_rebuild(args.reference, args.out, rebuild(args.reference, args.out))
    except (KeyError, TypeError, AttributeError) as exc:
        if intact:
            raise
        print(f"no rebuild of the edited folder ({type(exc).__name__}: {exc})")
        return 1
    return 0 if agrees and intact else 1


def _partial(args: argparse.Namespace, argv: list[str] | None) -> int:
    written = partial(args.results, args.campaign, args.reference, args.note)
    compared = read_json(args.reference / PARTIAL_FILE)["passes_compared"]
    print(f"{args.reference}: {len(written)} files computed from the passes {', '.join(compared)}")
    return 0


def _reanalyze(args: argparse.Namespace, argv: list[str] | None) -> int:
    changed = reanalyze(args.reference, args.commit)
    print(f"{len(changed)} files recomputed in {args.reference}: {', '.join(changed) or 'none'}")
    return 0


def _tables(args: argparse.Namespace, argv: list[str] | None) -> int:
    written = refresh_tables(args.reference)
    print(f"{len(written)} tables rewritten in {args.reference}, with their manifest lines")
    return 0


def _contrast(args: argparse.Namespace, argv: list[str] | None) -> int:
    check_destination(args.out, [args.first, args.second], "contrast", tree=False)
    for folder in (args.first, args.second):
        require_intact(folder, "contrast", reads=["analysis/*/comparison.json"])
    write_text("\n".join(contrast_lines(args.first, args.second)) + "\n", args.out)
    print(f"{args.out}: {args.first} - {args.second}")
    return 0


def _combine(args: argparse.Namespace, argv: list[str] | None) -> int:
    for folder in args.folders:
        require_intact(folder, "combine", reads=["credit/*/*.parquet", "partial.json"])
    if args.out is not None:
        check_destination(args.out, args.folders, "combine", tree=False)
    return combine_command(args, argv)


def _figure(args: argparse.Namespace, argv: list[str] | None) -> int:
    check_destination(args.out, args.folders, "figure", tree=False)
    for folder in args.folders:
        require_intact(folder, "figure", reads=["analysis/*/comparison.json", "analysis/*/channels.csv"])
    args.out.mkdir(parents=True, exist_ok=True)
    data = channel_data(args.folders)
    PLOTS["channel_agreement"](data, args.out / "channel_agreement.png", args.out / "channel_agreement.pdf")
    print(f"{len(data)} configurations drawn to {args.out}/channel_agreement.{{png,pdf}}")
    return 0


#: each command that is not ``compare`` or ``reproduce`` (``reproduction.rerun_command``)
COMMANDS = {
    "snapshot": _snapshot,
    "rebuild": _rebuild,
    "partial": _partial,
    "reanalyze": _reanalyze,
    "tables": _tables,
    "contrast": _contrast,
    "combine": _combine,
    "figure": _figure,
}


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(_parser(), argv)
    try:
        if args.command in COMMANDS:
            return COMMANDS[args.command](args, argv)
        return rerun_command(args)
    except (OSError, ValueError, UnreadableFileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
