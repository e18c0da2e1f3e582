"""What Snakemake users look for beside the top-level layout: the test configuration in .test/ runs on CPU and
builds Snakemake's report, and .snakemake-workflow-catalog.yml says how the catalog presents the workflow, truly."""

from __future__ import annotations

import subprocess
import zipfile

import yaml
from helpers import DOT_TEST_CONFIG, REPO, SMOLLM2, SNAKEMAKE, TINY, TINY_ON_SMOLLM2, clone_run


def dot_test(run, *args: str) -> subprocess.CompletedProcess:
    """Snakemake on the run's folder with .test's configuration file itself, as the catalog's users run it."""
    command = [*SNAKEMAKE, "--directory", str(run), "--cores", "2", "--configfile", str(DOT_TEST_CONFIG)]
    proc = subprocess.run([*command, "--replace-workflow-config", *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_test_configuration_is_the_tiny_one_on_smollm2():
    replay = {**TINY["replay"], "max_new_tokens": 6, "passes": ["exact", "replica", "refeed"]}
    resources = {**TINY["resources"], "shard_size": TINY["dataset"]["n_problems"]}
    assert {**TINY, "configs": {"tiny": SMOLLM2}, "replay": replay, "resources": resources} == TINY_ON_SMOLLM2


def test_the_test_configuration_runs_and_builds_the_report(smollm2_run, tmp_path):
    """smollm2_run is .test's run (helpers.TINY_ON_SMOLLM2): run with the file itself it has nothing left to do, and
    --report packs every figure, the headline table and the cost statement beside the page."""
    run = clone_run(smollm2_run, tmp_path / "run")
    dry = dot_test(run, "--dry-run")
    assert "Nothing to be done" in dry.stdout + dry.stderr
    dot_test(run, "--report", "report.zip")
    with zipfile.ZipFile(run / "report.zip") as packed:
        names = packed.namelist()
        assert len(packed.read("report/report.html")) > 100_000
    packed_files = {name.rsplit("/", 1)[-1] for name in names}
    figures = {p.name for p in (run / "results" / "figures").glob("*.png")}
    assert len(figures) >= 7 and figures | {"headline.csv", "cost.md"} <= packed_files, sorted(packed_files)


def test_the_catalog_file_says_what_the_workflow_does():
    catalog = yaml.safe_load((REPO / ".snakemake-workflow-catalog.yml").read_text())["usage"]
    assert catalog["report"] is True and "\nreport: report_page()" in (REPO / "Snakefile").read_text()
    assert catalog["software-stack-deployment"] == {"conda": True}  # every script rule's env: tests/test_envs.py
    flags = catalog["mandatory-flags"]["flags"]
    assert (
        flags in (REPO / "README.md").read_text() and "--replace-workflow-config" in catalog["mandatory-flags"]["desc"]
    )
