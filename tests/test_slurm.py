"""The workflow through Snakemake's SLURM executor plugin: real submissions to a single-node Slurm cluster,
and the sbatch lines the plugin makes from each rule's resources (GPU requests included).

The cluster comes from Debian's packages (tests/slurm/cluster.sh, started by .ci/run). Where no cluster
runs, the live test skips, unless REPLAYNOISE_REQUIRE_SLURM=1 (set by .ci/run) makes that a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from types import SimpleNamespace

import pytest
from helpers import REPO, SMOLLM2, TINY, seed_model, snakemake

SLURM_PROFILE = REPO / "profiles" / "slurm"
#: The single-node cluster has no job accounting: job status comes from squeue (MinJobAge is 300 s there).
STATUS_FLAGS = (
    "--slurm-status-command",
    "squeue",
    "--slurm-init-seconds-before-status-checks",
    "5",
    "--seconds-between-status-checks",
    "5",
)
MODEL_RULES = {"generate_rollouts", *(f"replay_{p}" for p in TINY["replay"]["passes"])}


def cluster_is_up() -> bool:
    if not shutil.which("sinfo") or not shutil.which("sbatch"):
        return False
    states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return states.returncode == 0 and any(s.strip() in ("idle", "mixed") for s in states.stdout.split())


@pytest.fixture(scope="module")
def cluster():
    if not cluster_is_up():
        message = "no Slurm cluster runs here (sudo bash tests/slurm/cluster.sh starts one)"
        if os.environ.get("REPLAYNOISE_REQUIRE_SLURM") == "1":
            pytest.fail(message + ", and REPLAYNOISE_REQUIRE_SLURM=1 says one must")
        pytest.skip(message)


def planned_jobs(workdir, config, *args) -> list[dict]:
    """Rule, threads and resources of every job of a dry run, as Snakemake prints them."""
    out = snakemake(workdir, config, "-n", *args).stdout
    jobs = []
    for block in re.split(r"\n(?=rule \w+:)", out):
        head = re.match(r"rule (\w+):", block)
        resources = re.search(r"^\s+resources: (.+)$", block, re.M)
        if not head or not resources:
            continue
        threads = re.search(r"^\s+threads: (\d+)$", block, re.M)
        values = dict(item.split("=", 1) for item in resources.group(1).split(", "))
        wildcards = re.search(r"^\s+wildcards: (.+)$", block, re.M)
        named = dict(item.split("=", 1) for item in wildcards.group(1).split(", ")) if wildcards else {}
        jobs.append(
            {
                "rule": head.group(1),
                "threads": int(threads.group(1)) if threads else 1,
                "resources": values,
                "wildcards": named,
            }
        )
    return jobs


def sbatch_line(job: dict) -> str:
    """What the plugin submits for a job with these resources (its own functions, nothing submitted)."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    class Resources(dict):
        __getattr__ = dict.__getitem__

    numeric = {k: int(v) for k, v in job["resources"].items() if v.isdigit()}
    fake = SimpleNamespace(threads=job["threads"], resources=Resources(numeric), name=job["rule"])
    params = {
        "run_uuid": "RUN",
        "slurm_logfile": "/x/%j.log",
        "comment_str": job["rule"],
        "account": "",
        "partition": "",
        "workdir": "/x",
    }
    return get_submit_command(fake, params) + set_gres_string(fake)


def test_gpu_configurations_ask_slurm_for_gpus_per_model_job(tmp_path):
    """A model job asks for the GPUs it holds: none on a CPU, one for the HF engine, its tensor parallelism for
    vLLM (here 3 of the 3 that resources.gpus allows; SmolLM2's 9 heads split 3 ways)."""
    tiny = SMOLLM2
    config = {
        **TINY,
        "configs": {
            "tiny": {**tiny},
            "tiny-gpu": {**tiny, "device": "cuda"},
            "tiny-tp": {
                **tiny,
                "device": "cuda",
                "engine": "vllm",
                "block_size": 16,
                "vllm": {"tensor_parallel_size": 3},
            },
        },
        "resources": {
            "shard_size": 2,
            "threads": 4,
            "mem_mb": 12000,
            "runtime": 90,
            "gpus": 3,
            "rules": {"replay": {"runtime": 45}},
        },
    }
    # a dry run caps threads at --cores (1 by default); a real cluster run has no cap, which 64 stands in for
    jobs = planned_jobs(tmp_path, config, "--executor", "slurm", "--jobs", "10", "--cores", "64")
    model_jobs = [j for j in jobs if j["rule"] in MODEL_RULES]
    assert len(model_jobs) == 3 * 2 * len(MODEL_RULES)  # three configurations, two shards each
    held = {"tiny": "0", "tiny-gpu": "1", "tiny-tp": "3"}
    for job in model_jobs:
        line = sbatch_line(job)
        assert "--cpus-per-task=4" in line and "--mem 12000" in line, line
        assert f"-t {45 if job['rule'].startswith('replay_') else 90}" in line, line
        gpu = job["resources"]["gpu"]
        assert gpu == held[job["wildcards"]["config"]], job
        assert ("--gpus=" in line) == (gpu != "0") and (gpu == "0" or f"--gpus={gpu}" in line), line
    assert {j["resources"]["gpu"] for j in model_jobs} == {"0", "1", "3"}


@pytest.mark.slow  # the whole workflow again, each model job through sbatch
def test_the_tiny_workflow_through_slurm_gives_the_local_results(cluster, tiny_run, tiny_prepared, tmp_path):
    seed_model(tmp_path, tiny_prepared)
    config = {**TINY, "resources": {**TINY["resources"], "mem_mb": 3000, "runtime": 20}}
    snakemake(tmp_path, config, "--profile", str(SLURM_PROFILE), *STATUS_FLAGS, "--slurm-keep-successful-logs")
    ours = (tmp_path / "results" / "MANIFEST.sha256").read_text()
    assert ours == (tiny_run / "results" / "MANIFEST.sha256").read_text(), "Slurm and local runs differ"
    # every model job went through sbatch (one Slurm log per job), the light steps did not
    logs = tmp_path / ".snakemake" / "slurm_logs"
    submitted = {p.name.removeprefix("rule_") for p in logs.iterdir()}
    assert submitted == MODEL_RULES, submitted
    assert len(list(logs.rglob("*.log"))) == 2 * len(MODEL_RULES)  # two shards each
