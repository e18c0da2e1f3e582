"""A reference reproduced on demand (``reference reproduce``): identity reported file by file, the first divergence
named by stage, pass and row, and the environment fingerprint that ``reference compare`` reads."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import polars as pl
from helpers import REPO, seed_model

from replaynoise.fingerprint import fingerprint_differences
from replaynoise.reference import _parser, main
from replaynoise.reproduction import parse_arguments, snakemake_command
from replaynoise.snapshots import snapshot

LADDER_15B = REPO / "reference" / "gpu-vllm" / "ladder" / "qwen-1.5b"
SGLANG_15B = REPO / "reference" / "gpu-sglang" / "qwen-1.5b-vllm-problems"


def test_compare_names_the_fingerprint_fields_that_differ(tmp_path, capsys):
    """Two committed runs of one model on other engines and cards: the card, the engine and its settings are named
    (field, reference value, rerun value), from records written before the fingerprint existed."""
    reference, rerun = (json.loads((f / "provenance.json").read_text()) for f in (LADDER_15B, SGLANG_15B))
    differing = {field: (a, b) for field, a, b in fingerprint_differences(reference, rerun)[0]}
    assert differing["card.name"] == ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
    assert differing["engines[qwen2.5-coder-1.5b-vllm].version"] == ("0.26.0", "(not recorded)")
    folders = []
    for name, card, backend in (("ref", "NVIDIA H100 80GB HBM3", None), ("rerun", "NVIDIA H200", "fa3")):
        folder = tmp_path / name
        (folder / "t.csv").parent.mkdir(parents=True)
        (folder / "t.csv").write_text("a\n1\n")
        digest = hashlib.sha256(b"a\n1\n").hexdigest()
        (folder / "MANIFEST.sha256").write_text(f"{digest}  t.csv\n")
        record = {
            **rerun,
            "fingerprint": {"card": {"name": card}, "engines": {"c": {"resolved": {"backend": backend}}}},
        }
        (folder / "provenance.json").write_text(json.dumps(record))
        folders.append(str(folder))
    assert main(["compare", *folders]) == 0  # the files agree; the fingerprint is named beside them
    out = capsys.readouterr().out
    assert "Environment fingerprint: 2 field(s) differ" in out
    assert "card.name: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA H200'" in out
    assert "engines[c].resolved.backend: None -> 'fa3'" in out


def test_reproduce_reruns_a_tiny_reference_reports_identity_and_refuses_to_write_into_it(
    tiny_run, tiny_prepared, tmp_path, capsys
):
    ref = tmp_path / "ref"
    snapshot(tiny_run / "results", ref)
    work = tmp_path / "work"
    seed_model(work, tiny_prepared)  # the prepared model as the reference's run had it: no preparation step
    assert main(["reproduce", str(ref), "--workdir", str(work), "--cores", "2"]) == 0, capsys.readouterr()
    record = json.loads((work / "reproduction.json").read_text())
    assert record["identical"] and record["files"]["first"] is None
    assert (
        record["files"]["identical"]
        == record["files"]["compared"]
        == len((ref / "MANIFEST.sha256").read_text().split("\n")) - 1
    )
    assert record["statistics"]["agree"] is True and record["fingerprint"] == []
    assert "Verdict: **identical**" in (work / "reproduction.md").read_text()
    assert "fingerprint" in json.loads((work / "results" / "provenance.json").read_text())
    capsys.readouterr()
    inside = ref / "report.md"
    assert main(["reproduce", str(ref), "--workdir", str(work), "--no-run", "--report", str(inside)]) == 2
    assert f"{inside}: reproduce's report would write inside {ref}" in capsys.readouterr().err
    assert main(["reproduce", str(ref), "--workdir", str(ref / "w")]) == 2
    assert f"{ref / 'w'}: reproduce would write inside {ref}" in capsys.readouterr().err
    assert not inside.exists() and not (ref / "w").exists()


def _rewrite(results: Path, rel: str, frame: pl.DataFrame) -> None:
    """``rel`` rewritten with ``frame``, and its manifest line with it, as a rerun that made it so would."""
    frame.write_parquet(results / rel)
    digest = hashlib.sha256((results / rel).read_bytes()).hexdigest()
    lines = (results / "MANIFEST.sha256").read_text().splitlines()
    (results / "MANIFEST.sha256").write_text(
        "".join(f"{digest}  {rel}\n" if line.endswith(f"  {rel}") else f"{line}\n" for line in lines)
    )


def test_reproduce_names_the_first_divergence_by_stage_pass_and_row(tiny_run, tmp_path, capsys):
    """A rerun whose replica pass drew other tokens for one row: against a whole run's folder the row itself is
    named (pivot, branch, k); against a snapshot, which holds that pass's rows only as a checksum, the first
    differing pivot of the pass's credit table is."""
    work = tmp_path / "work"
    shutil.copytree(tiny_run / "results", work / "results", ignore=shutil.ignore_patterns("models"))
    rows = pl.read_parquet(work / "results" / "passes" / "tiny" / "replica.parquet")
    changed = rows.with_columns(
        token_ids=pl.when(pl.int_range(pl.len()) == 3).then(pl.lit([0], dtype=pl.List(pl.Int64))).otherwise("token_ids")
    )
    _rewrite(work / "results", "passes/tiny/replica.parquet", changed)
    assert main(["reproduce", str(tiny_run / "results"), "--workdir", str(work), "--no-run"]) == 1
    first = json.loads((work / "reproduction.json").read_text())["files"]["first"]
    assert (first["file"], first["stage"], first["pass"]) == ("passes/tiny/replica.parquet", "passes", "replica")
    row = rows.row(3, named=True)
    assert first["rows"]["first_difference"]["key"] == {k: row[k] for k in ("problem_id", "pivot_id", "branch", "k")}
    assert first["rows"]["first_difference"]["columns"] == ["token_ids"]
    key = f"problem_id={row['problem_id']}, pivot_id={row['pivot_id']}, branch={row['branch']}, k={row['k']}"
    assert f"first differing row of `passes/tiny/replica.parquet`: {key}; columns: token_ids" in capsys.readouterr().out

    ref = tmp_path / "ref"
    snapshot(tiny_run / "results", ref)
    credit = pl.read_parquet(work / "results" / "credit" / "tiny" / "replica.parquet")
    _rewrite(
        work / "results",
        "credit/tiny/replica.parquet",
        credit.with_columns(n_sub_correct=pl.col("n_sub_correct") + (pl.int_range(pl.len()) == 1)),
    )
    assert main(["reproduce", str(ref), "--workdir", str(work), "--no-run"]) == 1
    record = json.loads((work / "reproduction.json").read_text())
    first = record["files"]["first"]
    assert first["file"] == "passes/tiny/replica.parquet" and first["rows"]["table"] == "credit/tiny/replica.parquet"
    assert first["rows"]["first_difference"]["key"]["pivot_id"] == credit["pivot_id"][1]
    assert record["files"]["stages"] == {"passes": 1, "credit": 1} and record["edited_in_reference"] == []
    (ref / "tables" / "headline.md").write_text("an edited table\n")  # the reference's own manifest catches it
    assert main(["reproduce", str(ref), "--workdir", str(work), "--no-run"]) == 1
    assert json.loads((work / "reproduction.json").read_text())["edited_in_reference"] == ["tables/headline.md"]


def test_reproduce_passes_the_arguments_after_a_double_dash_to_snakemake_and_refuses_a_changed_protocol(
    tmp_path, capsys
):
    """``reproduce REF -- ARGS``: ARGS reach Snakemake's command line unread. A reference whose recorded
    configuration this code validates to another analysis hash (reference/cpu, of an older protocol) is refused by
    file and field before anything runs."""
    args = parse_arguments(_parser(), ["reproduce", "ref", "--cores", "4", "--", "--resources", "gpu=1", "-n"])
    assert (args.cores, args.snakemake_args) == ("4", ["--resources", "gpu=1", "-n"])
    command = snakemake_command(tmp_path, args.cores, args.snakemake_args)
    assert command[-4:] == ["--replace-workflow-config", "--resources", "gpu=1", "-n"]
    assert command[command.index("--directory") + 1] == str(tmp_path)
    assert main(["reproduce", str(REPO / "reference" / "cpu"), "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert f"{REPO / 'reference' / 'cpu' / 'provenance.json'}: field config validates to analysis hash" in err
    assert not (tmp_path / "w" / "results").exists()
