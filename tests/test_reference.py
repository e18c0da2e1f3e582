"""Committed reference results: the snapshot keeps the small outputs, the check names every difference."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from helpers import analysis_settings

from replaynoise.analysis.comparison import _null_numbers, compare_passes
from replaynoise.generation.replay import PASS_SCHEMA
from replaynoise.io import read_manifest, write_json
from replaynoise.partials import ROW_COLUMNS, partial, whole_pairs
from replaynoise.power import main as power_main
from replaynoise.provenance import verify_manifest, write_manifest
from replaynoise.reference import channel_data, main
from replaynoise.snapshots import DRIFT_TOLERANCE, compare, float_drift, snapshot

REPO = Path(__file__).resolve().parents[1]
GPU = REPO / "reference" / "gpu"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import coverage  # noqa: E402


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def fake_results(root, headline="config,excess_pp\na,7.5\nb,3.0\n"):
    files = {
        "tables/headline.csv": headline,
        "rollouts/c/kv/000/p1.safetensors": "kv bytes",
        "analysis/c/comparison.json": '{"config": "c"}',
        "passes/c/exact.parquet": "rows",
    }
    lines = [f"{write(root / path, text)}  {path}" for path, text in sorted(files.items())]
    (root / "MANIFEST.sha256").write_text("\n".join(lines) + "\n")
    write(root / "provenance.json", "{}")
    return root


def vouched(folder):
    """``folder`` with a manifest of the files it holds, as a run's or a reference's (a command reads no other)."""
    folder.mkdir(parents=True, exist_ok=True)
    write_manifest([folder], folder, folder / "MANIFEST.sha256")
    return folder


def test_snapshot_keeps_tables_and_manifest_not_kv_or_parquet(tmp_path):
    results = fake_results(tmp_path / "results")
    copied = {p.relative_to(tmp_path / "ref").as_posix() for p in snapshot(results, tmp_path / "ref")}
    assert copied == {"MANIFEST.sha256", "provenance.json", "tables/headline.csv", "analysis/c/comparison.json"}
    # the manifest still vouches for what was left out
    assert "rollouts/c/kv/000/p1.safetensors" in read_manifest(tmp_path / "ref" / "MANIFEST.sha256")


def test_identical_rerun_agrees(tmp_path, capsys):
    snapshot(fake_results(tmp_path / "results"), tmp_path / "ref")
    assert compare(tmp_path / "ref", fake_results(tmp_path / "rerun"))
    assert "4 of 4 reference files identical" in capsys.readouterr().out


def test_a_changed_table_is_reported_cell_by_cell(tmp_path, capsys):
    # headline.csv starts with '#' lines (the analysis hash, the paper's ranges), as the workflow writes it
    headline = "# hash: x\nconfig,excess_pp\na,7.5\nb,3.0\n"
    snapshot(fake_results(tmp_path / "results", headline=headline), tmp_path / "ref")
    rerun = fake_results(tmp_path / "rerun", headline="# hash: x\nconfig,excess_pp\na,7.5\nb,4.25\n")
    assert main(["compare", str(tmp_path / "ref"), str(rerun)]) == 1
    out = capsys.readouterr().out
    assert "1 differ" in out and "differs: tables/headline.csv" in out and "row 1 excess_pp: 3.0 -> 4.25" in out


def test_missing_and_extra_files_are_named(tmp_path, capsys):
    snapshot(fake_results(tmp_path / "results"), tmp_path / "ref")
    rerun = fake_results(tmp_path / "rerun")
    manifest = rerun / "MANIFEST.sha256"
    lines = [line for line in manifest.read_text().splitlines() if "comparison.json" not in line]
    manifest.write_text("\n".join(lines + [f"{'0' * 64}  analysis/d/comparison.json"]) + "\n")
    assert not compare(tmp_path / "ref", rerun)
    out = capsys.readouterr().out
    assert "missing: analysis/c/comparison.json" in out and "extra: analysis/d/comparison.json" in out


def test_a_run_without_manifest_is_refused_naming_it(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    assert main(["snapshot", str(tmp_path / "results"), str(tmp_path / "ref")]) == 2
    assert "results/MANIFEST.sha256: no manifest" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "MANIFEST.sha256").write_text("not a manifest line\n")
    with pytest.raises(ValueError, match="MANIFEST.sha256:1: not a sha256sum line"):
        read_manifest(tmp_path / "bad" / "MANIFEST.sha256")


def test_figure_of_several_folders_keeps_their_order_and_draws_from_committed_files(tmp_path, capsys):
    data = channel_data([GPU / "gemma", GPU / "smollm2"])
    assert list(data) == ["gemma3-bf16", "smollm2-bf16", "smollm2-fp16"]  # folder order, then names
    comparison, channels = data["gemma3-bf16"]
    assert comparison["config"] == "gemma3-bf16" and set(channels["pass_b"]) == {"refeed", "replica"}
    assert main(["figure", str(tmp_path / "fig"), str(GPU / "gemma"), str(GPU / "smollm2")]) == 0
    assert "3 configurations drawn" in capsys.readouterr().out
    assert (tmp_path / "fig" / "channel_agreement.png").read_bytes()[:4] == b"\x89PNG"


def test_figure_refuses_a_folder_given_twice_and_one_without_analysis_by_name(tmp_path, capsys):
    assert main(["figure", str(tmp_path / "fig"), str(GPU / "gemma"), str(GPU / "gemma")]) == 2
    assert "'gemma3-bf16' is in two of the folders" in capsys.readouterr().err
    empty = tmp_path / "empty"
    vouched(empty)
    assert main(["figure", str(tmp_path / "fig"), str(empty)]) == 2
    assert f"{empty}: no analysis/<config>/channels.csv" in capsys.readouterr().err


def test_rebuild_of_a_committed_gpu_reference_agrees_with_its_manifest(tmp_path, capsys):
    assert main(["rebuild", str(GPU / "gemma"), str(tmp_path / "rebuilt")]) == 0
    out = capsys.readouterr().out
    assert "rebuilt files and credit tables identical" in out and "differs" not in out
    # the numbers come from the credit tables: the rebuilt table has the committed main row
    assert "| gemma3-bf16 | main | sign | 475 (32) |" in (tmp_path / "rebuilt" / "tables" / "headline.md").read_text()


def test_rebuild_keeps_the_prefix_mismatch_a_reference_cannot_recompute(tmp_path, capsys):
    """The mismatch channel comes from every prefix token's two log-probs, which a reference folder does not
    hold: a rebuild carries the committed block, and the rebuilt tables keep its sentence and agree."""
    assert main(["rebuild", str(GPU / "smollm2-mismatch"), str(tmp_path / "rebuilt")]) == 0
    assert "differs" not in capsys.readouterr().out
    table = (tmp_path / "rebuilt" / "tables" / "headline.md").read_text()
    assert "- prefix mismatch: smollm2-bf16: at this configuration's mean k3_kl of 0.00137" in table


def test_rebuild_names_a_changed_pivot_and_the_table_cells_it_moves(tmp_path, capsys):
    reference = tmp_path / "gemma"
    shutil.copytree(GPU / "gemma", reference)
    exact = reference / "credit" / "gemma3-bf16" / "exact.parquet"
    frame = pl.read_parquet(exact)
    first_nonzero = frame["a_hat"].ne(0).arg_max()  # a pivot with a sign to flip
    flipped = frame.with_columns(
        a_hat=pl.when(pl.int_range(pl.len()) == first_nonzero).then(-pl.col("a_hat")).otherwise(pl.col("a_hat"))
    )
    flipped.write_parquet(exact)
    assert main(["rebuild", str(reference), str(tmp_path / "rebuilt")]) == 1
    out = capsys.readouterr().out
    assert "differs: credit/gemma3-bf16/exact.parquet" in out
    assert "differs: tables/headline.csv" in out and "refeed_disagreement" in out  # cell by cell


def test_rebuild_refuses_a_configuration_that_is_not_the_analysed_one(tmp_path, capsys):
    reference = tmp_path / "gemma"
    shutil.copytree(GPU / "gemma", reference)
    provenance = json.loads((reference / "provenance.json").read_text())
    provenance["config"]["analysis"]["theta"] = 0.25
    (reference / "provenance.json").write_text(json.dumps(provenance))
    assert main(["rebuild", str(reference), str(tmp_path / "rebuilt")]) == 2
    assert "analysis hash" in capsys.readouterr().err


def with_git(root, commit, dirty=False):
    (root / "provenance.json").write_text(json.dumps({"git": {"commit": commit, "dirty": dirty}}))
    return root


def test_compare_names_the_commit_that_reproduces_the_reference_when_the_rerun_ran_other_code(tmp_path, capsys):
    snapshot(fake_results(tmp_path / "results"), tmp_path / "ref")
    with_git(tmp_path / "ref", "a" * 40, dirty=True)
    (tmp_path / "ref" / "reproduce.json").write_text(json.dumps({"commit": "b" * 40, "note": "committed later"}))
    rerun = fake_results(tmp_path / "rerun")
    with_git(rerun, "c" * 40)
    assert compare(tmp_path / "ref", rerun)  # the files agree; the code note is said all the same
    out = capsys.readouterr().out
    assert f"reproduced by commit {'b' * 40}" in out and f"this rerun ran {'c' * 40}" in out
    assert f"Check out {'b' * 40}" in out and "committed later" in out
    with_git(rerun, "b" * 40, dirty=True)
    compare(tmp_path / "ref", rerun)
    assert "with uncommitted changes" in capsys.readouterr().out
    with_git(rerun, "b" * 40)  # the named commit, clean: nothing to say
    compare(tmp_path / "ref", rerun)
    assert "Code version" not in capsys.readouterr().out
    (tmp_path / "ref" / "reproduce.json").unlink()  # a dirty run and no record: no commit is known
    compare(tmp_path / "ref", rerun)
    assert "no commit is known to reproduce the reference" in capsys.readouterr().out
    with_git(tmp_path / "ref", "b" * 40)  # a clean run names its own commit
    compare(tmp_path / "ref", with_git(rerun, "d" * 40))
    assert f"reproduced by commit {'b' * 40}" in capsys.readouterr().out


def test_every_hf_reference_run_from_a_changed_tree_says_which_commit_reproduces_it():
    folders = [GPU.parent / "cpu"] + [p.parent for p in sorted(GPU.glob("*/provenance.json"))]
    assert len(folders) == 14
    for folder in folders:
        if json.loads((folder / "provenance.json").read_text())["git"]["dirty"]:
            record = json.loads((folder / "reproduce.json").read_text())
            assert record["note"] and (record["commit"] is None or len(record["commit"]) == 40), folder


def test_tables_rewrites_a_folders_tables_from_its_comparisons_and_their_manifest_lines(tmp_path, capsys):
    reference = tmp_path / "gemma"
    shutil.copytree(GPU / "gemma", reference)
    csv = reference / "tables" / "headline.csv"
    csv.write_text("# stale\nconfig\nx\n")
    assert main(["tables", str(reference)]) == 0
    assert "3 tables rewritten" in capsys.readouterr().out
    manifest = read_manifest(reference / "MANIFEST.sha256")
    for name in ("headline.csv", "headline.md", "headline.tex"):
        assert manifest[f"tables/{name}"] == hashlib.sha256((reference / "tables" / name).read_bytes()).hexdigest()
    assert len(manifest) == len(read_manifest(GPU / "gemma" / "MANIFEST.sha256"))
    assert csv.read_bytes() == (GPU / "gemma" / "tables" / "headline.csv").read_bytes()  # the committed ones


def test_float_drift_counts_a_zero_computed_as_1e_17_as_drift_but_not_a_changed_small_value(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"coef": 0.0, "t": 2.5, "p": 1e-6}))
    (tmp_path / "b.json").write_text(json.dumps({"coef": 9.4e-17, "t": 2.5000000000000004, "p": 1e-6}))
    (tmp_path / "c.json").write_text(json.dumps({"coef": 0.0, "t": 2.5, "p": 2e-6}))
    assert float_drift(tmp_path / "a.json", tmp_path / "b.json") < 1e-9
    assert float_drift(tmp_path / "a.json", tmp_path / "c.json") > DRIFT_TOLERANCE


def test_an_ill_conditioned_fits_drift_on_another_cpu_passes_and_a_changed_number_does_not(tmp_path):
    """The p of reference/gpu-vllm/ladder/smollm2's near-separated logit as committed and as an AVX2 EPYC rebuilt it
    (2.7e-9 apart), and a change far smaller than any real one (one part in a million)."""
    p = 0.0008614244884820272
    (tmp_path / "a.json").write_text(json.dumps({"p": p}))
    (tmp_path / "b.json").write_text(json.dumps({"p": 0.0008614244907805297}))
    (tmp_path / "c.json").write_text(json.dumps({"p": p * (1 + 1e-6)}))
    assert 1e-9 < float_drift(tmp_path / "a.json", tmp_path / "b.json") <= DRIFT_TOLERANCE
    assert float_drift(tmp_path / "a.json", tmp_path / "c.json") > DRIFT_TOLERANCE


@pytest.mark.parametrize(
    "folder",
    sorted(
        p.parent.relative_to(GPU.parent).as_posix()
        for engine in ("gpu-vllm", "gpu-sglang")
        for record in ("provenance.json", "partial.json")
        for p in (GPU.parent / engine).glob(f"**/{record}")
    ),
)
def test_every_serving_engine_reference_rebuilds_from_its_credit_tables(folder, tmp_path, capsys):
    """The paper-regime vLLM and SGLang references: statistics, pooling, tables and figures recomputed on this CPU
    from the committed credit tables agree with the committed files (bitwise, or within float drift)."""
    assert main(["rebuild", str(GPU.parent / folder), str(tmp_path / "rebuilt")]) == 0, capsys.readouterr().out


POOLED = sorted((GPU.parent).glob("**/analysis/pooled/comparison.json"))


@pytest.mark.parametrize("pooled", POOLED, ids=lambda p: p.parents[2].relative_to(GPU.parent).as_posix())
def test_no_committed_pooled_row_mixes_engines_or_kernels(pooled):
    """Every committed pooled analysis either pools configurations of one engine and one kernel mode, or says
    it pooled none and gives no numbers (an audit found HF, stock and invariant pooled together)."""
    folder = pooled.parents[2]
    result = json.loads(pooled.read_text())
    settings = json.loads((folder / "provenance.json").read_text())["config"]["configs"]
    modes = {(settings[c]["engine"], settings[c]["kernels"]) for c in result["configs"]}
    if len(modes) > 1:
        assert "not_pooled" in result
        assert all(not block["available"] for block in result["conditionings"].values())
        rows = [r.split(",") for r in (folder / "tables" / "headline.csv").read_text().splitlines()]
        assert all(r[3] == "n/a" for r in rows if r[0] == "pooled")  # n: no pooled row has a number


# ------------------------------------------------------------------------------- commands that write trees


def test_a_snapshot_never_deletes_or_writes_into_its_source_the_current_folder_or_a_folder_holding_either(
    tmp_path, monkeypatch, capsys
):
    """``snapshot results results`` once printed "0 files copied" and deleted all 91 results; ``snapshot results .``
    from a run's folder deleted the folder (a user's notes too). Each is refused by name, and nothing is touched."""
    run = tmp_path / "run"
    results = fake_results(run / "results")
    (run / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    monkeypatch.chdir(run)
    for dest in ("results", ".", str(run), str(tmp_path), "results/ref"):
        assert main(["snapshot", "results", dest]) == 2, dest
        assert "snapshot would write" in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before
    # a folder of a user's that is no earlier snapshot is refused too, however named
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("x")
    assert main(["snapshot", str(results), str(tmp_path / "mine")]) == 2
    assert "not empty and not an earlier snapshot" in capsys.readouterr().err
    assert (tmp_path / "mine" / "thesis.tex").read_text() == "x"


def test_a_rebuild_never_writes_into_the_reference_the_current_folder_or_a_folder_holding_either(
    tmp_path, monkeypatch, capsys
):
    reference = tmp_path / "refs" / "gemma"
    shutil.copytree(GPU / "gemma", reference)
    monkeypatch.chdir(tmp_path)
    for out in (str(reference), str(reference / "x"), str(tmp_path / "refs"), ".", str(tmp_path.parent)):
        assert main(["rebuild", str(reference), out]) == 2, out
        assert "rebuild would write" in capsys.readouterr().err


def test_a_snapshot_holds_exactly_what_its_manifest_lists_and_keeps_the_files_beside_it(tmp_path):
    """Outputs of settings a run no longer has (a removed configuration's analysis, a floors table) stay in
    results/ but are in no manifest: a snapshot leaves them out, and a second snapshot into the same folder
    replaces what the first made while a README written beside it stays."""
    results = fake_results(tmp_path / "results")
    write(results / "analysis" / "removed" / "comparison.json", "{}")
    write(results / "tables" / "floors.md", "stale")
    ref = tmp_path / "ref"
    copied = {p.relative_to(ref).as_posix() for p in snapshot(results, ref)}
    assert copied == {"MANIFEST.sha256", "provenance.json", "tables/headline.csv", "analysis/c/comparison.json"}
    assert not (ref / "tables" / "floors.md").exists() and not (ref / "analysis" / "removed").exists()
    (ref / "README.md").write_text("what this run is")
    (ref / "tables" / "old.md").write_text("from an earlier run")
    snapshot(fake_results(tmp_path / "results2", headline="config,excess_pp\na,1.0\n"), ref)
    assert (ref / "README.md").read_text() == "what this run is"
    assert not (ref / "tables" / "old.md").exists()
    assert (ref / "tables" / "headline.csv").read_text() == "config,excess_pp\na,1.0\n"


def test_compare_and_rebuild_check_each_folder_against_its_own_manifest_first(tmp_path, capsys):
    """An edited committed table passed both: compare read only the manifests ("42 of 42 reference files
    identical"), rebuild only its rebuilt files (gemma's headline.md edited, 475 -> 575, exited 0)."""
    reference = tmp_path / "gemma"
    shutil.copytree(GPU / "gemma", reference)
    md = reference / "tables" / "headline.md"
    md.write_text(md.read_text().replace("475", "575"))
    assert main(["rebuild", str(reference), str(tmp_path / "out")]) == 1
    assert f"edited: {md} differs from its manifest" in capsys.readouterr().out
    rerun = tmp_path / "rerun"
    shutil.copytree(GPU / "gemma", rerun)
    assert main(["compare", str(reference), str(rerun)]) == 1
    out = capsys.readouterr().out
    assert "edited:" in out and "tables/headline.md" in out and "identical" not in out


@pytest.mark.parametrize("line", ["not a manifest line", f"{'a' * 64}  ok\u2028x", f"{'a' * 63}  short"])
def test_a_malformed_manifest_is_named_by_file_and_line_never_a_crash(tmp_path, line):
    """Manifests are read as sha256sum -c reads them: lines end at "\\n" alone (U+2028 is no line break), and a
    bad line is named, by the reviewer's check and by verify alike."""
    manifest = tmp_path / "MANIFEST.sha256"
    manifest.write_text(f"{'b' * 64}  first\n{line}\n")
    if "\u2028" in line:  # a path with U+2028 is one path to sha256sum: read so, and missing here
        assert read_manifest(manifest) == {"first": "b" * 64, "ok\u2028x": "a" * 64}
        return
    with pytest.raises(ValueError, match="MANIFEST.sha256:2: not a sha256sum line"):
        read_manifest(manifest)
    assert (
        verify_manifest(tmp_path, manifest)[0].startswith("MALFORMED")
        and "MANIFEST.sha256:2" in verify_manifest(tmp_path, manifest)[0]
    )


def test_a_snapshot_rebuilds_and_the_prefix_mismatch_link_is_recomputed_from_its_table(tiny_run, tmp_path, capsys):
    """A snapshot keeps every file its statistics are computed from (the credit tables and the per-pivot prefix
    mismatch, both in the manifest), so a rebuild recomputes the mismatch's link to the flips instead of copying it:
    a hand-edited prefix_mismatch block is caught even with its manifest line rewritten."""
    ref = tmp_path / "ref"
    copied = {p.relative_to(ref).as_posix() for p in snapshot(tiny_run / "results", ref)}
    assert {"analysis/tiny/mismatch.parquet", "credit/tiny/exact.parquet", "credit/tiny/selector.parquet"} <= copied
    assert main(["rebuild", str(ref), str(tmp_path / "rebuilt")]) == 0, capsys.readouterr().out
    capsys.readouterr()
    comparison = ref / "analysis" / "tiny" / "comparison.json"
    record = json.loads(comparison.read_text())
    record["prefix_mismatch"]["sentence"] = "an edited sentence"
    comparison.write_text(json.dumps(record))
    lines = [line for line in (ref / "MANIFEST.sha256").read_text().split("\n") if line]
    digest = hashlib.sha256(comparison.read_bytes()).hexdigest()
    (ref / "MANIFEST.sha256").write_text(
        "".join(
            (f"{digest}  analysis/tiny/comparison.json" if line.endswith("  analysis/tiny/comparison.json") else line)
            + "\n"
            for line in lines
        )
    )
    assert main(["rebuild", str(ref), str(tmp_path / "rebuilt2")]) == 1
    assert "differs: analysis/tiny/comparison.json" in capsys.readouterr().out


def test_power_planning_reads_a_pilot_s_components_and_refuses_a_pilot_of_one_draw(tmp_path, capsys):
    credit = coverage.simulate_credit(np.random.default_rng(3), pass_sd=0.4, **coverage.DESIGN)
    settings = analysis_settings(n_boot=100, seed=1, min_eligible=10)
    write_json(
        {**compare_passes(credit, settings), "config": "three"}, tmp_path / "analysis" / "three" / "comparison.json"
    )
    write_json(
        {**compare_passes({p: credit[p] for p in ("exact", "replica", "refeed")}, settings), "config": "one"},
        tmp_path / "analysis" / "one" / "comparison.json",
    )
    vouched(tmp_path)
    assert power_main([str(tmp_path), "--excess", "5", "40"]) == 0
    captured = capsys.readouterr()
    assert "skipped: one: main: no replicated passes" in captured.err
    lines = [line.strip() for line in captured.out.splitlines()]
    rows = [re.split(r"\s{2,}", line) for line in lines if line.startswith(("+5.0", "+40.0"))]
    five, forty = rows
    assert float(forty[-2]) > float(five[-2])  # power at the pilot's size grows with the excess
    for row in rows:  # over the pass-SD interval: the estimate's power in the middle, the bound's the lowest
        low, mid, high = (float(x) for x in row[-1].split(" at ")[0].split(" / "))
        assert mid == float(row[-2]) and high <= mid <= low
    assert power_main([str(tmp_path), "--config", "one"]) == 2


LADDER = GPU.parent / "gpu-vllm" / "ladder"


def test_a_partial_folder_keeps_columns_the_passes_write():
    """``ROW_COLUMNS`` names pass columns by hand and ``partial`` keeps those a pass file has: a column renamed in
    the pass schema would otherwise drop out of every partial folder unseen."""
    assert set(ROW_COLUMNS) <= set(PASS_SCHEMA)
    assert {"verified", "cached_tokens", "expected_cached_tokens", "next_digest"} <= set(ROW_COLUMNS)


def test_a_run_cut_short_keeps_its_whole_pairs_of_draws_and_agrees_with_the_finished_run(tmp_path, capsys):
    """A lease that ends after exact, replica, refeed and replica_r2 (as the ladder's first 1.5B lease did): cut
    the committed 1.5B rung's credit tables there, and ``partial`` compares exact with the one whole pair
    (replica_r2's partner, refeed_replica, never ran) and gets the finished run's first pair to the bit; its folder
    rebuilds."""
    full, name = LADDER / "qwen-1.5b", "qwen2.5-coder-1.5b-vllm"
    results = tmp_path / "results"
    (results / "credit" / name).mkdir(parents=True)
    for done in ("exact", "replica", "refeed", "replica_r2"):
        shutil.copy(full / "credit" / name / f"{done}.parquet", results / "credit" / name)
    rows = pl.DataFrame({"pivot_id": ["p0"], "cached_tokens": [7], "token_ids": [[1, 2]]})
    gathered = results / "passes" / name / "exact.parquet"
    gathered.parent.mkdir(parents=True)
    rows.write_parquet(gathered)
    campaign = tmp_path / "qwen-1.5b.yaml"
    campaign.write_text(json.dumps(json.loads((full / "provenance.json").read_text())["config"]))
    out = tmp_path / "kept"
    assert main(["partial", str(results), str(campaign), str(out)]) == 0
    record = json.loads((out / "partial.json").read_text())
    assert record["passes_run"] == ["exact", "replica", "replica_r2", "refeed"]
    assert record["passes_compared"] == ["exact", "replica", "refeed"]
    kept_rows = pl.read_parquet(out / "rows" / name / "exact.parquet")  # the kept columns alone, checksummed
    assert kept_rows.columns == ["pivot_id", "cached_tokens"] and kept_rows["cached_tokens"].to_list() == [7]
    assert f"rows/{name}/exact.parquet" in (out / "MANIFEST.sha256").read_text()
    kept, finished = (
        json.loads((folder / "analysis" / name / "comparison.json").read_text())["conditionings"]["main"]
        for folder in (out, full)
    )
    assert kept.get("replicated") is None  # one pair of draws: no interval over draws
    assert kept["by_metric"]["sign"]["excess_pp"] == finished["replicated"]["pairs"][0]
    assert kept["per_problem_t"] == finished["per_problem_t"]  # the finished run's unreplicated block: its first pair
    assert main(["rebuild", str(out), str(tmp_path / "again")]) == 0, capsys.readouterr().out


def test_a_partial_folder_counts_the_exact_pivots_verified_and_each_pass_s_cache_reads_from_its_kept_rows(tmp_path):
    """As a finished run's compare step does: ``verification`` from exact's credit table, ``prefix_cache`` from the
    kept rows of every pass that ran (an unpaired draw's too); rows without the cache columns give no count."""
    full, name = LADDER / "qwen-1.5b", "qwen2.5-coder-1.5b-vllm"
    results = tmp_path / "results"
    (results / "credit" / name).mkdir(parents=True)
    (results / "passes" / name).mkdir(parents=True)
    cache = {"prefix_source": "decode_kv", "prefix_len": 9, "cached_tokens": 8, "expected_cached_tokens": 8}
    for done in ("exact", "replica", "refeed", "replica_r2"):
        shutil.copy(full / "credit" / name / f"{done}.parquet", results / "credit" / name)
        short = {**cache, "cached_tokens": 3} if done == "replica_r2" else cache  # one row short of the state
        rows = pl.DataFrame(
            [{"pivot_id": "p0", **cache, "tail_tokens": 0}, {"pivot_id": "p1", **short, "tail_tokens": 0}]
        )
        rows.write_parquet(results / "passes" / name / f"{done}.parquet")
    campaign = tmp_path / "qwen-1.5b.yaml"
    campaign.write_text(json.dumps(json.loads((full / "provenance.json").read_text())["config"]))
    partial(results, campaign, tmp_path / "kept")
    result = json.loads((tmp_path / "kept" / "analysis" / name / "comparison.json").read_text())
    exact = pl.read_parquet(full / "credit" / name / "exact.parquet")
    assert result["verification"] == {
        "pivots": exact.height,
        "verified": int(exact["verified"].sum()),
        "rate": exact["verified"].mean(),
    }
    counted = {p: (c["rows_with_expectation"], c["rows_hit_as_expected"]) for p, c in result["prefix_cache"].items()}
    assert counted == {"exact": (2, 2), "replica": (2, 2), "refeed": (2, 2), "replica_r2": (2, 1)}
    for done in ("exact", "replica", "refeed", "replica_r2"):  # rows without the cache columns: no count
        pl.DataFrame({"pivot_id": ["p0"]}).write_parquet(results / "passes" / name / f"{done}.parquet")
    partial(results, campaign, tmp_path / "bare")
    assert "prefix_cache" not in json.loads((tmp_path / "bare" / "analysis" / name / "comparison.json").read_text())


def test_a_partial_folder_is_refused_where_exact_verified_too_few_pivots_as_the_compare_step_is(tmp_path):
    """``analysis.min_verified`` holds for a cut-short run as for a finished one: with half of exact's pivots
    unverified, ``partial`` names the share and the key and writes nothing; the campaign's key lowered, it keeps the
    folder, and that folder rebuilds."""
    full, name = LADDER / "qwen-1.5b", "qwen2.5-coder-1.5b-vllm"
    results = tmp_path / "results"
    (results / "credit" / name).mkdir(parents=True)
    for done in ("replica", "refeed"):
        shutil.copy(full / "credit" / name / f"{done}.parquet", results / "credit" / name)
    exact = pl.read_parquet(full / "credit" / name / "exact.parquet")
    half = pl.int_range(pl.len()) % 2 == 0
    exact.with_columns(verified=pl.col("verified") & half).write_parquet(results / "credit" / name / "exact.parquet")
    config = json.loads((full / "provenance.json").read_text())["config"]
    campaign = tmp_path / "qwen-1.5b.yaml"
    campaign.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"for \d+ of 1105 pivots \(\d+\.\d+%\), below analysis.min_verified 0.99"):
        partial(results, campaign, tmp_path / "kept")
    assert not (tmp_path / "kept").exists()
    campaign.write_text(json.dumps({**config, "analysis": {**config["analysis"], "min_verified": 0.4}}))
    partial(results, campaign, tmp_path / "kept")
    verification = json.loads((tmp_path / "kept" / "analysis" / name / "comparison.json").read_text())["verification"]
    assert 0.4 <= verification["rate"] < 0.99
    assert main(["rebuild", str(tmp_path / "kept"), str(tmp_path / "again")]) == 0


def test_the_lease_s_packing_of_a_cut_short_run_keeps_its_folder_the_rows_kept_columns_and_a_clean_log(tmp_path):
    """benchmarks/h200-partial.sh, as a lease runs it on a campaign's working directory: the partial folder, each
    pass's rows with only the columns reference/ keeps, and the Snakemake log without its progress bars."""
    full, name = LADDER / "qwen-1.5b", "qwen2.5-coder-1.5b-vllm"
    work = tmp_path / "work"
    (work / "results" / "credit" / name).mkdir(parents=True)
    (work / "results" / "passes" / name).mkdir(parents=True)
    for done in ("exact", "replica", "refeed"):
        shutil.copy(full / "credit" / name / f"{done}.parquet", work / "results" / "credit" / name)
        rows = pl.DataFrame({"pivot_id": ["p0", "p1"], "verified": [True, False], "tokens": [[1, 2], [3]]})
        rows.write_parquet(work / "results" / "passes" / name / f"{done}.parquet")
    (work / "snakemake.log").write_text("localrule replay_exact:\rCapturing batches 3/36\r 50%| 1/2 [00:01, 1.0it/s]\n")
    campaign = tmp_path / "qwen-1.5b.yaml"
    campaign.write_text(json.dumps(json.loads((full / "provenance.json").read_text())["config"]))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    script = REPO / "benchmarks" / "h200-partial.sh"
    packed_file = tmp_path / "out" / "kept.tgz"
    done = subprocess.run(["bash", str(script), str(work), str(campaign), str(packed_file), "cut"], env=env)
    assert done.returncode == 0
    with tarfile.open(packed_file) as packed:
        packed.extractall(tmp_path / "unpacked", filter="data")
    unpacked = tmp_path / "unpacked"
    assert json.loads((unpacked / "reference" / "partial.json").read_text())["note"] == "cut"
    kept = pl.read_parquet(unpacked / "reference" / "rows" / name / "refeed.parquet")
    assert kept.columns == ["pivot_id", "verified"] and kept["verified"].to_list() == [True, False]
    assert (unpacked / "snakemake.log").read_text() == "localrule replay_exact:\n"
    (work / "results" / "credit" / name / "refeed.parquet").unlink()  # no whole pair: nothing packed, an error
    again = subprocess.run(["bash", str(script), str(work), str(campaign), str(tmp_path / "no.tgz")], env=env)
    assert again.returncode != 0 and not (tmp_path / "no.tgz").exists()


def test_whole_pairs_leave_out_a_draw_without_its_partner_and_need_exact():
    assert whole_pairs(["exact", "replica", "refeed", "replica_r2"]) == ["exact", "replica", "refeed"]
    both = ["exact", "replica", "replica_r2", "refeed", "refeed_replica"]
    assert whole_pairs(both) == ["exact", "replica", "refeed", "replica_r2", "refeed_replica"]
    with pytest.raises(ValueError, match="no exact pass"):
        whole_pairs(["replica", "refeed"])


#: committed contrasts of two folders' excesses: the file, then the two folders, as its command names them
CONTRASTS = {
    "reference/gpu-sglang/sglang-vs-vllm-0.5b.md": (
        "reference/gpu-sglang/qwen-0.5b-vllm-problems",
        "reference/gpu-vllm/ladder/qwen-0.5b",
    ),
    "reference/gpu-sglang/sglang-vs-vllm-1.5b.md": (
        "reference/gpu-sglang/qwen-1.5b-vllm-problems",
        "reference/gpu-vllm/ladder/qwen-1.5b",
    ),
}


@pytest.mark.parametrize("name", sorted(CONTRASTS))
def test_a_committed_contrast_is_what_its_command_writes_from_the_two_folders(name, tmp_path, monkeypatch):
    monkeypatch.chdir(GPU.parents[1])
    out = tmp_path / "contrast.md"
    assert main(["contrast", str(out), *CONTRASTS[name]]) == 0
    assert out.read_text() == (GPU.parents[1] / name).read_text()


def test_a_contrast_refuses_a_folder_of_one_draw_per_pass_and_one_of_several_configurations(tmp_path, capsys):
    replicated = GPU.parent / "gpu-vllm" / "ladder" / "qwen-0.5b"
    one_draw = GPU.parent / "gpu-vllm" / "ladder" / "qwen-invariant"
    assert main(["contrast", str(tmp_path / "a.md"), str(replicated), str(one_draw)]) != 0
    assert "one draw per pass" in capsys.readouterr().err and not (tmp_path / "a.md").exists()
    several = tmp_path / "several"
    for config in ("x", "y"):
        shutil.copytree(replicated / "analysis" / "qwen2.5-coder-0.5b-vllm", several / "analysis" / config)
        comparison = several / "analysis" / config / "comparison.json"
        comparison.write_text(json.dumps({**json.loads(comparison.read_text()), "config": config}))
    vouched(several)
    assert main(["contrast", str(tmp_path / "b.md"), str(several), str(replicated)]) != 0
    assert "x, y" in capsys.readouterr().err


def test_a_contrast_notes_why_a_cell_has_no_interval_and_refuses_an_unavailable_comparison(tmp_path, capsys):
    """A folder whose pairs had too few eligible pivots (the comparison nulls its numbers and says why): the
    contrast keeps its row, says n/a and writes the run's note; one whose pairs could not be compared is refused
    with the comparison's reason."""
    replicated = GPU.parent / "gpu-vllm" / "ladder" / "qwen-0.5b"
    name = "qwen2.5-coder-0.5b-vllm"
    comparison = json.loads((replicated / "analysis" / name / "comparison.json").read_text())
    block = comparison["conditionings"]["main"]["replicated"]
    comparison["conditionings"]["main"]["replicated"] = {
        **_null_numbers(block),
        "note": "too few eligible pivots in a pair's set (n=3 < min_eligible=30)",
    }
    thin = tmp_path / "thin"
    write(thin / "analysis" / name / "comparison.json", json.dumps(comparison))
    vouched(thin)
    assert main(["contrast", str(tmp_path / "c.md"), str(thin), str(replicated)]) == 0
    text = (tmp_path / "c.md").read_text()
    assert "| main | n/a (3, None) |" in text and "- main: too few eligible pivots" in text
    assert "no crossed interval in the first run's" in text
    comparison["conditionings"]["main"]["replicated"] = {"available": False, "reason": "no refeed_replica column"}
    write(thin / "analysis" / name / "comparison.json", json.dumps(comparison))
    vouched(thin)
    assert main(["contrast", str(tmp_path / "d.md"), str(thin), str(replicated)]) == 2
    assert "no replicated comparison (no refeed_replica column)" in capsys.readouterr().err
