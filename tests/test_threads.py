"""No result follows the thread count: a CPU model step computes with its configuration's cpu_threads (protocol,
in the analysis hash where given), never with the cores Snakemake gave the job (resources.threads, --cores)."""

from __future__ import annotations

import torch
from helpers import PACKAGES, TINY, configuration, seed_model, snakemake
from tinymodel import save_tiny_chat_model

from replaynoise.config import analysis_hash, validate_config
from replaynoise.data.preparation import prepare_model
from replaynoise.engines import make_engine


def _logits(engine, batches) -> list[torch.Tensor]:
    with torch.no_grad():
        return [engine.model(ids).logits for ids in batches]


def test_a_cpu_model_step_computes_with_cpu_threads_whatever_cores_the_job_got(tmp_path):
    """On layers as wide as SmolLM2's (576 x 1536) this CPU's float32 GEMMs sum in another order at 1 and at 2
    threads, so cpu_threads changes logits; the job's own thread count does not."""
    prepare_model(
        str(save_tiny_chat_model(tmp_path / "wide", hidden=576, intermediate=1536)),
        "float32",
        tmp_path / "prepared",
        PACKAGES,
    )
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 300, (rows, length), generator=gen) for rows, length in ((1, 13), (5, 1), (16, 4))]
    seen = {}
    for cpu_threads, threads in ((2, 1), (2, 2), (1, 2)):
        settings = configuration(model=str(tmp_path / "wide"), dtype="float32", cpu_threads=cpu_threads)
        engine = make_engine(settings, tmp_path / "prepared", topk=5, threads=threads)
        assert torch.get_num_threads() == cpu_threads
        seen[(cpu_threads, threads)] = _logits(engine, batches)
    assert all(torch.equal(a, b) for a, b in zip(seen[(2, 1)], seen[(2, 2)]))
    assert not all(torch.equal(a, b) for a, b in zip(seen[(1, 2)], seen[(2, 2)]))  # the kernels do follow it


def test_cpu_threads_is_protocol_and_resources_threads_is_not():
    base = {**TINY, "configs": {"tiny": {**TINY["configs"]["tiny"], "model": "smollm2-135m"}}}
    hashes = {}
    for cpu_threads, threads in ((1, 1), (1, 4), (2, 1)):
        config = {
            **base,
            "configs": {"tiny": {**base["configs"]["tiny"], "cpu_threads": cpu_threads}},
            "resources": {**base["resources"], "threads": threads},
        }
        hashes[(cpu_threads, threads)] = analysis_hash(validate_config(config))
    assert hashes[(1, 1)] == hashes[(1, 4)] != hashes[(2, 1)]
    # the default written out is the default
    absent = {**base, "configs": {"tiny": {k: v for k, v in base["configs"]["tiny"].items() if k != "cpu_threads"}}}
    written = {**base, "configs": {"tiny": {**absent["configs"]["tiny"], "cpu_threads": 2}}}
    assert analysis_hash(validate_config(absent)) == analysis_hash(validate_config(written))


def test_a_run_at_other_thread_and_core_counts_writes_the_same_manifest(tiny_run, tiny_prepared, tmp_path):
    """The tiny configuration again with two threads a job and one core in all: every result file, and so the
    manifest, is the same as the shared run's (one thread a job, two cores)."""
    work = tmp_path / "run"
    seed_model(work, tiny_prepared)
    config = {**TINY, "resources": {**TINY["resources"], "threads": 2}}
    snakemake(work, config, "--cores", "1")
    manifest = (work / "results" / "MANIFEST.sha256").read_text()
    assert manifest == (tiny_run / "results" / "MANIFEST.sha256").read_text()
