"""Shared fixtures: the packaged SmolLM2 model, prepared once per test session (about a minute on 2 cores)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGES = REPO / "resources" / "packages"  # pip-downloaded wheels, shared with the workflow's cache


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Iterator[Path]:
    """SmolLM2-135M-Instruct dequantized to bf16 safetensors, through the same code as the prepare_model rule."""
    from replaynoise.io import sha256_file
    from replaynoise.models import prepare_model

    out = tmp_path_factory.mktemp("models") / "smollm2-135m-bfloat16"
    prepare_model("smollm2-135m", "bfloat16", out, PACKAGES)
    digests = {p.name: sha256_file(p) for p in out.iterdir()}
    yield out
    # Runs and copies hard-link these files (``copy_linking``): a test that wrote into one would change them
    # for every later test, so the session ends with a check that none did.
    changed = [name for name, digest in digests.items() if sha256_file(out / name) != digest]
    assert not changed, f"a test changed the shared model's files in place: {changed}"


# --------------------------------------------------------------------------------------------------------
# The workflow on a tiny configuration, shared by the workflow, interruption and bad-input tests
# --------------------------------------------------------------------------------------------------------

SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile")]

TINY = {
    "seed": 11,
    "dataset": {"source": "simple_addsub", "n_problems": 3},
    "configs": {"tiny": {"model": "smollm2-135m", "dtype": "bfloat16", "max_new_tokens": 24}},
    "rollouts": {"batch_size": 1},  # one problem per batch: the kill tests land between a shard's batches
    "pivots": {"max_margin": 0.3, "per_rollout": 2},
    "replay": {"k": 2, "max_new_tokens": 12, "batch_size": 4, "passes": ["exact", "replica", "refeed", "selector"]},
    "analysis": {"n_boot": 50, "min_eligible": 1},
    "resources": {"shard_size": 2},  # two shards (of about two batches each): every tiny run scatters and gathers
}
MODEL_KEY = "smollm2-135m-bfloat16"


def snakemake_command(workdir: Path, config: dict, *args: str) -> list[str]:
    """The command line for ``config`` (written beside the results) in ``workdir``, the committed config ignored."""
    cfg = workdir / "test-config.yaml"
    cfg.write_text(yaml.safe_dump(config))
    return [*SNAKEMAKE, "--directory", str(workdir), "--cores", "2", "--configfile", str(cfg),
            "--replace-workflow-config", *args]


def snakemake(workdir: Path, config: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(snakemake_command(workdir, config, *args), capture_output=True, text=True, timeout=1500)
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def planned_rules(workdir: Path, config: dict, *targets: str) -> set[str]:
    """The rules a dry run (of ``targets``, or of the default target) would execute."""
    out = snakemake(workdir, config, *targets, "-n", "--quiet", "rules").stdout  # --quiet takes several values
    rules = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("job", "total"):
            rules.add(parts[0])
    return rules


def copy_linking(src: Path, dest: Path, link: Callable[[Path], bool], **copytree_args) -> Path:
    """Copy a tree, hard-linking the files for which ``link(path relative to dest)`` holds (a copy where the file
    system refuses a link). Model weights are linked: no step writes into them (a rebuild replaces the directory
    by a rename, which leaves other links alone), and at about 270 MB a copy they filled CI's disk. Whatever a
    test may change in place must be copied, so the tree it came from stays as it was."""
    def link_or_copy(s: str, d: str) -> None:
        if link(Path(d).relative_to(dest)):
            with contextlib.suppress(OSError):
                os.link(s, d)
                return
        shutil.copy2(s, d)

    shutil.copytree(src, dest, copy_function=link_or_copy, **copytree_args)
    return dest


def seed_model(workdir: Path, smollm2_dir: Path) -> None:
    """Reuse the session's converted model (its conversion is tested by the fixture itself), hard-linked."""
    copy_linking(smollm2_dir, workdir / "results" / "models" / MODEL_KEY, lambda path: True)


def clone_run(run: Path, dest: Path) -> Path:
    """A private copy of a finished run, to change or break; unlocked, its model files hard-linked."""
    copy_linking(run, dest, lambda path: path.parts[:2] == ("results", "models"), symlinks=True)
    shutil.rmtree(dest / ".snakemake" / "locks", ignore_errors=True)
    return dest


@pytest.fixture(scope="session")
def tiny_run(smollm2_dir, tmp_path_factory) -> Path:
    """A finished, uninterrupted run of the tiny configuration: the reference other runs must reproduce.

    Tests that change files in it restore them; tests that need to break things work on a copy.
    """
    workdir = tmp_path_factory.mktemp("workflow")
    seed_model(workdir, smollm2_dir)
    snakemake(workdir, TINY)
    return workdir


def with_setting(config: dict, path: str, value) -> dict:
    """A copy of ``config`` with the key at dotted ``path`` set to ``value`` (its parents made as needed)."""
    config = json.loads(json.dumps(config))
    *parents, last = path.split(".")
    node = config
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return config
