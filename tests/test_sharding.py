"""Shards split the work into independent jobs and never change a result."""

from __future__ import annotations

import re

import pytest
from helpers import EXACT_PATH, EXACT_PATH_FILES, TINY, clone_run, planned_rules, snakemake

from replaynoise.generation.shards import batch_range, problem_range, shard_count, shard_index, shard_names
from replaynoise.io import read_parquet, sha256_file

#: Manifest paths that name a shard: the layout of the scattered intermediates, which a shard size must change
#: (kv.json is the index of the rollout shards' KV folders, so it lists that layout too).
SHARD_FILE = re.compile(r"^((rollouts/[^/]+/shards/|passes/[^/]+/[^/]+/)\d{3,}\.parquet|rollouts/[^/]+/kv\.json)$")
KV_FILE = re.compile(r"^(rollouts/[^/]+/kv)/\d{3,}/(.+)$")


@pytest.mark.parametrize("n, size, count", [(1, 50, 1), (12, 50, 1), (12, 5, 3), (12, 4, 3), (12, 1, 12)])
def test_problem_shards_cover_every_problem_once_in_order(n, size, count):
    assert shard_count(n, size) == count == len(shard_names(n, size))
    covered = [i for s in range(count) for i in problem_range(s, size, n)]
    assert covered == list(range(n))


@pytest.mark.parametrize("n_batches, n_shards", [(0, 3), (1, 3), (3, 3), (7, 3), (10, 4), (5, 1)])
def test_batch_shards_cover_every_batch_once_in_order(n_batches, n_shards):
    covered = [b for s in range(n_shards) for b in batch_range(s, n_shards, n_batches)]
    assert covered == list(range(n_batches))
    sizes = [len(batch_range(s, n_shards, n_batches)) for s in range(n_shards)]
    assert max(sizes) - min(sizes) <= 1


def test_shard_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="shard_size must be at least 1, got 0"):
        shard_count(10, 0)
    with pytest.raises(ValueError, match="shard 3 starts at problem 30, past the 25 problems"):
        problem_range(3, 10, 25)
    with pytest.raises(ValueError, match="shard 2 is not one of the 2 shards"):
        batch_range(2, 2, 10)
    with pytest.raises(ValueError, match="'x1'"):
        shard_index("x1")
    assert shard_names(25, 10) == ["000", "001", "002"] and shard_index("002") == 2


def results_by_content(results) -> dict[str, str]:
    """The manifest as {path: sha256}, shard files left out and KV files keyed by name, not by shard folder."""
    entries = {}
    for line in (results / "MANIFEST.sha256").read_text().splitlines():
        digest, path = line.split(maxsplit=1)
        if SHARD_FILE.match(path):
            continue
        entries[KV_FILE.sub(r"\1/\2", path)] = digest
    return entries


def test_one_shard_instead_of_two_gives_the_same_pass(tiny_run, tmp_path):
    """The everyday tier's form of the test below: one pass's path, rollouts to credit."""
    work = clone_run(tiny_run, tmp_path / "run")
    one_shard = {**TINY, "resources": {**TINY["resources"], "shard_size": 3}}
    snakemake(work, one_shard, EXACT_PATH)
    for rel in EXACT_PATH_FILES:
        assert sha256_file(work / "results" / rel) == sha256_file(tiny_run / "results" / rel), rel
    one = read_parquet(work / "results" / "passes/tiny/exact/000.parquet")  # the one shard holds every row
    assert one.height == read_parquet(tiny_run / "results" / "passes/tiny/exact.parquet").height > 0
    kv = {p.name: sha256_file(p) for p in (work / "results" / "rollouts/tiny/kv/000").rglob("*.safetensors")}
    before = {p.name: sha256_file(p) for p in (tiny_run / "results" / "rollouts/tiny/kv").rglob("*.safetensors")}
    assert kv and kv == before


@pytest.mark.slow  # the whole workflow again
def test_changing_the_shard_size_changes_no_result(tiny_run, tmp_path):
    """Two shards (the tiny run) and one shard: every gathered table, KV file, figure and table is the same."""
    work = clone_run(tiny_run, tmp_path / "run")
    one_shard = {**TINY, "resources": {**TINY["resources"], "shard_size": 3}}
    rules = planned_rules(work, one_shard)
    assert {"generate_rollouts", "gather_rollouts", "replay_exact", "gather_pass"} <= rules
    assert not rules & {"prepare_model", "sample_problems"}, "a shard size must not redo sampling or the model"
    snakemake(work, one_shard)

    theirs, ours = results_by_content(tiny_run / "results"), results_by_content(work / "results")
    assert ours == theirs
    assert any(path.startswith("rollouts/tiny/kv/") for path in ours), "the comparison covers the KV files"
    listed = (work / "results" / "MANIFEST.sha256").read_text()
    assert "passes/tiny/exact/000.parquet" in listed and "passes/tiny/exact/001.parquet" not in listed
    assert "passes/tiny/exact/001.parquet" in (tiny_run / "results" / "MANIFEST.sha256").read_text()
