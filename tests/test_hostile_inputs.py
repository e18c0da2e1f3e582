"""Inputs a hostile or careless user can give: ids that would become paths, results lost between runs,
inputs edited mid-run, prompts past the context, settings that can give no result, damaged scratch, a rebuild
into its own reference. Each is refused by name before it can do harm, or repaired, and the embedded default's
results do not change.

The model-free tests run in seconds; those marked slow run Snakemake.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest
import yaml
from helpers import (
    REPO,
    SNAKEMAKE,
    TINY,
    clone_run,
    pass_job,
    planned_rules,
    rollout_job,
    seed_model,
    snakemake,
    with_setting,
)

from replaynoise import io as rio
from replaynoise import reanalyze, reference
from replaynoise.config import ConfigError, analysis_hash, validate_config
from replaynoise.data import models
from replaynoise.data.datasets import load_problems, read_problems
from replaynoise.engines.base import ContinuationResult, Rollout, SamplingSettings
from replaynoise.generation import replay, rollouts
from replaynoise.generation.pivots import PivotRules
from replaynoise.io import file_in, intact_scratch, keyed_scratch, read_json, sha256_file
from replaynoise.machine import overlay_adds_default_configs, platform_problems
from replaynoise.progress import Phases
from replaynoise.provenance import input_checksums, verify_inputs

DEFAULT = yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


# ------------------------------------------------------------------------------------- 1. ids that become paths


@pytest.mark.parametrize(
    "bad_id",
    [
        "../../../../../../../../../../tmp/x",  # wrote /tmp/x.r0.safetensors
        "a/b",  # failed only in the replay pass, as "deleted or moved"
        "two\nlines",  # split its line of MANIFEST.sha256
        "two\u2028lines",  # passed, and Python's str.splitlines split the manifest line: verify crashed
        "two\x85lines",
        "x" * 245,  # File name too long, after generation
    ],
)
def test_an_id_that_cannot_name_a_file_is_refused_by_file_and_line(tmp_path, bad_id):
    data = jsonl(
        tmp_path / "mine.jsonl",
        [
            {"id": "ok", "question": "What is 1 plus 1?", "answer": "2"},
            {"id": bad_id, "question": "What is 2 plus 2?", "answer": "4"},
        ],
    )
    with pytest.raises(ValueError, match=r"mine\.jsonl:2: problem id .*(cannot name a file|bytes long)"):
        load_problems("file", str(data), tmp_path)


def test_a_safe_id_still_loads(tmp_path):
    data = jsonl(tmp_path / "mine.jsonl", [{"id": "chal-1.v2 b", "question": "What is 1 plus 1?", "answer": "2"}])
    assert load_problems("file", str(data), tmp_path)["problem_id"].to_list() == ["mine-chal-1.v2 b"]


@pytest.mark.parametrize("name", ["../x.safetensors", "/tmp/x.safetensors", "a/b.json", "..", ""])
def test_a_file_name_made_from_data_never_leaves_its_folder(tmp_path, name):
    with pytest.raises(ValueError, match="not a plain file name"):
        file_in(tmp_path / "kv", name)
    assert file_in(tmp_path / "kv", "p-1.r0.safetensors") == tmp_path / "kv" / "p-1.r0.safetensors"


# ------------------------------------------------------------------------------------- 3. inputs hashed when read


def test_provenance_records_the_dataset_as_the_sampling_step_read_it(tmp_path):
    data = jsonl(
        tmp_path / "mine.jsonl", [{"question": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(3)]
    )
    read = read_problems("file", str(data), tmp_path)
    assert read.sha256 == sha256_file(data)
    assert read.where["mine-1"] == f"{data}:2"
    with open(data, "a") as fh:  # edited while a later step runs
        fh.write(json.dumps({"question": "What is 9 plus 1?", "answer": "10"}) + "\n")
    recorded = input_checksums([str(data)], {str(data): read.sha256})
    assert recorded == {str(data): read.sha256} != {str(data): sha256_file(data)}
    provenance = tmp_path / "provenance.json"
    provenance.write_text(json.dumps({"inputs": recorded}))
    assert any(str(data) in line for line in verify_inputs(provenance))


# --------------------------------------------------------------------------------- 4. prompts past the context


class WordTokenizer:
    """One token per word (prompt.style plain): a prompt's length is known without a model."""

    all_special_ids: list[int] = []

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(range(len(text.split())))}

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


class RecordingEngine:
    """Answers every rollout with "2" and records the problems it was asked for: enough to see what reached it."""

    name = "recording"
    stop_ids: set[int] = set()
    tokenizer = WordTokenizer()

    def __init__(self):
        self.phases, self.asked = Phases(), []

    def generate_rollouts(self, requests, sampling, kv_dir, keep_len):
        self.asked += [req.problem_id for req in requests]
        return [
            Rollout(
                problem_id=req.problem_id,
                prompt_ids=list(req.prompt_ids),
                response_ids=[2],
                topk_ids=[[2, 3]],
                topk_logprobs=[[-0.1, -2.0]],
                logits_digests=["d"],
                finish_reason="eos",
                rollout=req.rollout,
            )
            for req in requests
        ]


def long_dataset(tmp_path: Path) -> tuple[Path, pl.DataFrame]:
    """Four problems, the third (row 2, on line 4: the file starts with a blank line) over 500 words long."""
    rows = [{"question": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(4)]
    rows[2]["question"] = "long " * 500 + "What is 2 plus 1?"
    data = tmp_path / "mine.jsonl"
    data.write_text("\n" + "".join(json.dumps(row) + "\n" for row in rows))
    return data, load_problems("file", str(data), tmp_path)


def rollouts_of(
    engine, problems, tmp_path: Path, name: str, long_prompts: str = "refuse", batch_size: int = 1, **kwargs
) -> pl.DataFrame:
    job = rollout_job(
        "tiny",
        1,
        SamplingSettings(0.7, 1.0, 24),
        PivotRules(max_margin=0.3, per_rollout=1),
        style="plain",
        instruction="",
        long_prompts=long_prompts,
        batch_size=batch_size,
    )
    return rollouts.generate(
        engine, problems, job, kv_dir=tmp_path / name / "kv", work_dir=tmp_path / name / "work", context=100, **kwargs
    )


def test_a_prompt_past_the_context_is_refused_by_file_and_line_before_any_generation(tmp_path):
    data, problems = long_dataset(tmp_path)
    dataset = {"source": "file", "path": str(data), "cache": str(tmp_path)}
    engine = RecordingEngine()
    with pytest.raises(ValueError) as err:
        rollouts_of(engine, problems, tmp_path, "refused", dataset=dataset)
    message = str(err.value)
    assert f"{data}:4: problem mine-2: 507 prompt tokens" in message
    for part in (
        "configuration tiny: 1 prompt(s) and their 24 rollout tokens (configs.tiny.max_new_tokens) run "
        "past its 100-position context",
        "Shorten or remove",
        "configs.tiny.vllm.max_model_len",
        "rollouts.long_prompts: skip",
    ):
        assert part in message, part
    assert engine.asked == []  # refused before any generation
    # exactly at the edge: a prompt of 76 tokens and 24 rollout tokens fill 100 positions
    assert rollouts.overlong_prompts({"a": range(76), "b": range(77)}, 24, 100) == {"b": 77}
    assert rollouts.overlong_prompts({"b": range(10**4)}, 24, None) == {}  # a context nobody states: no check
    data.unlink()  # gone since sampling: the problem is still named, by its row
    with pytest.raises(ValueError, match="dataset row 2: problem mine-2: 507 prompt tokens"):
        rollouts_of(RecordingEngine(), problems, tmp_path, "gone", dataset=dataset)


def test_long_prompts_skip_leaves_them_out_with_a_count_and_shards_still_agree(tmp_path, capsys):
    data, problems = long_dataset(tmp_path)
    dataset = {"source": "file", "path": str(data), "cache": str(tmp_path)}
    engine = RecordingEngine()
    whole = rollouts_of(engine, problems, tmp_path, "whole", long_prompts="skip", dataset=dataset, batch_size=2)
    assert whole["problem_id"].to_list() == ["mine-0", "mine-1", "mine-3"]
    assert "mine-2" not in engine.asked
    assert (
        f"configuration tiny: skipped 1 of 4 problems of this shard, whose prompts and their 24 rollout tokens "
        f"(configs.tiny.max_new_tokens) run past its 100-position context (rollouts.long_prompts: skip): "
        f"{data}:4: problem mine-2: 507 prompt tokens"
    ) in capsys.readouterr().err
    # shards [0, 2] and [3]: batch [mine-2, mine-3] straddles them; both leave mine-2 out, its own shard counts it
    first = rollouts_of(
        RecordingEngine(),
        problems,
        tmp_path,
        "s0",
        long_prompts="skip",
        dataset=dataset,
        batch_size=2,
        mine=range(0, 3),
    )
    assert "skipped 1 of 3 problems" in capsys.readouterr().err
    second = rollouts_of(
        RecordingEngine(),
        problems,
        tmp_path,
        "s1",
        long_prompts="skip",
        dataset=dataset,
        batch_size=2,
        mine=range(3, 4),
    )
    assert "skipped" not in capsys.readouterr().err
    assert rollouts.gather([first, second]).equals(rollouts.gather([whole]))
    with pytest.raises(ValueError, match="none of the 1 rollout shards has a rollout"):
        rollouts.gather(
            [
                rollouts_of(
                    RecordingEngine(), problems, tmp_path, "none", long_prompts="skip", batch_size=2, mine=range(2, 3)
                )
            ]
        )
    with pytest.raises(ValueError, match="rollouts.long_prompts must be one of .*'truncate'"):
        rollouts_of(RecordingEngine(), problems, tmp_path, "bad", long_prompts="truncate")


def test_long_prompts_takes_refuse_or_skip_only_and_leaves_the_default_as_it_was():
    assert "long_prompts" not in validate_config(DEFAULT)["rollouts"]  # absent: the settings and hash unchanged
    skip = validate_config(with_setting(DEFAULT, "rollouts.long_prompts", "skip"))
    assert skip["rollouts"]["long_prompts"] == "skip"
    with pytest.raises(ConfigError, match=r"rollouts\.long_prompts: 'truncate' is not allowed"):
        validate_config(with_setting(DEFAULT, "rollouts.long_prompts", "truncate"))


def test_the_context_is_the_smallest_the_configuration_sets(tmp_path):
    assert models.engine_context({"model": "smollm2-135m"}) == 8192
    assert models.engine_context({"model": "smollm2-135m", "vllm": {"max_model_len": 4096}}) == 4096
    assert models.engine_context({"model": "smollm2-135m", "invariant_context": 1024}) == 1024
    (tmp_path / "config.json").write_text("{}")  # a local model that does not say
    assert models.engine_context({"model": str(tmp_path)}) is None


def test_a_continuation_past_the_context_is_refused_by_pivot_and_key(tmp_path):
    """Pivot p/r0@1's prefix is 3 tokens (prompt 2, response 1), p/r0@2's 4; each continuation is the branch token
    and 4 more: 8 and 9 positions."""
    engine = CountingEngine()
    with pytest.raises(ValueError) as err:
        one_pass(engine, tmp_path / "a", context=8)
    message = str(err.value)
    assert (
        "configuration c, pass refeed: 1 pivot(s) leave their continuations too few of the 8-position context"
        in message
    )
    assert "pivot p/r0@2 of problem p: 4 prefix tokens + 1 branch token + 4 (replay.max_new_tokens) = 9" in message
    assert "p/r0@1" not in message and "lower replay.max_new_tokens to 3 or less" in message
    assert engine.batches == 0  # refused before any continuation
    with pytest.raises(
        ValueError,
        match=r"2 pivot\(s\).*p/r0@1 of problem p: 3 prefix tokens \+ 1 branch token \+ 6 "
        r"\(replay.probe_tokens\) = 10.*lower replay.probe_tokens to 4 or less",
    ):
        one_pass(CountingEngine(), tmp_path / "b", context=9, probe_tokens=6)
    assert one_pass(CountingEngine(), tmp_path / "c", context=9).equals(one_pass(CountingEngine(), tmp_path / "d"))


# --------------------------------------------------------------------------------------------- 5. n_boot minimum


@pytest.mark.parametrize("n_boot", [-1, 0, 1, 2, 19])
def test_too_few_bootstrap_resamples_are_refused_by_name(n_boot, capsys):
    with pytest.raises(ConfigError, match=rf"analysis\.n_boot: {n_boot} is less than the minimum of 20"):
        validate_config(with_setting(DEFAULT, "analysis.n_boot", n_boot))
    paper = REPO / "tests" / "data" / "paper-records" / "c2-k16.json.gz"
    assert reanalyze.main([str(paper), "--n-boot", str(n_boot), "--no-figures", "--out", "/nonexistent"]) == 2
    assert f"--n-boot (analysis.n_boot) is {n_boot}; at least 20" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- 6. damaged scratch


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_truncated_rollout_batch_is_named_and_redone(tmp_path, capsys):
    batch = tmp_path / "records" / "batch_00000.parquet"
    batch.parent.mkdir()
    rio.write_parquet(pl.DataFrame({"kv_file": [None, None]}, schema={"kv_file": pl.Utf8}), batch)
    assert rollouts._resumable(batch, tmp_path / "kv")
    truncate(batch)
    assert not rollouts._resumable(batch, tmp_path / "kv")
    assert f"{batch}: damaged scratch batch, redoing it" in capsys.readouterr().err
    assert not batch.exists()


class CountingEngine:
    """An engine whose continuations are a function of the request alone: enough to check what a pass resumes."""

    name = "counting"
    stop_ids: set[int] = set()

    class tokenizer:
        @staticmethod
        def decode(ids, **_):
            return " ".join(map(str, ids))

    def __init__(self):
        self.phases, self.batches = Phases(), 0

    def run_batch(self, requests, source, sampling):
        self.batches += 1
        return [
            ContinuationResult(
                token_ids=[req.seed % 7],
                finish_reason="stop",
                verified=True,
                prefix_len=len(req.prefix_ids),
                next_topk_ids=[1],
                next_topk_logprobs=[-0.5],
                next_digest="d",
            )
            for req in requests
        ]


def one_pass(engine, work_dir: Path, probe_tokens: int = 0, **kwargs) -> pl.DataFrame:
    rollout_rows = pl.DataFrame(
        {
            "problem_id": ["p"],
            "rollout": [0],
            "prompt_ids": [[1, 2]],
            "response_ids": [[3, 4, 5]],
            "kv_file": [None],
            "kv_sha256": [None],
            "logits_digests": [["a", "b", "c"]],
            "gold": ["4"],
        },
        schema_overrides={"kv_file": pl.Utf8, "kv_sha256": pl.Utf8},
    )
    pivots = pl.DataFrame(
        {
            "pivot_id": ["p/r0@1", "p/r0@2"],
            "problem_id": ["p", "p"],
            "rollout": [0, 0],
            "t": [1, 2],
            "orig_token": [4, 5],
            "sub_token": [6, 6],
        }
    )
    job = pass_job("refeed", "c", 1, SamplingSettings(0.7, 1.0, 4), k=2, batch_size=3, probe_tokens=probe_tokens)
    return replay.run_pass(engine, pivots, rollout_rows, job, work_dir=keyed_scratch(work_dir, "key"), **kwargs)


def test_a_truncated_pass_batch_is_named_and_redone_to_the_same_result(tmp_path, capsys):
    whole = one_pass(CountingEngine(), tmp_path / "whole")
    work = tmp_path / "resumed"
    one_pass(CountingEngine(), work)
    batches = sorted(work.glob("batch_*.parquet"))
    assert len(batches) == 3
    truncate(batches[1])
    engine = CountingEngine()
    assert one_pass(engine, work).equals(whole)
    assert engine.batches == 1  # only the damaged batch was redone
    assert f"{batches[1]}: damaged scratch batch, redoing it" in capsys.readouterr().err


def test_intact_scratch_leaves_a_good_file_alone(tmp_path):
    good = tmp_path / "b.parquet"
    rio.write_parquet(pl.DataFrame({"a": [1]}), good)
    assert intact_scratch(good) and good.is_file()
    assert not intact_scratch(tmp_path / "absent.parquet")


def test_a_rename_into_place_is_made_durable(tmp_path, monkeypatch):
    """The written file and its folder are both flushed (fsync), so the rename survives a power cut."""
    synced = []
    real = os.fsync

    def spy(fd):
        synced.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(rio.os, "fsync", spy)
    target = tmp_path / "out" / "x.json"
    rio.write_json({"a": 1}, target)
    assert target.stat().st_ino in synced, "the file was not synced"
    assert target.parent.stat().st_ino in synced, "its folder was not synced after the rename"


# ---------------------------------------------------------------------------- 7. a rebuild into its reference


@pytest.mark.parametrize("inside", ["", "analysis", "new/folder"])
def test_a_rebuild_into_its_own_reference_is_refused(tmp_path, capsys, inside):
    ref = shutil.copytree(REPO / "reference" / "gpu" / "qwen-k8", tmp_path / "qwen-k8")
    before = {p: p.read_bytes() for p in ref.rglob("*") if p.is_file()}
    assert reference.main(["rebuild", str(ref), str(ref / inside)]) == 2
    assert "rebuild would write" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in ref.rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------------ 8. settings that can give no pivot


@pytest.mark.parametrize(
    "changes, names",
    [
        (
            {"pivots.align_to_block": True, "pivots.block_offsets": [40]},
            ["pivots.block_offsets", "configs.smollm2-bf16.block_size", "[40]"],
        ),
        (
            {"rollouts.per_problem": 1, "rollouts.screen.rule": "mixed"},
            ["rollouts.screen.rule", "rollouts.per_problem", "at least 2"],
        ),
    ],
)
def test_settings_that_cannot_give_a_pivot_are_refused(changes, names):
    config = DEFAULT
    for key, value in changes.items():
        config = with_setting(config, key, value)
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    for name in names:
        assert name in str(err.value)


def test_offsets_within_the_block_and_a_mixed_screen_of_several_rollouts_pass():
    ok = with_setting(with_setting(DEFAULT, "pivots.align_to_block", True), "pivots.block_offsets", [0, 31])
    validate_config(with_setting(with_setting(ok, "rollouts.per_problem", 2), "rollouts.screen.rule", "mixed"))


# ------------------------------------------------------------------------------- 9, 11. names that become paths


def test_a_configuration_name_ending_in_a_newline_is_refused():
    config = with_setting(DEFAULT, "configs", {"mine\n": DEFAULT["configs"]["smollm2-bf16"]})
    with pytest.raises(ConfigError, match=r"configs\.'mine\\n'"):
        validate_config(config)


@pytest.mark.parametrize("name", ["data{1}.jsonl", "data}.jsonl"])
def test_a_dataset_path_with_braces_is_refused_by_key_and_path(tmp_path, name):
    data = jsonl(tmp_path / name, [{"question": "What is 1 plus 1?", "answer": "2"}])
    config = with_setting(with_setting(DEFAULT, "dataset.source", "file"), "dataset.path", str(data))
    with pytest.raises(ConfigError, match=r"config key dataset\.path: .*brace"):
        validate_config(config)


def test_a_local_model_file_with_braces_is_refused_by_key_and_path(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "notes{v2}.txt"):
        (model / name).write_text("{}")
    config = with_setting(DEFAULT, "configs.smollm2-bf16.model", str(model))
    with pytest.raises(ConfigError, match=r"configs\.smollm2-bf16\.model: .*notes\{v2\}\.txt.*brace"):
        validate_config(config)


# --------------------------------------------------------------------------- 10. reanalyze checks record fields

GOOD = {
    "problem_id": 1,
    "rollout": 0,
    "abs_pos": 16,
    "margin": 0.5,
    "A_exact1": 0.25,
    "A_exact2": 0.25,
    "A_refeed": 0.5,
}


@pytest.mark.parametrize(
    "pivot, extra, names",
    [
        ("not a pivot", [], ["pivot 1", "not an object"]),
        (GOOD | {"margin": None}, [], ["pivot 1", "'margin'", "None"]),
        (GOOD | {"abs_pos": "x12"}, [], ["pivot 1", "'abs_pos'", "'x12'"]),
        (GOOD | {"abs_pos": 17, "A_refeed": float("nan")}, [], ["pivot 1", "A_refeed", "nan", "not a finite number"]),
        (GOOD | {"abs_pos": 17}, ["--k", "16"], ["--k 16 differs from the K of 8"]),
    ],
)
def test_reanalyze_names_the_file_pivot_and_field_of_a_bad_record(tmp_path, capsys, pivot, extra, names):
    records = tmp_path / "bad.json"
    records.write_text(json.dumps({"config": {"k": 8}, "pivots": [GOOD, pivot]}))
    assert reanalyze.main([str(records), "--no-figures", "--out", str(tmp_path / "out"), *extra]) == 2
    err = capsys.readouterr().err
    for name in [str(records), *names]:
        assert name in err, err


# ------------------------------------------------------------------------------------ 13. pass order and hash


def test_the_order_of_replay_passes_changes_neither_the_settings_nor_the_hash():
    written = validate_config(with_setting(DEFAULT, "replay.passes", ["refeed", "selector", "exact", "replica"]))
    canonical = validate_config(with_setting(DEFAULT, "replay.passes", ["exact", "replica", "refeed", "selector"]))
    assert written == canonical
    assert analysis_hash(written) == analysis_hash(canonical)


@pytest.mark.parametrize(
    "provenance", sorted((REPO / "reference").rglob("provenance.json")), ids=lambda p: str(p.parent.relative_to(REPO))
)
def test_every_committed_reference_keeps_its_analysis_hash(provenance):
    recorded = read_json(provenance)
    assert analysis_hash(recorded["config"]) == recorded["analysis_hash"]
    shuffled = with_setting(recorded["config"], "replay.passes", list(reversed(recorded["config"]["replay"]["passes"])))
    assert analysis_hash(shuffled) == recorded["analysis_hash"]


# ------------------------------------------------------------------ 14. compare across configurations says so


def test_compare_across_different_settings_says_first_that_the_analysis_hashes_differ(tmp_path, capsys):
    ref = shutil.copytree(REPO / "reference" / "cpu", tmp_path / "ref")
    other = shutil.copytree(REPO / "reference" / "cpu", tmp_path / "other")
    provenance = json.loads((other / "provenance.json").read_text())
    provenance["analysis_hash"] = "0123456789abcdef"
    (other / "provenance.json").write_text(json.dumps(provenance))
    table = other / "tables" / "headline.csv"
    table.write_text(table.read_text().replace("0.", "1.", 1))
    for path in other.glob("analysis/*/comparison.json"):  # a run of other settings: its every record says so
        path.write_text(json.dumps({**json.loads(path.read_text()), "analysis_hash": "0123456789abcdef"}))
    manifest = other / "MANIFEST.sha256"
    manifest.write_text(
        "".join(
            f"{sha256_file(other / line.split(maxsplit=1)[1])}  {line.split(maxsplit=1)[1]}\n"
            if line.endswith(("tables/headline.csv", "comparison.json"))
            else line + "\n"
            for line in manifest.read_text().splitlines()
        )
    )
    assert reference.main(["compare", str(ref), str(other)]) == 1
    out = capsys.readouterr().out
    committed = read_json(ref / "provenance.json")["analysis_hash"]
    assert out.startswith(f"The analysis hashes differ ({ref}: {committed}, {other}: 0123456789abcdef)"), out
    assert "last-bit drift of the kernels" not in out
    assert reference.main(["compare", str(ref), str(ref)]) == 0
    assert "analysis hashes differ" not in capsys.readouterr().out


# ---------------------------------------------------------------------------- 12, platform: refused up front


def test_an_overlay_of_its_own_configs_is_told_the_default_runs_too():
    assert overlay_adds_default_configs([{"configs": {"mine": {}}}]) == ["smollm2-bf16"]
    assert overlay_adds_default_configs([{"configs": {"smollm2-bf16": {}}}]) == []
    assert overlay_adds_default_configs([{"dataset": {"n_problems": 4}}]) == []


def test_a_machine_without_the_gpu_or_vllm_is_named_before_any_job(tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = validate_config(with_setting(DEFAULT, "configs.smollm2-bf16.device", "cuda:1"))
    (tmp_path / "nvidia0").touch()
    assert any(
        "configs.smollm2-bf16.device: 'cuda:1'" in p and "1 NVIDIA GPU" in p
        for p in platform_problems(config, dev=tmp_path)
    )
    (tmp_path / "nvidia1").touch()
    assert platform_problems(config, dev=tmp_path) == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert platform_problems(config, dev=tmp_path)
    vllm = validate_config(with_setting(DEFAULT, "configs.smollm2-bf16.engine", "vllm"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert any(
        "configs.smollm2-bf16.engine: 'vllm', but vLLM is not installed" in p
        for p in platform_problems(vllm, dev=tmp_path)
    )
    assert platform_problems(vllm, conda=True, dev=tmp_path) == []


@pytest.mark.usefixtures("tiny_model")
def test_device_cuda_without_a_gpu_stops_the_run_before_any_job(tmp_path):
    if platform_problems(validate_config(with_setting(TINY, "configs.tiny.device", "cuda"))) == []:
        pytest.skip("this machine has a GPU")
    proc = snakemake(tmp_path, with_setting(TINY, "configs.tiny.device", "cuda"), check=False)
    assert proc.returncode != 0
    assert "configs.tiny.device: 'cuda'" in proc.stderr + proc.stdout
    assert not (tmp_path / "results" / "models").exists() and not (tmp_path / "results" / "problems").exists()


@pytest.mark.usefixtures("tiny_model")
def test_an_overlay_without_replace_workflow_config_warns_at_the_start(tmp_path):
    overlay = tmp_path / "mine.yaml"
    overlay.write_text(yaml.safe_dump({"configs": {"mine": TINY["configs"]["tiny"]}}))
    base = [*SNAKEMAKE, "--directory", str(tmp_path), "--cores", "1", "-n", "--configfile", str(overlay)]
    warned = subprocess.run(base, capture_output=True, text=True, timeout=600)
    assert warned.returncode == 0, warned.stderr[-2000:]
    assert "ALSO runs and pools the default configuration(s) ['smollm2-bf16']" in warned.stderr
    quiet = subprocess.run([*base, "--replace-workflow-config"], capture_output=True, text=True, timeout=600)
    assert quiet.returncode == 0 and "ALSO runs" not in quiet.stderr


# -------------------------------------------------------------------- 2. every lost output is rebuilt


@pytest.mark.slow  # twelve dry runs of the workflow
def test_every_kind_of_output_lost_between_runs_is_rebuilt_by_the_next_plain_run(tiny_run, tmp_path):
    """--forcerun deletes a step's outputs before running it; Ctrl-C then leaves them missing while everything
    downstream still exists. The next plain run must rebuild each, not say "Nothing to be done"."""
    run = clone_run(tiny_run, tmp_path / "run")
    assert planned_rules(run, TINY) == set()
    lost = {
        "results/credit/tiny/refeed.parquet": "compute_credit",
        "results/credit/tiny/exact.parquet": "compute_credit",
        "results/pivots/tiny.parquet": "select_pivots",
        "results/analysis/tiny/channels.csv": "compare_passes",
        "results/passes/tiny/exact.parquet": "gather_pass",
        "results/rollouts/tiny/rollouts.parquet": "gather_rollouts",
        "results/rollouts/tiny/kv.json": "index_kv",
        "results/analysis/pooled/comparison.json": "compare_pooled",
        "results/tables/headline.md": "headline_tables",
        "results/figures/disagreement.pdf": "figure_disagreement",
        "results/passes/tiny/exact/000.parquet": "replay_exact",
        "results/cost/cost.csv": "cost_report",
    }
    for path, rule in lost.items():
        kept = tmp_path / "kept"
        shutil.copy2(run / path, kept)
        (run / path).unlink()
        assert rule in planned_rules(run, TINY), path
        shutil.copy2(kept, run / path)


def test_the_sampling_step_records_the_digest_of_what_it_read(tmp_path, tiny_prepared):
    data = jsonl(
        tmp_path / "mine.jsonl", [{"question": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(3)]
    )
    config = with_setting(
        with_setting(with_setting(TINY, "dataset.source", "file"), "dataset.path", str(data)), "dataset.n_problems", 3
    )
    work = tmp_path / "work"
    seed_model(work, tiny_prepared)
    snakemake(work, config, "results/problems/file-mine.parquet")
    assert read_json(work / "results" / "problems" / "file-mine.read.json") == {
        "path": str(data),
        "sha256": sha256_file(data),
    }


@pytest.mark.slow  # three runs of the rollout step
def test_a_prompt_past_the_context_stops_the_rollout_step_by_file_and_line(tmp_path, tiny_prepared):
    """A question longer than the model's context (a 9,000-word one on SmolLM2's 8,192 positions ran for minutes
    and gave a graded answer) stops the rollout step before it generates anything; with rollouts.long_prompts:
    skip the step leaves it out and says so. The tiny model has 512 positions."""
    rows = [{"question": f"What is {i} plus 1?", "answer": str(i + 1)} for i in range(3)]
    rows[1]["question"] = "word " * 600 + "What is 1 plus 1?"
    data = jsonl(tmp_path / "mine.jsonl", rows)
    config = TINY
    for key, value in {"dataset.source": "file", "dataset.path": str(data), "dataset.sample": "first"}.items():
        config = with_setting(config, key, value)
    work = tmp_path / "work"
    seed_model(work, tiny_prepared)
    target = "results/rollouts/tiny/rollouts.parquet"
    assert snakemake(work, config, target, check=False).returncode != 0
    log = (work / "results" / "logs" / "generate_rollouts" / "tiny.000.log").read_text()
    assert re.search(rf"{re.escape(str(data))}:2: problem mine-1: \d{{3,}} prompt tokens", log), log[-2000:]
    assert "configuration tiny: 1 prompt(s) and their 24 rollout tokens" in log and "512-position context" in log
    skip = with_setting(config, "rollouts.long_prompts", "skip")
    snakemake(work, skip, target)
    assert pl.read_parquet(work / target)["problem_id"].unique(maintain_order=True).to_list() == ["mine-0", "mine-2"]
    assert "skipped 1 of 2 problems" in (work / "results" / "logs" / "generate_rollouts" / "tiny.000.log").read_text()
