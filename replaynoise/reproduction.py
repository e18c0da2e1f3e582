"""A reference reproduced on demand: the campaign a reference folder records, rerun on this machine through the
workflow, and the rerun's every file checked against the reference's manifest; where they differ, the earliest
difference in pipeline order, whether the headline statistics still agree within their intervals, and the
environment fingerprint fields that differ (``replaynoise.fingerprint``), written as a report beside the rerun.
The commands ``compare`` and ``reproduce`` of ``replaynoise.reference`` are defined here."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any, TextIO

import yaml

from replaynoise.config import analysis_hash, validate_config
from replaynoise.divergence import divergence, statistics_agreement
from replaynoise.fingerprint import fingerprint_differences, fingerprint_lines
from replaynoise.io import read_json, write_json, write_text
from replaynoise.snapshots import code_version_note, compare
from replaynoise.vouching import (
    check_destination,
    edited_files,
    record_problems,
    require_intact,
    self_description_problems,
)

REPO = Path(__file__).resolve().parents[1]
#: The configuration file a reproduction writes into its working folder and runs the workflow with.
CONFIG_FILE = "reproduce-config.yaml"


def recorded_campaign(reference: Path) -> dict:
    """The configuration ``reference`` was made with (its provenance.json's ``config``; a partial folder's
    partial.json's), refused where this code validates it to another analysis hash than the one recorded: a rerun
    of other protocol settings could not reproduce the folder."""
    reference = Path(reference)
    path = reference / "provenance.json"
    if not path.is_file():
        path = reference / "partial.json"
    if not path.is_file():
        raise FileNotFoundError(f"{reference}: no provenance.json (nor partial.json) records its configuration")
    record = read_json(path)
    if not isinstance(record.get("config"), dict):
        raise ValueError(f"{path}: field config: no configuration recorded")
    config = validate_config(record["config"])
    recorded = record.get("analysis_hash") or read_json(reference / "analysis" / "pooled" / "comparison.json").get(
        "analysis_hash"
    )
    if analysis_hash(config) != recorded:
        raise ValueError(
            f"{path}: field config validates to analysis hash {analysis_hash(config)} with this code, not the "
            f"recorded {recorded}: the protocol's settings changed since the run (check out the commit that "
            "reproduces the folder: its reproduce.json, or provenance.json's git)"
        )
    return config


def snakemake_command(workdir: Path, cores: str, extra: list[str]) -> list[str]:
    """The workflow run of a reproduction: this repository's Snakefile in ``workdir`` on the recorded
    configuration alone (the committed default replaced), with Snakemake's arguments the user adds."""
    return [
        sys.executable,
        "-m",
        "snakemake",
        "-s",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        "--cores",
        str(cores),
        "--configfile",
        str(Path(workdir).resolve() / CONFIG_FILE),
        "--replace-workflow-config",
        *extra,
    ]


def rerun(reference: Path, workdir: Path, cores: str, extra: list[str]) -> int:
    """Run the workflow on ``reference``'s configuration in ``workdir`` (outside the reference); its exit status."""
    check_destination(Path(workdir), [Path(reference)], "reproduce")
    require_intact(Path(reference), "reproduce")
    config = recorded_campaign(reference)
    Path(workdir).mkdir(parents=True, exist_ok=True)
    write_text(yaml.safe_dump(config, sort_keys=True), Path(workdir) / CONFIG_FILE)
    return subprocess.run(snakemake_command(workdir, cores, extra)).returncode


def reproduction_record(reference: Path, results: Path) -> dict[str, Any]:
    """How the rerun in ``results`` relates to ``reference``: files, first divergence, statistics, fingerprint."""
    reference, results = Path(reference), Path(results)
    if not (results / "MANIFEST.sha256").is_file():
        raise FileNotFoundError(f"{results / 'MANIFEST.sha256'}: no manifest; the rerun did not finish")
    config = recorded_campaign(reference)
    files = divergence(reference, results, config["replay"])
    reference_record, rerun_record = (
        read_json(p) if p.is_file() else {} for p in (reference / "provenance.json", results / "provenance.json")
    )
    differing, _ = fingerprint_differences(reference_record, rerun_record)
    # a committed file its own manifest no longer vouches for, a record that fails its seal, a file that says it is
    # another
    edited = [*edited_files(reference), *record_problems(reference), *self_description_problems(reference)]
    return {
        "reference": str(reference),
        "results": str(results),
        "identical": not (files["differing"] or files["missing"] or files["extra"] or edited),
        "edited_in_reference": edited,
        "files": files,
        "statistics": statistics_agreement(reference, results),
        "fingerprint": [{"field": f, "reference": a, "rerun": b} for f, a, b in differing],
        "code_version": code_version_note(reference, results),
    }


def _first_lines(first: dict[str, Any]) -> list[str]:
    lines = [f"- first difference in pipeline order: `{first['file']}` ({first['state']}), stage {first['stage']}"]
    if first["first_pass_differing"]:
        lines.append(f"- first pass that differs: {first['first_pass_differing']}")
    rows = first["rows"]
    if rows is None:
        lines.append("- rows: not available (the reference holds only this file's sha256)")
    elif rows["first_difference"] is None:
        lines.append(f"- rows: every row of `{rows['table']}` agrees (the files differ in their encoding)")
    else:
        diff = rows["first_difference"]
        key = ", ".join(f"{k}={v}" for k, v in diff.get("key", {}).items())
        where = f" (only in the {diff['only_in']})" if diff.get("only_in") else ""
        columns = ", ".join(diff.get("columns") or []) or "-"
        lines.append(f"- first differing row of `{rows['table']}`: {key}{where}; columns: {columns}")
    return lines


def report_markdown(record: dict[str, Any]) -> str:
    """The report a reader reads: the verdict, the first divergence, the statistics, the fingerprint."""
    files = record["files"]
    verdict = "identical" if record["identical"] else "different"
    lines = [
        f"# Reproduction of {record['reference']}",
        "",
        f"Rerun: `{record['results']}`. Verdict: **{verdict}**: {files['identical']} of {files['compared']} files of "
        f"the reference's MANIFEST.sha256 identical (sha256), {len(files['differing'])} differ, "
        f"{len(files['missing'])} missing from the rerun, {len(files['extra'])} only in the rerun.",
    ]
    if record["code_version"]:
        lines += ["", record["code_version"]]
    if record["edited_in_reference"]:
        edited = ", ".join(f"`{rel}`" for rel in record["edited_in_reference"])
        lines += ["", f"Files of the reference that differ from its own MANIFEST.sha256 (restore them): {edited}"]
    if files["first"]:
        lines += ["", "## Where the runs diverge", "", *_first_lines(files["first"])]
        lines += ["", "Files that differ, by stage: " + ", ".join(f"{s} {n}" for s, n in files["stages"].items())]
    stats = record["statistics"]
    lines += ["", "## Headline statistics", ""]
    if stats["agree"] is None and not stats["rows"]:
        lines.append(stats.get("reason", "not compared"))
    else:
        lines.append(f"Each estimate within the other run's interval: {'yes' if stats['agree'] else 'no'}")
        lines += [
            "",
            "| config | conditioning | statistic | reference [CI] | rerun [CI] | agree |",
            "|---|---|---|---|---|---|",
        ]
        for r in stats["rows"]:
            ref, new = (
                f"{v[0]:.4g} [{v[1]:.4g}, {v[2]:.4g}]" if None not in v else "n/a" for v in (r["reference"], r["rerun"])
            )
            lines.append(f"| {r['config']} | {r['conditioning']} | {r['statistic']} | {ref} | {new} | {r['agree']} |")
    lines += ["", "## Environment fingerprint", ""]
    if not record["fingerprint"]:
        lines.append("No fingerprint field differs.")
    else:
        lines += ["| field | reference | rerun |", "|---|---|---|"]
        lines += [f"| {f['field']} | {f['reference']!r} | {f['rerun']!r} |" for f in record["fingerprint"]]
    return "\n".join(lines) + "\n"


def write_report(record: dict[str, Any], report: Path, reference: Path) -> tuple[Path, Path]:
    """The report as markdown at ``report`` and JSON beside it, refused inside the reference folder."""
    check_destination(Path(report), [Path(reference)], "reproduce's report")
    md, js = Path(report).with_suffix(".md"), Path(report).with_suffix(".json")
    write_text(report_markdown(record), md)
    write_json(record, js)
    return md, js


def add_rerun_parsers(sub: Any) -> None:
    """The ``compare`` and ``reproduce`` subcommands of ``python -m replaynoise.reference``."""
    check = sub.add_parser("compare", help="check a rerun against a reference folder (exit 1 on a difference)")
    check.add_argument("reference", type=Path)
    check.add_argument("results", type=Path)
    redo = sub.add_parser(
        "reproduce",
        help="rerun the campaign a reference folder records in WORKDIR and report identity, or where the runs "
        "first diverge (exit 0 identical, 1 on a difference)",
    )
    redo.add_argument("reference", type=Path)
    redo.add_argument("--workdir", type=Path, default=None, help="the rerun's folder (default reproductions/NAME)")
    redo.add_argument("--cores", default="all", help="Snakemake's --cores (default all)")
    redo.add_argument("--report", type=Path, default=None, help="the report's path (default WORKDIR/reproduction.md)")
    redo.add_argument("--no-run", action="store_true", help="compare the rerun already in WORKDIR, run nothing")
    redo.set_defaults(snakemake_args=[])  # the arguments after --, passed to Snakemake (parse_arguments)


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed, where ``reproduce`` gives arguments after ``--``, those kept for Snakemake unread (argparse
    refuses a ``--`` within a subcommand's arguments)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    passed: list[str] = []
    if argv[:1] == ["reproduce"] and "--" in argv:
        argv, passed = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args = parser.parse_args(argv)
    if passed:
        args.snakemake_args = passed
    return args


def compare_runs(reference: Path, results: Path, out: TextIO | None = None) -> bool:
    """``compare``: the files (``snapshots.compare``), then the fingerprint fields that differ; True if identical."""
    out = sys.stdout if out is None else out
    agrees = compare(reference, results, out)
    print("\n".join(fingerprint_lines(reference, results)), file=out)
    return agrees


def rerun_command(args: argparse.Namespace) -> int:
    """Run ``compare`` or ``reproduce``; the exit status (0 identical, 1 a difference)."""
    if args.command == "compare":
        return 0 if compare_runs(args.reference, args.results) else 1
    workdir = args.workdir or Path("reproductions") / Path(args.reference).resolve().name
    report = args.report or workdir / "reproduction.md"
    check_destination(workdir, [args.reference], "reproduce")
    check_destination(report, [args.reference], "reproduce's report")
    if not args.no_run:
        status = rerun(args.reference, workdir, args.cores, args.snakemake_args)
        if status != 0:
            raise ValueError(f"{workdir}: the workflow stopped (Snakemake exit {status}); see its log above")
    record = reproduction_record(args.reference, workdir / "results")
    md, js = write_report(record, report, args.reference)
    print(report_markdown(record), end="")
    print(f"Report: {md} and {js}")
    return 0 if record["identical"] else 1
