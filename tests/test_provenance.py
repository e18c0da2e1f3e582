"""Atomic writes, byte-stable parquet, the sha256sum manifest, checksums, hashing and the provenance record."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from replaynoise import provenance
from replaynoise.config import DEFAULT_CONFIG_PATH, analysis_hash, validate_config
from replaynoise.io import (
    ChecksumError,
    atomic_path,
    check_sha256,
    sha256_file,
    stable_hash,
    write_json,
    write_parquet,
    write_text,
)
from replaynoise.provenance import manifest_files, provenance_record, verify_manifest, write_manifest


class Boom(RuntimeError):
    pass


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- atomic_path ----------------------------------------------------------------------------------------------


def test_atomic_path_failure_leaves_no_target_and_no_temp(tmp_path):
    target = tmp_path / "sub" / "out.txt"
    seen = {}
    with pytest.raises(Boom), atomic_path(target) as tmp:
        seen["tmp"] = tmp
        assert tmp.parent == target.parent and tmp != target
        tmp.write_text("half-written")
        raise Boom
    assert not target.exists()
    assert not seen["tmp"].exists()
    assert list(target.parent.iterdir()) == []


def test_atomic_path_failure_keeps_existing_target(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(Boom), atomic_path(target) as tmp:
        tmp.write_text("new")
        raise Boom
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_path_success_replaces_existing_target(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with atomic_path(target) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old"  # nothing visible until the block ends
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_rewriting_a_target_removes_what_a_killed_writer_left(tmp_path):
    target = tmp_path / "out.txt"
    script = (
        "import sys, time\n"
        "from replaynoise.io import atomic_path\n"
        f"with atomic_path({str(target)!r}) as tmp:\n"
        "    tmp.write_text('half')\n"
        "    print(tmp, flush=True)\n"
        "    time.sleep(60)\n"
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1]
    )
    orphan = Path(writer.stdout.readline().strip())
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert orphan.exists() and not target.exists()  # SIGKILL skipped the clean-up
    unrelated = [tmp_path / ".other.txt.abcdefgh.tmp", tmp_path / ".out.txt.my-notes.tmp"]
    for path in unrelated:
        path.write_text("keep")
    with atomic_path(target) as tmp:
        tmp.write_text("whole")
    assert target.read_text() == "whole"
    assert not orphan.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out.txt", *(p.name for p in unrelated)])


@pytest.mark.parametrize("writer", ["text", "json", "parquet"])
def test_written_files_respect_umask_not_0600(tmp_path, writer):
    target = tmp_path / f"out.{writer}"
    if writer == "text":
        write_text("hello\n", target)
    elif writer == "json":
        write_json({"b": 1, "a": [1, 2]}, target)
    else:
        write_parquet(pl.DataFrame({"x": [1, 2]}), target)
    mode = stat.S_IMODE(target.stat().st_mode)
    assert mode == 0o666 & ~current_umask()
    assert mode != 0o600


def test_write_json_is_sorted_and_newline_terminated(tmp_path):
    target = tmp_path / "out.json"
    write_json({"b": 1, "a": {"d": 2, "c": 3}}, target)
    text = target.read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == {"a": {"c": 3, "d": 2}, "b": 1}
    assert text.index('"a"') < text.index('"b"') and text.index('"c"') < text.index('"d"')


# --- write_parquet --------------------------------------------------------------------------------------------


def frame(values: list[float]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "pivot_id": [f"p@{i}" for i in range(len(values))],
            "value": values,
            "ids": [[i, i + 1] for i in range(len(values))],
        }
    )


def test_write_parquet_equal_frames_give_identical_bytes(tmp_path):
    a, b, c = tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "c.parquet"
    write_parquet(frame([0.5, 0.25, 1.0]), a)
    write_parquet(frame([0.5, 0.25, 1.0]), b)
    write_parquet(frame([0.5, 0.25, 2.0]), c)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    assert pl.read_parquet(a).equals(frame([0.5, 0.25, 1.0]))


# --- manifest -------------------------------------------------------------------------------------------------


@pytest.fixture
def results(tmp_path) -> Path:
    root = tmp_path / "results"
    (root / "credit" / "cfg").mkdir(parents=True)
    (root / "credit" / "cfg" / "exact.parquet").write_bytes(b"exact-bytes")
    (root / "credit" / "cfg" / "refeed.parquet").write_bytes(b"refeed-bytes")
    (root / "credit" / ".hidden").write_text("skipped")
    (root / "tables").mkdir()
    (root / "tables" / "headline.csv").write_text("a,b\n1,2\n")
    (root / "tables" / "not-listed.md").write_text("not in the manifest")
    return root


def test_write_manifest_is_sha256sum_compatible(results):
    manifest = results / "MANIFEST.sha256"
    count = write_manifest([results / "credit", results / "tables" / "headline.csv"], results, manifest)
    lines = manifest.read_text().splitlines()
    assert count == len(lines) == 3
    rels = [line.split("  ", 1)[1] for line in lines]
    assert rels == ["credit/cfg/exact.parquet", "credit/cfg/refeed.parquet", "tables/headline.csv"]
    for line, rel in zip(lines, rels):
        assert re.fullmatch(r"[0-9a-f]{64}  \S+", line)
        assert line.split("  ")[0] == hashlib.sha256((results / rel).read_bytes()).hexdigest()
    if shutil.which("sha256sum") is None:
        pytest.skip("sha256sum not installed")
    check = subprocess.run(["sha256sum", "-c", "MANIFEST.sha256"], cwd=results, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.count(": OK") == 3


def test_verify_manifest_reports_missing_and_differing_files(results):
    manifest = results / "MANIFEST.sha256"
    write_manifest([results / "credit", results / "tables"], results, manifest)
    assert verify_manifest(results, manifest) == []
    (results / "credit" / "cfg" / "exact.parquet").unlink()
    (results / "tables" / "headline.csv").write_text("a,b\n1,3\n")
    assert verify_manifest(results, manifest) == ["MISSING credit/cfg/exact.parquet", "DIFFERS tables/headline.csv"]
    if shutil.which("sha256sum"):
        check = subprocess.run(["sha256sum", "-c", "MANIFEST.sha256"], cwd=results, capture_output=True)
        assert check.returncode != 0


def test_manifest_files_dedupes_and_refuses_missing_inputs(results):
    listed = manifest_files([results / "tables", results / "tables" / "headline.csv", results / "tables"])
    assert listed == [results / "tables" / "headline.csv", results / "tables" / "not-listed.md"]
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        manifest_files([results / "nothing-here"])


# --- checksums and hashing ------------------------------------------------------------------------------------


def test_verify_inputs_reports_an_edited_or_missing_user_file(tmp_path):
    data, model = tmp_path / "data.jsonl", tmp_path / "model.safetensors"
    data.write_text('{"question": "1+1?", "answer": "2"}\n')
    model.write_bytes(b"weights")
    record = tmp_path / "provenance.json"
    record.write_text(json.dumps({"inputs": provenance.input_checksums([str(model), str(data)])}))
    assert provenance.verify_inputs(record) == []
    data.write_text('{"question": "1+2?", "answer": "3"}\n')
    model.unlink()
    assert provenance.verify_inputs(record) == [
        f"DIFFERS input {data} (the results were made from another version of it)",
        f"MISSING input {model}",
    ]


def test_check_sha256(tmp_path):
    path = tmp_path / "pinned.bin"
    path.write_bytes(b"\x00pinned\xff" * 1000)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sha256_file(path) == digest
    assert sha256_file(path, chunk=7) == digest  # chunked reads give the same digest
    check_sha256(path, digest)  # no exception
    wrong = "0" * 64
    with pytest.raises(ChecksumError) as info:
        check_sha256(path, wrong)
    assert str(path) in str(info.value)
    assert wrong in str(info.value) and digest in str(info.value)


def test_stable_hash_is_key_order_independent():
    a = {"seed": 1, "replay": {"k": 4, "passes": ["exact", "refeed"]}, "x": None}
    b = {"x": None, "replay": {"passes": ["exact", "refeed"], "k": 4}, "seed": 1}
    assert stable_hash(a) == stable_hash(b)
    assert re.fullmatch(r"[0-9a-f]{16}", stable_hash(a))
    assert stable_hash(a) != stable_hash({**a, "seed": 2})
    # List order is meaningful, unlike key order.
    assert stable_hash(a) != stable_hash({**a, "replay": {"k": 4, "passes": ["refeed", "exact"]}})


# --- provenance record ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix,mode",
    [("", "pip"), ("/opt/conda/envs/work", "conda"), ("/repo/.snakemake/conda/abc123", "snakemake-conda")],
)
def test_install_mode(monkeypatch, prefix, mode):
    monkeypatch.setenv("CONDA_PREFIX", prefix)
    assert provenance.install_mode() == mode


def test_cpu_description_names_the_model_and_the_kernel_features(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu sse2 avx2 fma avx512f "
        "avx512_bf16 sha_ni\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9654\nflags\t\t: fpu\n"
    )
    assert provenance.cpu_description(cpuinfo) == {
        "cpu_model": "AMD EPYC 9654",
        "cpu_features": ["avx2", "fma", "avx512f", "avx512_bf16"],
    }
    missing = provenance.cpu_description(tmp_path / "absent")
    assert missing["cpu_features"] is None


def test_hardware_records_the_cpu_that_picks_the_kernels():
    info = provenance.hardware()
    assert {"cpu_model", "cpu_features", "torch_cpu_capability"} <= info.keys()
    if Path("/proc/cpuinfo").is_file():
        assert info["cpu_model"] and set(info["cpu_features"]) <= set(provenance.KERNEL_FEATURES)


def test_gpu_hardware_records_the_driver_and_cuda_runtime(monkeypatch, tmp_path):
    """On a GPU the driver and the CUDA runtime pick the kernels as the CPU features do on a CPU."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 580.159.04\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    info = provenance.hardware()
    assert info["cuda"] == ["NVIDIA H200"] and info["cuda_driver"] == "580.159.04"
    assert info["cuda_runtime"] == torch.version.cuda
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi anywhere: not read, not guessed
    assert provenance.hardware()["cuda_driver"] is None


def test_git_commit_outside_a_repository(tmp_path):
    assert provenance.git_commit(tmp_path) == {"commit": None, "dirty": None}


@pytest.fixture
def git_repo(tmp_path) -> tuple[Path, str]:
    """A throwaway repository with one commit (the project's own .git is left alone)."""
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.txt").write_text("one\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", "a.txt"], ["commit", "-q", "-m", "init"]):
        subprocess.run([*git, *args], cwd=repo, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True, text=True)
    return repo, head.stdout.strip()


def test_git_commit_clean_and_dirty(git_repo):
    repo, head = git_repo
    assert provenance.git_commit(repo) == {"commit": head, "dirty": False}
    (repo / "a.txt").write_text("two\n")
    assert provenance.git_commit(repo) == {"commit": head, "dirty": True}


def test_git_commit_never_writes_the_user_s_index(git_repo):
    """A file rewritten with its own content leaves stale stat data in the index, which a plain ``git status``
    refreshes by rewriting the index (under .git/index.lock); provenance must only read."""
    repo, head = git_repo
    index = repo / ".git" / "index"
    before = index.read_bytes()
    os.utime(repo / "a.txt", ns=(1_000_000_000, 1_000_000_000))  # same content, other mtime
    assert provenance.git_commit(repo) == {"commit": head, "dirty": False}
    assert index.read_bytes() == before
    subprocess.run(["git", "status", "--porcelain"], cwd=repo, check=True, capture_output=True)
    assert index.read_bytes() != before  # what the plain command does, so the check above can fail


def test_provenance_record(monkeypatch, git_repo):
    import torch

    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    config = validate_config(yaml.safe_load(DEFAULT_CONFIG_PATH.read_text()))
    config["replay"]["k"] = 8
    fingerprint = analysis_hash(config)
    repo, head = git_repo
    record = provenance_record(config, fingerprint, repo, note="extra field")
    assert {
        "git",
        "analysis_hash",
        "config",
        "deviations_from_committed_defaults",
        "packages",
        "hardware",
        "install_mode",
        "seeds",
    } <= set(record)
    assert record["git"] == {"commit": head, "dirty": False}
    assert record["analysis_hash"] == fingerprint
    assert record["config"] == config
    assert record["deviations_from_committed_defaults"] == [{"key": "replay.k", "value": 8, "default": 4}]
    assert record["seeds"]["root"] == config["seed"]
    assert record["packages"]["torch"] == torch.__version__
    assert record["packages"]["polars"] == pl.__version__
    assert set(record["packages"]) == set(provenance.TRACKED_PACKAGES)
    assert record["hardware"]["python"] and record["hardware"]["cpu_count"] == os.cpu_count()
    assert record["hardware"]["torch_threads"] == torch.get_num_threads()
    assert isinstance(record["hardware"]["cuda"], list)
    assert record["install_mode"] == "pip"
    assert record["note"] == "extra field"
    json.dumps(record)  # provenance.json must be writable without a custom encoder


def test_read_parquet_names_a_truncated_or_missing_file(tmp_path):
    import polars as pl

    from replaynoise.io import UnreadableFileError, read_parquet, write_parquet

    path = tmp_path / "frame.parquet"
    write_parquet(pl.DataFrame({"a": list(range(100))}), path)
    assert read_parquet(path)["a"].sum() == 4950
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(UnreadableFileError, match=rf"{path}: not a readable parquet file"):
        read_parquet(path)
    with pytest.raises(FileNotFoundError, match="missing.parquet: no such file"):
        read_parquet(tmp_path / "missing.parquet")


def test_read_json_names_a_truncated_file(tmp_path):
    from replaynoise.io import UnreadableFileError, read_json, write_json

    path = tmp_path / "x.json"
    write_json({"a": [1, 2]}, path)
    assert read_json(path) == {"a": [1, 2]}
    path.write_text(path.read_text()[:5])
    with pytest.raises(UnreadableFileError, match=rf"{path}: not readable JSON"):
        read_json(path)


def test_the_static_attention_variable_is_checked_by_name_and_recorded(monkeypatch, git_repo):
    from replaynoise.engines.hf.kernels import static_attention
    from replaynoise.engines.hf.settings import INVARIANT_ATTENTION, STATIC_ATTENTION

    config = validate_config(yaml.safe_load(DEFAULT_CONFIG_PATH.read_text()))
    repo, _ = git_repo
    monkeypatch.delenv("REPLAYNOISE_STATIC_ATTENTION", raising=False)
    assert static_attention() == STATIC_ATTENTION == "gemm"
    assert static_attention(invariant=True) == INVARIANT_ATTENTION == "sdpa"
    assert provenance_record(config, "h", repo)["environment"] == {"REPLAYNOISE_STATIC_ATTENTION": None}
    monkeypatch.setenv("REPLAYNOISE_STATIC_ATTENTION", "gemm")
    assert static_attention() == static_attention(invariant=True) == "gemm"
    assert provenance_record(config, "h", repo)["environment"]["REPLAYNOISE_STATIC_ATTENTION"] == "gemm"
    monkeypatch.setenv("REPLAYNOISE_STATIC_ATTENTION", "flash")
    with pytest.raises(ValueError, match="REPLAYNOISE_STATIC_ATTENTION='flash': expected one of"):
        static_attention()
