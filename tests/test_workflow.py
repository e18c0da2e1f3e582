"""The Snakemake workflow end to end on a tiny configuration, and what reruns when a setting changes. The
mechanics run on the tiny random model; the claims about a real model's text and numbers on SmolLM2."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess

import polars as pl
import pytest
import yaml
from helpers import REPO, TINY, TINY_MODEL_DIR, TINY_ON_SMOLLM2, clone_run, planned_rules, seed_model, snakemake

from replaynoise.io import hold_folder


@pytest.fixture(scope="module")
def finished_run(tiny_run):
    return tiny_run


def test_run_produces_every_result_with_a_valid_manifest(finished_run):
    results = finished_run / "results"
    for rel in [
        "problems/simple_addsub.parquet",
        "rollouts/tiny/rollouts.parquet",
        "pivots/tiny.parquet",
        "passes/tiny/exact.parquet",
        "passes/tiny/replica.parquet",
        "passes/tiny/refeed.parquet",
        "passes/tiny/selector.parquet",
        "credit/tiny/exact.parquet",
        "analysis/tiny/comparison.json",
        "tables/headline.csv",
        "tables/headline.md",
        "tables/headline.tex",
        "figures/disagreement.png",
        "figures/jaccard_sweep.pdf",
        "provenance.json",
    ]:
        assert (results / rel).is_file(), rel
    check = subprocess.run(
        ["sha256sum", "-c", "--quiet", "MANIFEST.sha256"], cwd=results, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    listed = (results / "MANIFEST.sha256").read_text()
    assert "rollouts/tiny/kv/" in listed and "logs/" not in listed and "benchmarks/" not in listed
    provenance = json.loads((results / "provenance.json").read_text())
    assert provenance["analysis_hash"] in (results / "tables" / "headline.md").read_text()
    assert provenance["install_mode"] == "pip"
    assert {d["key"] for d in provenance["deviations_from_committed_defaults"]} >= {"replay.k", "seed"}
    assert not (results / "work").exists() or not any((results / "work").rglob("*.parquet"))


def test_passes_hold_verified_graded_continuations(finished_run):
    results = finished_run / "results"
    pivots = pl.read_parquet(results / "pivots" / "tiny.parquet")
    assert pivots.height >= 4  # the tiny model's close answers make most positions pivots
    exact = pl.read_parquet(results / "passes" / "tiny" / "exact.parquet")
    assert exact.height == pivots.height * 2 * 2
    assert exact["verified"].all() and exact["correct"].null_count() == 0
    assert exact["text"].n_unique() > 1  # sampled, not one continuation repeated
    comparison = json.loads((results / "analysis" / "tiny" / "comparison.json").read_text())
    assert comparison["verification"]["rate"] == 1.0


def test_passes_of_a_real_model_hold_real_text(smollm2_run):
    exact = pl.read_parquet(smollm2_run / "results" / "passes" / "tiny" / "exact.parquet")
    assert exact.height > 0 and exact["verified"].all()
    assert exact["text"].str.contains("[A-Za-z]").all()


def test_the_prefix_mismatch_channel_reaches_the_report(finished_run):
    """The re-feed's prefix tokens are scored once per pivot under the frameworks' names, summarised in
    comparison.json, drawn, and said in one sentence per configuration in the tables."""
    results = finished_run / "results"
    pivots = pl.read_parquet(results / "pivots" / "tiny.parquet")
    mismatch = pl.read_parquet(results / "analysis" / "tiny" / "mismatch.parquet")
    assert set(mismatch["pass"]) == {"refeed"} and mismatch.height == pivots.height
    summary = json.loads((results / "analysis" / "tiny" / "comparison.json").read_text())["prefix_mismatch"]
    assert summary["passes"]["refeed"]["k3_kl"] is not None and "exact" in summary["not_scored"]
    assert summary["sentence"] in (results / "tables" / "headline.md").read_text()
    assert (results / "figures" / "mismatch_flips.png").is_file()


def test_changing_sample_size_reruns_sampling_and_downstream_not_model(finished_run):
    bigger = {**TINY, "dataset": {**TINY["dataset"], "n_problems": 4}}
    rules = planned_rules(finished_run, bigger)
    assert {
        "sample_problems",
        "generate_rollouts",
        "select_pivots",
        "replay_exact",
        "replay_refeed",
        "compute_credit",
        "manifest",
    } <= rules
    assert "prepare_model" not in rules


def test_changing_a_figure_setting_reruns_only_figures(finished_run):
    other = {**TINY, "figures": {"margin_bins": 3}}
    rules = planned_rules(finished_run, other)
    assert "figure_disagreement_vs_margin" in rules
    assert rules <= {"figure_disagreement_vs_margin", "manifest", "cost_report", "all"}


# max_new_tokens: the continuation budget, which the replay passes check against the context (a check in the
# sampling or rollout step made them rerun when it changed)
@pytest.mark.parametrize("setting", [{"batch_size": 8}, {"max_new_tokens": 8}])
def test_changing_one_pass_setting_leaves_rollouts_alone(finished_run, setting):
    other = {**TINY, "replay": {**TINY["replay"], **setting}}
    rules = planned_rules(finished_run, other)
    assert {"replay_exact", "replay_replica", "replay_refeed"} <= rules
    assert not rules & {"prepare_model", "sample_problems", "generate_rollouts", "select_pivots"}


def test_verify_target_reports_a_changed_file(finished_run):
    snakemake(finished_run, TINY, "verify")
    table = finished_run / "results" / "tables" / "headline.csv"
    original = table.read_bytes()
    try:
        table.write_bytes(original + b"\n")
        proc = snakemake(finished_run, TINY, "verify", check=False)
        assert proc.returncode != 0
        assert "tables/headline.csv" in proc.stdout + proc.stderr
    finally:
        table.write_bytes(original)


def _tree(folder):
    return {p.relative_to(folder).as_posix(): (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.rglob("*")}


def test_verify_writes_nothing_into_the_results_and_waits_for_no_one_through_a_link(finished_run, tmp_path):
    """verify wrote results/logs/verify.log, so it failed on a read-only copy; and two runs whose results/ is one
    folder through a link both ran (each deleting the other's temporaries): the run holds the resolved folder."""
    results = finished_run / "results"
    before = _tree(results)
    snakemake(finished_run, TINY, "verify")
    assert _tree(results) == before
    (tmp_path / "link").symlink_to(results)
    held = hold_folder(tmp_path / "link")
    try:
        proc = snakemake(finished_run, TINY, "verify", check=False)
        assert proc.returncode != 0 and "another run is using this folder" in proc.stdout + proc.stderr
    finally:
        os.close(held)
    snakemake(finished_run, TINY, "verify")


def test_verify_catches_swapped_credit_tables_and_any_edited_provenance_field(finished_run):
    """Two passes' credit tables swapped with their manifest lines, and provenance fields that no check read (git,
    packages, hardware, the manifest's file count, resources, environment, deviations), each passed verify."""
    results = finished_run / "results"
    manifest, provenance = results / "MANIFEST.sha256", results / "provenance.json"
    credit = results / "credit" / "tiny"
    originals = {
        p: p.read_bytes() for p in (manifest, provenance, credit / "exact.parquet", credit / "replica.parquet")
    }
    try:
        (credit / "exact.parquet").write_bytes(originals[credit / "replica.parquet"])
        (credit / "replica.parquet").write_bytes(originals[credit / "exact.parquet"])
        lines = manifest.read_text().split("\n")
        swapped = {"credit/tiny/exact.parquet": "credit/tiny/replica.parquet"}
        swapped |= {b: a for a, b in swapped.items()}
        digests = {line.split("  ")[1]: line.split("  ")[0] for line in lines if line}
        manifest.write_text("".join(f"{digests[swapped.get(n, n)]}  {n}\n" for n in digests))
        proc = snakemake(finished_run, TINY, "verify", check=False)
        assert proc.returncode != 0 and "column pass_name holds ['replica']" in proc.stdout + proc.stderr
        for path in (manifest, credit / "exact.parquet", credit / "replica.parquet"):
            path.write_bytes(originals[path])
        for field in ("git", "packages", "hardware", "manifest_files", "environment"):
            record = json.loads(originals[provenance])
            record[field] = "edited"
            provenance.write_text(json.dumps(record))
            proc = snakemake(finished_run, TINY, "verify", check=False)
            assert proc.returncode != 0 and "field record_sha256" in proc.stdout + proc.stderr, field
    finally:
        for path, data in originals.items():
            path.write_bytes(data)


def test_verify_catches_a_table_removed_with_its_line_and_an_edited_provenance(finished_run):
    """Tampering that keeps every remaining line true: a pass table deleted together with its manifest line, and
    provenance.json's configuration edited. The plan's outputs and the recorded settings are checked too."""
    results = finished_run / "results"
    manifest, provenance = results / "MANIFEST.sha256", results / "provenance.json"
    originals = {path: path.read_bytes() for path in (manifest, provenance)}
    table = results / "passes" / "tiny" / "refeed.parquet"
    moved = finished_run / "refeed.parquet.aside"
    try:
        table.rename(moved)
        manifest.write_text(
            "".join(
                line + "\n"
                for line in manifest.read_text().split("\n")
                if line and not line.endswith("  passes/tiny/refeed.parquet")
            )
        )
        proc = snakemake(finished_run, TINY, "verify", check=False)
        assert proc.returncode != 0 and "UNLISTED passes/tiny/refeed.parquet" in proc.stdout + proc.stderr
        moved.rename(table)
        manifest.write_bytes(originals[manifest])
        record = json.loads(originals[provenance])
        record["config"]["replay"]["k"] = 99
        provenance.write_text(json.dumps(record))
        proc = snakemake(finished_run, TINY, "verify", check=False)
        assert proc.returncode != 0 and "provenance.json's config hashes to" in proc.stdout + proc.stderr
    finally:
        if moved.exists():
            moved.rename(table)
        for path, data in originals.items():
            path.write_bytes(data)
    snakemake(finished_run, TINY, "verify")


def test_the_report_holds_every_figure_table_and_the_cost_whole_and_captioned(finished_run):
    """snakemake --report makes one HTML page a reviewer opens: every figure, the tables and the cost statement are
    in it, each with a caption, each embedded byte for byte (no image missing), and the page loads nothing from
    outside itself (no script, style or image by URL)."""
    snakemake(finished_run, TINY, "--report", "results/report.html")
    html = (finished_run / "results" / "report.html").read_text()
    entries = {}
    for match in re.finditer(r'"(results/[^"]+)": \{"name"', html):
        start = match.start()
        caption = re.search(r'"caption": "((?:[^"\\]|\\.)*)"', html[start:]).group(1)
        data = re.search(r'"data_uri": "data:[^,]*;base64,([A-Za-z0-9+/=]+)"', html[start:]).group(1)
        entries[match.group(1)] = (caption, base64.b64decode(data))
    results = finished_run / "results"
    expected = {f"results/{p.relative_to(results).as_posix()}" for p in results.glob("figures/*.png")}
    expected |= {"results/tables/headline.csv", "results/cost/cost.md"}
    expected |= {f"results/{p.relative_to(results).as_posix()}" for p in results.glob("analysis/*/channels.csv")}
    assert len(expected) >= 10 and set(entries) == expected
    for rel, (caption, data) in entries.items():
        assert len(caption) > 80, rel  # a sentence of what to look at, not a file name
        assert data == (finished_run / rel).read_bytes(), rel
    assert not re.search(r"<(script|img|link|iframe)[^>]+(src|href)=[\"']?(https?:)?//", html)


def test_cost_statement_covers_every_model_job(finished_run):
    cost = pl.read_csv(finished_run / "results" / "cost" / "cost.csv")
    rows = {r["rule"]: r for r in cost.iter_rows(named=True)}
    shards = 2  # TINY's shard size 2 over 3 problems
    assert rows["generate_rollouts"]["jobs"] == shards
    for name in TINY["replay"]["passes"]:
        assert rows[f"replay_{name}"]["jobs"] == rows[f"replay_{name}"]["timed_jobs"] == shards
    total = rows["total"]
    assert total["jobs"] == 1 + shards * (1 + len(TINY["replay"]["passes"]))
    assert rows["prepare_model"]["timed_jobs"] == 0  # the tests seed the converted model instead of running it
    assert total["timed_jobs"] == total["jobs"] - 1
    assert total["gpu_hours"] == 0 and total["cpu_core_hours"] > 0 and total["cost"] > 0
    assert "cost/" not in (finished_run / "results" / "MANIFEST.sha256").read_text()


def test_paper_preset_runs_on_cpu_shrunk_and_reports_the_papers_definitions(tiny_prepared, tmp_path):
    """config/campaigns/paper.yaml as it is, but one configuration on the CPU (its SmolLM2 settings on the tiny
    model) and a few problems (built-in arithmetic instead of GSM8K, short budgets): its rules, screen, probe and
    tables come through by name."""
    config = yaml.safe_load((REPO / "config" / "campaigns" / "paper.yaml").read_text())
    config["configs"] = {
        "tiny": {
            **config["configs"]["smollm2-bf16"],
            "model": str(TINY_MODEL_DIR),
            "dtype": "float32",
            "device": "cpu",
            "max_new_tokens": 40,
        }
    }
    config["dataset"] = {"source": "simple_addsub", "sample": "first", "n_problems": 4}
    config["prompt"]["instruction"] = "Answer in one short sentence that ends with the number."
    config["rollouts"].update(per_problem=2, batch_size=8, screen={"rule": "mixed", "fixed": 2, "skip": 0, "keep": 2})
    config["pivots"].update(max_margin=3.0, min_response_len=4)
    config["replay"].update(k=2, max_new_tokens=8, batch_size=16, probe_tokens=4)
    config["analysis"].update(n_boot=20, min_eligible=1)
    config["resources"] = {"shard_size": 4, "threads": 2}
    seed_model(tmp_path, tiny_prepared)
    snakemake(tmp_path, config)
    results = tmp_path / "results"
    rollouts = pl.read_parquet(results / "rollouts" / "tiny" / "rollouts.parquet")
    assert rollouts.group_by("problem_id").len()["len"].to_list() == [2] * 4
    pivots = pl.read_parquet(results / "pivots" / "tiny.parquet")
    assert pivots.height > 0 and set(pivots["rollout"]) <= {0, 1}
    assert (pivots["prefix_len"] % 16).is_in([0, 1, 2]).all()
    assert pivots.group_by("problem_id", "rollout").len()["len"].max() <= 5
    exact = pl.read_parquet(results / "passes" / "tiny" / "exact.parquet")
    assert exact.filter(pl.col("k") == 0)["probe_ids"].list.len().max() <= 4
    assert exact.filter(pl.col("k") == 1)["probe_ids"].null_count() == exact.filter(pl.col("k") == 1).height
    comparison = json.loads((results / "analysis" / "tiny" / "comparison.json").read_text())
    assert comparison["metric"] == "sign"
    assert {"main", "treatment_independent"} <= set(comparison["conditionings"])
    assert comparison["probe"]["refeed"]["recorded"] is True
    headline = pl.read_csv(results / "tables" / "headline.csv", comment_prefix="#")
    assert set(headline["conditioning"]) >= {"main", "treatment_independent"}
    assert (headline["metric"] == "sign").all()


CONTROLS = [
    "transplant_decode",
    "transplant_refeed",
    "transplant_refeed_lo15",
    "refeed_fp32",
    "exact_fp32cont",
    "refeed_fp32cont",
]


def test_control_passes_join_a_finished_run_without_rerunning_it_and_report_whom_they_follow(smollm2_run, tmp_path):
    """On the packaged SmolLM2 (30 layers, bf16, CPU): adding transplant and precision passes runs them
    alone (no other pass reruns). A whole-cache transplant's first step never stays with its recipient where
    donor and recipient differ and mostly follows the donor (not always: it runs in the recipient's batch layout,
    and on this CPU the layout alone changes 54% of exact's first steps, the replica's floor); its drift from the
    decode-time KV is zero exactly in the layers taken from it. (Same layout, bitwise: tests/test_controls.py.)"""
    run = clone_run(smollm2_run, tmp_path / "run")
    passes = TINY_ON_SMOLLM2["replay"]["passes"] + CONTROLS
    config = {**TINY_ON_SMOLLM2, "replay": {**TINY_ON_SMOLLM2["replay"], "passes": passes}}
    rules = planned_rules(run, config)
    assert {f"replay_{p}" for p in CONTROLS} <= rules
    assert {"figure_transplant", "figure_transplant_layers", "table_controls"} <= rules
    assert not rules & {"generate_rollouts", *(f"replay_{p}" for p in TINY_ON_SMOLLM2["replay"]["passes"])}
    snakemake(run, config)
    results = run / "results"
    for rel in ["figures/transplant.png", "figures/transplant_layers.pdf", "tables/controls.csv", "tables/controls.md"]:
        assert (results / rel).is_file() and rel in (results / "MANIFEST.sha256").read_text(), rel
    controls = json.loads((results / "analysis" / "tiny" / "comparison.json").read_text())["controls"]
    for name in ("transplant_decode", "transplant_refeed"):
        first = controls["transplant"][name]["channels"]["next_topk"]
        assert first["donor_and_recipient_differ"] == 24  # re-fed and decode-time first steps always differ here
        assert first["follows_recipient_where_they_differ"]["n_same"] == 0
        assert first["follows_donor_where_they_differ"]["estimate"] > 0.5, first
    lower = pl.read_parquet(results / "passes" / "tiny" / "transplant_refeed_lo15.parquet")["kv_maxdiff"]
    assert all(len(d) == 30 and max(d[15:]) == 0.0 for d in lower.to_list())
    assert any(max(d[:15]) > 0 for d in lower.to_list())
    arms = {a["arm"]: a for a in controls["precision"]}
    assert set(arms) == {"replica floor", "model dtype", "prefix in float32", "continuation in float32"}
    assert arms["prefix in float32"]["kv_drift"]["median"] > 0  # bf16 decode-time KV vs an fp32 prefill
    table = (results / "tables" / "controls.md").read_text()
    assert "| tiny | transplant_decode | exact → refeed | [0, n) |" in table and "prefix in float32" in table
