"""A reviewer's commands on folders that were tampered with, and commands aimed at a reference: each reader checks a
folder against its own records first and refuses by file and field; no command writes into a folder a manifest
vouches for or into its own source, links resolved."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import polars as pl
import pytest

from replaynoise.io import FolderBusyError, hold_folder, read_manifest
from replaynoise.partials import partial
from replaynoise.power import main as power_main
from replaynoise.reference import main
from replaynoise.regime import main as regime_main
from replaynoise.snapshots import rewrite_manifest_lines
from replaynoise.vouching import record_problems, sealed, self_description_problems

REPO = Path(__file__).resolve().parents[1]
GEMMA = REPO / "reference" / "gpu" / "gemma"
LADDER = REPO / "reference" / "gpu-vllm" / "ladder"
PILOT = LADDER / "qwen-0.5b"  # replicated passes: a pilot power plans from, a side of a contrast
PILOT_CONFIG = "qwen2.5-coder-0.5b-vllm"
SGLANG = REPO / "reference" / "gpu-sglang"
SGLANG_RUNS = ("qwen-1.5b-vllm-problems", "qwen-1.5b-vllm-problems-2026-12-06")  # two runs of one campaign


def copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def rewrite_line(folder: Path, rel: str) -> None:
    """Set ``rel``'s manifest line to the file's digest as it now stands, as a careful tamperer would."""
    manifest = folder / "MANIFEST.sha256"
    entries = read_manifest(manifest)
    entries[rel] = hashlib.sha256((folder / rel).read_bytes()).hexdigest()
    manifest.write_text("".join(f"{digest}  {name}\n" for name, digest in entries.items()))


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------- 1. tampered inputs


def test_tables_and_reanalyze_refuse_an_edited_input_and_rewrite_no_manifest_line(tmp_path, capsys):
    """``tables`` on an edited comparison rewrote three tables and their manifest lines; ``reanalyze`` after an
    edited credit table recomputed the analysis from it. Both refuse by file, and the folder stays as it was."""
    ref = copy(GEMMA, tmp_path / "gemma")
    comparison = ref / "analysis" / "gemma3-bf16" / "comparison.json"
    comparison.write_text(comparison.read_text().replace('"n_pivots": ', '"n_pivots": 1'))
    before = tree(ref)
    assert main(["tables", str(ref)]) == 2
    assert f"{comparison} differs from its manifest" in capsys.readouterr().err
    shutil.copy(GEMMA / "analysis" / "gemma3-bf16" / "comparison.json", comparison)
    credit = ref / "credit" / "gemma3-bf16" / "refeed.parquet"
    frame = pl.read_parquet(credit)
    frame.with_columns(a_hat=-pl.col("a_hat")).write_parquet(credit)
    before = tree(ref)
    assert main(["reanalyze", str(ref)]) == 2
    assert f"{credit} differs from its manifest" in capsys.readouterr().err
    assert tree(ref) == before


def test_credit_tables_swapped_with_their_manifest_lines_are_named_by_their_pass_name(tmp_path, capsys):
    """Two passes' credit tables swapped together with their manifest lines leave every line true; each table's
    ``pass_name`` column says which pass it is, and every reader of the folder checks it against the name."""
    ref = copy(GEMMA, tmp_path / "gemma")
    folder = ref / "credit" / "gemma3-bf16"
    (folder / "exact.parquet").rename(folder / "swap")
    (folder / "replica.parquet").rename(folder / "exact.parquet")
    (folder / "swap").rename(folder / "replica.parquet")
    for name in ("exact", "replica"):
        rewrite_line(ref, f"credit/gemma3-bf16/{name}.parquet")
    problems = self_description_problems(ref)
    assert f"{folder / 'exact.parquet'}: column pass_name holds ['replica']" in problems[0] and len(problems) == 2
    assert main(["tables", str(ref)]) == 2
    assert "column pass_name holds ['replica']" in capsys.readouterr().err
    assert main(["compare", str(ref), str(GEMMA)]) == 1
    assert "column pass_name holds" in capsys.readouterr().out
    assert main(["rebuild", str(ref), str(tmp_path / "out")]) == 1
    assert "column pass_name holds" in capsys.readouterr().out


def test_a_comparison_moved_to_another_configuration_s_folder_is_named_by_its_config_field(tmp_path):
    ref = copy(GEMMA, tmp_path / "gemma")
    comparison = ref / "analysis" / "gemma3-bf16" / "comparison.json"
    comparison.write_text(json.dumps({**json.loads(comparison.read_text()), "config": "other", "analysis_hash": "x"}))
    rewrite_line(ref, "analysis/gemma3-bf16/comparison.json")
    problems = self_description_problems(ref)
    assert any("field config is 'other', not its folder 'gemma3-bf16'" in line for line in problems)
    assert any("field analysis_hash is 'x'" in line for line in problems)


@pytest.mark.parametrize(
    "field",
    [
        ("git", "commit"),
        ("git", "dirty"),
        ("packages", "torch"),
        ("hardware", "cpu_model"),
        ("manifest_files",),
        ("config", "resources", "threads"),
        ("environment",),
        ("deviations_from_committed_defaults",),
    ],
)
def test_a_sealed_provenance_names_any_edited_field_and_a_rewritten_manifest(tmp_path, field):
    """provenance.json carries the sha256 of the manifest written with it and of its own fields: an edit of any
    field, or of the manifest after the run, fails the record's check."""
    (tmp_path / "MANIFEST.sha256").write_text(f"{'a' * 64}  tables/headline.csv\n")
    record = {
        "git": {"commit": "c" * 40, "dirty": False},
        "packages": {"torch": "2.9.0"},
        "hardware": {"cpu_model": "EPYC"},
        "manifest_files": 3,
        "config": {"resources": {"threads": 2}},
        "environment": {"REPLAYNOISE_STATIC_ATTENTION": None},
        "deviations_from_committed_defaults": [],
    }
    (tmp_path / "provenance.json").write_text(json.dumps(sealed(record, tmp_path / "MANIFEST.sha256")))
    assert record_problems(tmp_path, required=True) == []
    edited = json.loads((tmp_path / "provenance.json").read_text())
    node = edited
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = "edited"
    (tmp_path / "provenance.json").write_text(json.dumps(edited))
    assert [line.split(": ")[1] for line in record_problems(tmp_path)] == ["field record_sha256"]
    (tmp_path / "provenance.json").write_text(json.dumps(sealed(record, tmp_path / "MANIFEST.sha256")))
    (tmp_path / "MANIFEST.sha256").write_text(f"{'b' * 64}  tables/headline.csv\n")
    assert [line.split(": ")[1] for line in record_problems(tmp_path)] == ["field manifest_sha256"]
    del edited["record_sha256"], edited["manifest_sha256"]  # a seal stripped: refused where one is required
    (tmp_path / "provenance.json").write_text(json.dumps(edited))
    assert record_problems(tmp_path) == [] and "missing" in record_problems(tmp_path, required=True)[0]


@pytest.mark.parametrize("dropped", ["conditionings", "parameters", "metric"])
def test_contrast_and_power_name_the_file_and_the_field_a_comparison_lacks(tmp_path, dropped, capsys):
    """A comparison with no conditionings or no parameters (its manifest line rewritten) ended in a KeyError."""
    pilot = copy(PILOT, tmp_path / "pilot")
    path = pilot / "analysis" / PILOT_CONFIG / "comparison.json"
    record = json.loads(path.read_text())
    del record[dropped]
    path.write_text(json.dumps(record))
    rewrite_line(pilot, f"analysis/{PILOT_CONFIG}/comparison.json")
    assert main(["contrast", str(tmp_path / "c.md"), str(pilot), str(PILOT)]) == 2
    assert f"{path}: field {dropped}" in capsys.readouterr().err
    if dropped != "metric":  # power reads no metric
        assert power_main([str(pilot)]) == 2
        assert f"{path}: field {dropped}" in capsys.readouterr().err


def test_partial_refuses_a_campaign_that_is_not_the_run_s_by_file_and_column(tmp_path):
    """A campaign of k 4 and seed 12 given for a run of k 2 and seed 11 was recorded in partial.json as the
    run's; the run's credit tables (their k) and pass rows (their derived seeds) say otherwise."""
    full, name = LADDER / "qwen-1.5b", "qwen2.5-coder-1.5b-vllm"
    results = tmp_path / "results"
    (results / "credit" / name).mkdir(parents=True)
    for done in ("exact", "replica", "refeed"):
        shutil.copy(full / "credit" / name / f"{done}.parquet", results / "credit" / name)
    config = json.loads((full / "provenance.json").read_text())["config"]
    campaign = tmp_path / "campaign.yaml"
    campaign.write_text(json.dumps({**config, "replay": {**config["replay"], "k": 2}}))
    with pytest.raises(ValueError, match=r"exact.parquet: column k holds \[4\], the campaign's replay.k is 2"):
        partial(results, campaign, tmp_path / "kept")
    seeds = pl.DataFrame({"pivot_id": ["p0"], "branch": ["orig"], "k": [0], "seed": [1]})
    (results / "passes" / name).mkdir(parents=True)
    seeds.write_parquet(results / "passes" / name / "exact.parquet")
    campaign.write_text(json.dumps({**config, "seed": 12}))
    with pytest.raises(ValueError, match=r"column seed of pivot p0 is not what the campaign's seed 12 derives"):
        partial(results, campaign, tmp_path / "kept")
    assert not (tmp_path / "kept").exists()


# ------------------------------------------------------------------------- 2. commands that write


def test_no_command_writes_into_a_reference_or_its_source_even_through_a_link(tmp_path, monkeypatch, capsys):
    """``contrast A B --out A/tables/headline.md`` overwrote the reference's table and ``figure A --out A`` wrote
    into it; a destination in any folder a manifest vouches for is refused, as is one reached through a link."""
    pilot, other = copy(PILOT, tmp_path / "refs" / "pilot"), copy(GEMMA, tmp_path / "refs" / "gemma")
    (tmp_path / "link").symlink_to(pilot)
    (tmp_path / "table.md").symlink_to(pilot / "tables" / "headline.md")
    before = {f: tree(f) for f in (pilot, other)}
    monkeypatch.chdir(tmp_path)
    for out in (pilot / "tables" / "headline.md", tmp_path / "link" / "x.md", other / "x.md", tmp_path / "table.md"):
        assert main(["contrast", str(out), str(pilot), str(PILOT)]) == 2, out
        assert "contrast would write" in capsys.readouterr().err
    for out in (pilot, tmp_path / "link", other / "figures"):
        assert main(["figure", str(out), str(pilot)]) == 2, out
        assert "figure would write" in capsys.readouterr().err
    assert main(["combine", str(pilot), str(PILOT), "--out", str(other)]) == 2
    assert "combine would write" in capsys.readouterr().err
    assert main(["combine", str(pilot), str(PILOT)]) == 2  # one run twice: named, not a TypeError
    assert f"{PILOT} and {pilot} hold the same credit tables" in capsys.readouterr().err
    assert main(["rebuild", str(pilot), str(other / "rebuilt")]) == 2
    assert "rebuild would write" in capsys.readouterr().err
    assert {f: tree(f) for f in (pilot, other)} == before
    # named files beside the sources, in a folder no manifest vouches for, as reference/gpu's figure is drawn
    assert main(["figure", str(tmp_path / "refs"), str(pilot)]) == 0
    runs = [copy(SGLANG / name, tmp_path / "runs" / name) for name in SGLANG_RUNS]
    assert main(["combine", *map(str, runs), "--out", str(tmp_path / "runs")]) == 0
    assert (tmp_path / "refs" / "channel_agreement.png").is_file() and list((tmp_path / "runs").glob("combined-*"))
    assert {f: tree(f) for f in (pilot, other)} == before


def test_tables_never_write_through_a_link_out_of_the_reference(tmp_path, capsys):
    ref = copy(GEMMA, tmp_path / "gemma")
    elsewhere = copy(ref / "tables", tmp_path / "elsewhere")
    shutil.rmtree(ref / "tables")
    os.symlink(elsewhere, ref / "tables")
    before = tree(elsewhere)
    assert main(["tables", str(ref)]) == 2
    assert "tables would write through a link out of" in capsys.readouterr().err
    assert tree(elsewhere) == before


# --------------------------------------------------------------------- 3. a value named, not a traceback


def _pilot_with(tmp_path: Path, text: str | None, rewrite: bool = True) -> tuple[Path, Path]:
    """A copy of the pilot whose comparison holds ``text`` (None: a folder in its place), its manifest line
    rewritten to match where ``rewrite``."""
    pilot = copy(PILOT, tmp_path / "pilot")
    path = pilot / "analysis" / PILOT_CONFIG / "comparison.json"
    path.unlink()
    if text is None:
        path.mkdir()
    else:
        path.write_text(text)
        if rewrite:
            rewrite_line(pilot, f"analysis/{PILOT_CONFIG}/comparison.json")
    return pilot, path


@pytest.mark.parametrize(
    "text,said",
    [
        ("{}", "field config is None"),
        ('{"conditionings": ', "not readable JSON"),
        (None, "is not a file"),
    ],
)
def test_power_names_a_comparison_that_is_empty_truncated_or_a_folder(tmp_path, capsys, text, said):
    pilot, path = _pilot_with(tmp_path, text)
    assert power_main([str(pilot)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and said in err and "Traceback" not in err


def test_power_names_a_comparison_that_links_to_a_system_file(tmp_path, capsys):
    pilot, path = _pilot_with(tmp_path, "")
    path.unlink()
    path.symlink_to("/etc/passwd")
    assert power_main([str(pilot)]) == 2
    assert f"{path} is a link to /etc/passwd, outside the folder" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,said",
    [
        (["--excess", "nan"], "finite numbers"),
        (["--excess", "5", "inf"], "finite numbers"),
        (["--run-sd=-inf", "--runs", "2"], "finite numbers"),
        (["--conditioning", "bogus"], "field conditionings has no 'bogus' (it has"),
    ],
)
def test_power_refuses_a_value_it_cannot_plan_with_by_name(capsys, args, said):
    assert power_main([str(PILOT), *args]) == 2
    out = capsys.readouterr()
    assert said in out.err and "nan" not in out.out


# ----------------------------------------------------------------- 4. a planner trusted with no variance


def test_power_refuses_a_pilot_whose_excess_has_no_variance(tmp_path, capsys):
    """A pilot whose every excess is 0 (SE 0, t undefined) was planned from, at power 1.00 with 20 problems."""
    pilot = copy(PILOT, tmp_path / "pilot")
    path = pilot / "analysis" / PILOT_CONFIG / "comparison.json"
    record = json.loads(path.read_text())
    parts = record["conditionings"]["main"]["replicated"]["excess_pp"]["crossed"]["components"]
    parts.update(problem_sd=0.0, pass_sd=0.0, residual_sd=0.0, mean_squares={"problems": 0, "pairs": 0, "residual": 0})
    path.write_text(json.dumps(record))
    rewrite_line(pilot, f"analysis/{PILOT_CONFIG}/comparison.json")
    assert power_main([str(pilot)]) == 2
    err = capsys.readouterr().err
    assert "every SD is 0" in err and "cannot estimate a variance" in err


# ------------------------------------------------------------------------------------ 6. shared folders


def test_a_folder_held_by_one_run_is_refused_to_another_through_any_link_and_freed_when_it_ends(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "results").symlink_to(tmp_path / "results")
    held = hold_folder(tmp_path / "results")
    with pytest.raises(FolderBusyError, match=r"elsewhere/results: another run is using this folder"):
        hold_folder(tmp_path / "elsewhere" / "results")
    os.close(held)  # as when the run ends, however it ends
    os.close(hold_folder(tmp_path / "elsewhere" / "results"))


def test_the_mechanism_and_its_validation_refuse_an_edited_campaign_by_file(tmp_path, capsys):
    campaign = copy(LADDER / "qwen-1.5b", tmp_path / "qwen-1.5b")
    credit = campaign / "credit" / "qwen2.5-coder-1.5b-vllm" / "refeed.parquet"
    pl.read_parquet(credit).with_columns(a_hat=-pl.col("a_hat")).write_parquet(credit)
    assert regime_main(["mechanism", str(campaign), "--out", str(tmp_path / "out")]) == 2
    assert f"{credit} differs from its manifest" in capsys.readouterr().err
    (tmp_path / "probe.json").write_text("{}")
    assert regime_main(["validate", f"{tmp_path / 'probe.json'}={campaign}", "--out", str(tmp_path / "out")]) == 2
    assert f"{credit} differs from its manifest" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_tables_reseal_a_sealed_record_after_rewriting_manifest_lines(tmp_path, capsys):
    """A snapshot of a sealed run keeps its seal; ``tables`` rewrites manifest lines from verified inputs and
    sets the record's manifest digest to the new manifest, so the folder still checks out."""
    ref = copy(GEMMA, tmp_path / "gemma")
    record = json.loads((ref / "provenance.json").read_text())
    (ref / "provenance.json").write_text(json.dumps(sealed(record, ref / "MANIFEST.sha256")))
    (ref / "tables" / "headline.md").write_text("a stale table\n")
    assert main(["tables", str(ref)]) == 0, capsys.readouterr().err
    assert record_problems(ref, required=True) == []
    assert main(["compare", str(ref), str(GEMMA)]) == 0
    before = (ref / "MANIFEST.sha256").read_bytes()
    (ref / "tables" / "headline.md").write_text("a table the new table code writes\n")
    rewrite_manifest_lines(ref, ["tables/headline.md"])  # as tables and reanalyze do after a code change
    assert (ref / "MANIFEST.sha256").read_bytes() != before and record_problems(ref, required=True) == []
