"""Committed reference results: the snapshot keeps the small outputs, the check names every difference."""

from __future__ import annotations

import hashlib

import pytest

from replaynoise.reference import compare, main, read_manifest, snapshot


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return hashlib.sha256(text.encode()).hexdigest()


def fake_results(root, headline="config,excess_pp\na,7.5\nb,3.0\n"):
    files = {"tables/headline.csv": headline, "rollouts/c/kv/000/p1.safetensors": "kv bytes",
             "analysis/c/comparison.json": "{}", "passes/c/exact.parquet": "rows"}
    lines = [f"{write(root / path, text)}  {path}" for path, text in sorted(files.items())]
    (root / "MANIFEST.sha256").write_text("\n".join(lines) + "\n")
    write(root / "provenance.json", "{}")
    return root


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
    snapshot(fake_results(tmp_path / "results"), tmp_path / "ref")
    rerun = fake_results(tmp_path / "rerun", headline="config,excess_pp\na,7.5\nb,4.25\n")
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
