"""Shared fixtures: the models and the finished runs other tests read. A test is slow because of what it uses:
a fixture named in ``SLOW_FIXTURES`` (directly or through another fixture) marks it ``slow``, whatever its file.
The helpers the tests share are in helpers.py."""

from __future__ import annotations

import json
import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the cores (pytest -n): OpenMP threads that spin while they wait take the cores from the other
    # worker's processes, so they sleep instead (read when torch first loads, below; model jobs inherit it).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import PACKAGES, TINY, TINY_MODEL_DIR, TINY_ON_SMOLLM2, built_once, clone_run, seed_model, snakemake
from tinymodel import save_tiny_chat_model

from replaynoise.data.models import prepared_model_key
from replaynoise.data.preparation import prepare_model
from replaynoise.io import sha256_file

#: Fixtures that make a test slow: the packaged models (a GGUF conversion of about a minute, then a real model's
#: compute), and the workflow runs that take minutes beyond the shared tiny run.
SLOW_FIXTURES = {"smollm2_dir", "gemma_dir", "trained_run"}


#: Seconds of the tests that took 5 s or more in a whole run on 2 cores (benchmarks/suite_times.py --durations).
DURATIONS = json.loads((Path(__file__).parent / "durations.json").read_text())["seconds"]


def pytest_configure(config):
    # Under pytest -n, xdist tops a worker up one test at a time as it frees (each keeps two queued; by default
    # each gets a quarter of its share at once), so the order below holds.
    if getattr(config.option, "maxschedchunk", False) is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # The longest first, the rest in collected order: a two-minute test handed out last would leave the other
    # worker idle for most of it. A test missing from DURATIONS only runs later.
    items.sort(key=lambda item: -DURATIONS.get(item.nodeid, 0.0))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Iterator[Path]:
    """SmolLM2-135M-Instruct dequantized to bf16 safetensors, through the same code as the prepare_model rule."""
    out = built_once(
        tmp_path_factory,
        "models/smollm2-135m-bfloat16",
        lambda out: prepare_model("smollm2-135m", "bfloat16", out, PACKAGES),
    )
    yield from _unchanged(out)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random model of ``TINY`` (helpers.TINY_MODEL_DIR), made where it is missing. It is written
    beside its place and renamed into it, so sessions that make it at once each find a whole model."""
    if not TINY_MODEL_DIR.is_dir():
        TINY_MODEL_DIR.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=TINY_MODEL_DIR.parent))
        save_tiny_chat_model(tmp, close=True)
        try:
            os.replace(tmp, TINY_MODEL_DIR)
        except OSError:  # another session put it there first
            shutil.rmtree(tmp)
    return TINY_MODEL_DIR


@pytest.fixture(scope="session")
def tiny_prepared(tiny_model, tmp_path_factory) -> Iterator[Path]:
    """The tiny model as the prepare_model rule leaves it, in a directory named by its model key."""
    out = built_once(
        tmp_path_factory,
        f"models/{prepared_model_key(str(tiny_model), 'float32')}",
        lambda out: prepare_model(str(tiny_model), "float32", out, PACKAGES),
    )
    yield from _unchanged(out)


def _unchanged(model_dir: Path) -> Iterator[Path]:
    # Runs and copies hard-link these files (``copy_linking``): a test that wrote into one would change them
    # for every later test, so the session ends with a check that none did.
    digests = {p.name: sha256_file(p) for p in model_dir.iterdir()}
    yield model_dir
    changed = [name for name, digest in digests.items() if sha256_file(model_dir / name) != digest]
    assert not changed, f"a test changed the shared model's files in place: {changed}"


def _run(model_dir: Path, config: dict) -> Callable[[Path], None]:
    def run(workdir: Path) -> None:
        seed_model(workdir, model_dir)
        snakemake(workdir, config)

    return run


@pytest.fixture(scope="session")
def tiny_run(tiny_prepared, tmp_path_factory) -> Path:
    """A finished, uninterrupted run of the tiny configuration: the reference other runs must reproduce. Made
    once per session; each worker reads its own copy.

    Tests that change files in it restore them; tests that need to break things work on a copy.
    """
    run = built_once(tmp_path_factory, "workflow-tiny", _run(tiny_prepared, TINY))
    return clone_run(run, tmp_path_factory.mktemp("workflow") / "tiny")


@pytest.fixture(scope="session")
def smollm2_run(smollm2_dir, tmp_path_factory) -> Path:
    """The tiny configuration run on SmolLM2, for the claims about a real model's numbers (made once per
    session; each worker reads its own copy)."""
    run = built_once(tmp_path_factory, "workflow-smollm2", _run(smollm2_dir, TINY_ON_SMOLLM2))
    return clone_run(run, tmp_path_factory.mktemp("workflow-smollm2") / "smollm2")
