"""The environment fingerprint provenance.json records: gathered without a GPU (its card fields None), each
configuration's engine settings and what the engine logged it resolved, and the job count of the run."""

from __future__ import annotations

import json
from importlib import metadata

from helpers import configuration

from replaynoise.fingerprint import environment_fingerprint, snakemake_load


def test_the_fingerprint_without_a_gpu_has_empty_card_fields_and_each_engine_s_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no nvidia-smi
    logs = tmp_path / "logs"
    (logs / "generate_rollouts").mkdir(parents=True)
    (logs / "generate_rollouts" / "s.000.log").write_text(
        "2026 INFO x: SGLang chose: attention_backend='fa3', chunked_prefill_size=8192, max_running_requests=None\n"
        "2026 INFO x: SGLang's KV pool: 720000 tokens\n"
    )
    (logs / "replay_exact").mkdir()
    (logs / "replay_exact" / "s.000.log").write_text("2026 INFO x: SGLang chose: attention_backend='flashinfer'\n")
    config = {"configs": {"h": configuration(), "s": configuration(engine="sglang", device="cuda")}}
    found = environment_fingerprint(config, logs)
    assert found["card"] == {
        "count": 0,
        "name": None,
        "sm_count": None,
        "compute_capability": None,
        "memory_gib": None,
    }
    assert found["driver"] is None and found["cuda_runtime"] is None  # this CPU build of torch has no CUDA
    hf, sglang = found["engines"]["h"], found["engines"]["s"]
    assert hf["engine"] == "hf" and hf["version"] == metadata.version("transformers")
    assert hf["settings"]["dtype"] == "bfloat16" and hf["resolved"] == {}
    assert sglang["settings"]["sglang"]["attention_backend"] is None  # the configuration leaves it to SGLang
    assert sglang["resolved"] == {
        "attention_backend": ["'fa3'", "'flashinfer'"],  # two builds chose differently: both kept
        "chunked_prefill_size": "8192",
        "kv_pool_tokens": "720000",
        "max_running_requests": "None",
    }
    json.dumps(found)


def test_the_job_count_is_read_from_the_snakemake_process_above_the_step(tmp_path, monkeypatch):
    proc = tmp_path / "proc"
    for pid, parent, argv in ((7, 5, ["/bin/sh", "-c", "x"]), (5, 1, ["python", "-m", "snakemake", "--cores", "3"])):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cmdline").write_bytes("\0".join([*argv, "--resources", "gpu=1", "-n"]).encode())
        (proc / str(pid) / "stat").write_text(f"{pid} (a (b)) S {parent} 0 0")
    monkeypatch.setattr("os.getppid", lambda: 7)
    assert snakemake_load(proc) == {"cores": "3", "jobs": None, "resources": "gpu=1"}
    assert snakemake_load(tmp_path / "none") == {"cores": None, "jobs": None, "resources": None}
