"""The HF engine: decode-time KV capture, verification and the passes. The claims about a real model's numbers
run on SmolLM2-135M (bf16, CPU); the passes' mechanics (schedules, resume, seeds, what each pass asks for) on
the tiny model, where they take a second rather than a minute."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
import torch
from helpers import REPO, branch_requests, configuration, hf_engine, pass_job, rollout_job

from replaynoise.analysis.channels import assert_all_identical, channel_agreement
from replaynoise.analysis.credit import compute_credit
from replaynoise.analysis.prefix_mismatch import mismatch_rows
from replaynoise.data.datasets import load_problems, sample_problems
from replaynoise.engines import make_engine
from replaynoise.engines.base import (
    RolloutRequest,
    SamplingSettings,
    VerificationError,
)
from replaynoise.engines.hf.kvfiles import load_kv, save_kv
from replaynoise.generation import continuations, replay, rollouts
from replaynoise.generation.pivots import PivotRules, select_pivots
from replaynoise.io import sha256_file

SEED = 7
K = 2
ROLLOUT = SamplingSettings(temperature=0.7, top_p=1.0, max_new_tokens=24)
CONTINUE = SamplingSettings(temperature=0.7, top_p=1.0, max_new_tokens=12)


def engine_for(model_dir: Path, kernels: str = "stock", dtype: str = "bfloat16"):
    return make_engine(configuration(kernels=kernels, dtype=dtype), model_dir, topk=5, threads=2)


def campaign(
    model_dir: Path,
    out: Path,
    kernels: str,
    n_problems: int = 3,
    per_rollout: int = 2,
    rules: PivotRules | None = None,
    dtype: str = "bfloat16",
):
    """Rollouts and pivots of a few easy problems: what every pass test starts from."""
    engine = engine_for(model_dir, kernels, dtype)
    problems = sample_problems(load_problems("simple_addsub", None, out), n_problems, SEED)
    rules = rules or PivotRules(max_margin=0.3, per_rollout=per_rollout)
    frame = rollouts.generate(
        engine,
        problems,
        rollout_job(kernels, SEED, ROLLOUT, rules, batch_size=2),
        kv_dir=out / "kv",
        work_dir=out / "work",
    )
    pivots = select_pivots(frame, rules, seed=SEED, config_name=kernels)
    assert pivots.height >= 2, "too few pivots to test anything: raise max_margin or the problem count"
    return engine, frame, pivots


def run(engine, frame, pivots, pass_name: str, work: Path, batch_size: int = 8, serial_pivots: int = 2) -> pl.DataFrame:
    job = pass_job(
        pass_name, "t", SEED, CONTINUE, k=K, batch_size=batch_size, sample_sizes={"serial_pivots": serial_pivots}
    )
    return replay.run_pass(engine, pivots, frame, job, work_dir=work / pass_name)


@pytest.fixture(scope="session")  # not module: under pytest -n other modules' tests run between these
def stock(smollm2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("stock")
    engine, frame, pivots = campaign(smollm2_dir, out, "stock")
    return engine, frame, pivots, out


#: The tiny model answers in digits only: its pivots lie inside the answer span, at any margin.
TINY_RULES = PivotRules(max_margin=1.0, per_rollout=2, exclude_answer_span=False)


@pytest.fixture(scope="session")
def tiny_stock(tiny_prepared, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-stock")
    engine, frame, pivots = campaign(tiny_prepared, out, "stock", rules=TINY_RULES)
    return engine, frame, pivots, out


def test_rollouts_hold_real_continuations_and_kv(stock):
    engine, frame, pivots, _ = stock
    assert frame.height == 3
    assert all(len(ids) > 0 for ids in frame["response_ids"])
    assert all(len(top) == len(ids) for top, ids in zip(frame["topk_ids"], frame["response_ids"]))
    assert all(any(c.isalpha() for c in text) for text in frame["text"])  # real text, not ids or blanks
    # KV is kept only as far as the last candidate pivot needs, and pivots lie inside it
    for p in pivots.iter_rows(named=True):
        row = frame.filter(pl.col("problem_id") == p["problem_id"]).row(0, named=True)
        assert p["prefix_len"] <= row["kv_len"] < len(row["prompt_ids"]) + len(row["response_ids"])


def test_stored_kv_round_trips_bitwise(stock, tmp_path):
    _, frame, _, _ = stock
    path = frame.filter(pl.col("kv_file").is_not_null())["kv_file"][0]
    layers = load_kv(path, device="cpu")
    assert layers[0][0].dtype == torch.bfloat16  # native dtype, not upcast
    again = tmp_path / "again.safetensors"
    digest = save_kv(layers, layers[0][0].shape[-2], again)
    assert digest == sha256_file(again)  # hashed from the bytes written: the file's own checksum
    for (k1, v1), (k2, v2) in zip(layers, load_kv(again, digest, device="cpu")):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_exact_resume_reproduces_rollout_logits_bitwise(stock):
    engine, frame, pivots, _ = stock
    requests = continuations.build_requests(pivots, frame, pass_name="exact", k=1, seed=SEED, config_name="t")
    for req in requests[::2]:  # one request per pivot
        state = engine.prefix_state(req, "decode_kv")
        assert state.verified, f"pivot {req.pivot_id}: stored KV did not reproduce the rollout's logits"


def test_refeed_differs_from_exact_on_bf16(stock):
    engine, frame, pivots, out = stock
    exact = run(engine, frame, pivots, "exact", out)
    refeed = run(engine, frame, pivots, "refeed", out)
    assert exact["verified"].all()
    # the re-fed prefix KV is not the decode-time KV ...
    maxdiff = refeed["kv_maxdiff"].list.max()
    assert (maxdiff > 0).any()
    # ... and the next-token distribution after the branch token moves with it
    joined = exact.join(refeed, on=["pivot_id", "branch", "k"], suffix="_r")
    assert (joined["next_digest"] != joined["next_digest_r"]).any()


def test_common_random_numbers_make_two_runs_of_a_pass_bitwise_equal(tiny_stock, tiny_prepared, tmp_path):
    _, frame, pivots, _ = tiny_stock
    first = run(engine_for(tiny_prepared), frame, pivots, "replica", tmp_path / "a")
    second = run(engine_for(tiny_prepared), frame, pivots, "replica", tmp_path / "b")
    assert first.equals(second)


def test_replica_meets_other_batch_compositions(tiny_stock):
    _, frame, pivots, _ = tiny_stock
    n = 2 * K * pivots.height
    exact = continuations.make_schedule(n, 4, continuations.schedule_seed(SEED, "t", "exact"))
    replica = continuations.make_schedule(n, 4, continuations.schedule_seed(SEED, "t", "replica"))
    assert sorted(map(sorted, exact)) != sorted(map(sorted, replica))
    assert sorted(i for b in replica for i in b) == list(range(n))


def test_the_restep_channel_is_measured_once_per_pivot_on_its_first_scheduled_row(tiny_stock, tmp_path):
    engine, frame, pivots, _ = tiny_stock
    exact = run(engine, frame, pivots, "exact", tmp_path, batch_size=4)
    measured = exact.filter(pl.col("restep_match").is_not_null())
    assert sorted(measured["pivot_id"]) == sorted(pivots["pivot_id"])  # one row per pivot, every pivot
    first = (
        exact.sort("batch_id")
        .group_by("pivot_id", maintain_order=True)
        .agg(pl.col("batch_id").first().alias("first_batch"))
    )
    assert measured.join(first, on="pivot_id").select((pl.col("batch_id") == pl.col("first_batch")).all()).item()
    # the rows the pass asks for are fixed by the whole schedule, so a shard or a resume asks for the same ones
    requests = continuations.build_requests(pivots, frame, pass_name="exact", k=K, seed=SEED, config_name="t")
    schedule = continuations.make_schedule(len(requests), 4, continuations.schedule_seed(SEED, "t", "exact"))
    asked = replay.with_restep_once(requests, schedule)
    assert sum(r.restep for r in asked) == pivots.height
    assert not any(r.restep for r in replay.with_restep_once(requests, []))  # probes: none


def test_a_pass_logs_where_its_time_went(tiny_stock, tmp_path, capsys):
    engine, frame, pivots, _ = tiny_stock
    run(engine, frame, pivots, "refeed", tmp_path, batch_size=4)
    line = [x for x in capsys.readouterr().err.splitlines() if "time by phase" in x][-1]
    assert all(phase in line for phase in ("prefix states", "decode", "grade", "write (beside the engine)"))


def test_the_rollout_step_logs_its_host_work_apart_from_the_engines(tiny_prepared, tmp_path, capsys):
    """Choosing each row's pivots (the answer span decoded every prefix of the response before 74c8e67) and building
    the records are phases of their own: on the 7B shape they took 1.6 s of a 64-row batch that no phase showed
    (benchmarks/results/rollouts-compiled-2026-12-07/)."""
    campaign(tiny_prepared, tmp_path, "stock", rules=TINY_RULES)
    line = [x for x in capsys.readouterr().err.splitlines() if "rollouts stock: time by phase" in x][-1]
    assert all(f"{phase} " in line for phase in ("generate", "choose pivots", "store KV", "records"))
    assert "KV to host" not in line  # the CPU's cache is copied by no pinned buffer


def test_the_engine_module_imports_transformers_model_machinery_in_the_imports_phase():
    """The engine factory times importing the engine's module as "imports" and loading the model as "model load";
    transformers' model machinery (modeling_utils and the auto classes: seconds on a GPU machine's image) must load
    with the module, or the log counts it as model load, where it was taken for slow weights
    (benchmarks/results/weight-load-2026-12-07/): what load_weights imports is there already."""
    code = (
        "import sys, replaynoise.engines.hf.engine; before = set(sys.modules); "
        "from transformers import AutoModelForCausalLM; "
        "print('transformers.modeling_utils' in before, sorted(set(sys.modules) - before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.split() == ["True", "[]"]


def test_interrupted_pass_resumes_without_redoing_batches(tiny_stock, tmp_path):
    engine, frame, pivots, _ = tiny_stock
    whole = run(engine, frame, pivots, "exact", tmp_path / "whole", batch_size=4)
    work = tmp_path / "resumed" / "exact"
    run(engine, frame, pivots, "exact", tmp_path / "resumed", batch_size=4)
    kept = sorted(work.glob("batch_*.parquet"))
    assert len(kept) >= 2
    for path in kept[1:]:  # as if killed after the first batch
        path.unlink()
    marker = kept[0].stat().st_mtime_ns
    resumed = run(engine, frame, pivots, "exact", tmp_path / "resumed", batch_size=4)
    assert kept[0].stat().st_mtime_ns == marker  # the finished batch was not redone
    assert resumed.equals(whole)


def test_corrupted_kv_file_is_detected_and_named(stock, tmp_path):
    engine, frame, pivots, _ = stock
    row = frame.filter(pl.col("kv_file").is_not_null()).row(0, named=True)
    bad = tmp_path / "bad.safetensors"
    data = bytearray(Path(row["kv_file"]).read_bytes())
    data[-7] ^= 0x01  # flip one bit inside the tensor data
    bad.write_bytes(bytes(data))
    with pytest.raises(VerificationError, match="bad.safetensors"):
        load_kv(bad, row["kv_sha256"], device="cpu")
    # without a recorded checksum, a changed value inside the prefix shows in the re-step channel
    pivot = pivots.filter(pl.col("problem_id") == row["problem_id"]).row(0, named=True)
    layers = load_kv(row["kv_file"], device="cpu")
    keys = layers[3][0].clone()
    keys[0, 0, pivot["prefix_len"] - 2, 0] = torch.nextafter(
        keys[0, 0, pivot["prefix_len"] - 2, 0], torch.tensor(float("inf"), dtype=keys.dtype)
    )
    layers[3] = (keys, layers[3][1])
    tampered = tmp_path / "tampered.safetensors"
    save_kv(layers, keys.shape[-2], tampered)
    requests = continuations.build_requests(
        pl.DataFrame([pivot]),
        frame.with_columns(kv_file=pl.lit(str(tampered)), kv_sha256=pl.lit(None, pl.Utf8)),
        pass_name="exact",
        k=1,
        seed=SEED,
        config_name="t",
    )
    assert engine_for_same(engine).prefix_state(requests[0], "decode_kv").restep_match is False
    # a KV file computed from other token ids than the pivot's prefix is not the decode-time state
    ids = list(requests[0].prefix_ids)
    ids[5] += 1
    save_kv(layers, keys.shape[-2], tampered, ids=ids)
    assert not engine_for_same(engine).prefix_state(requests[0], "decode_kv").verified
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(VerificationError, match="truncated.safetensors"):
        load_kv(truncated, device="cpu")


def engine_for_same(engine):
    """A second engine on the same model, with empty prefix-state caches."""
    from helpers import hf_engine

    return hf_engine(engine.model, engine.tokenizer, kernels="stock", topk=engine.topk)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_invariant_mode_makes_all_passes_bitwise_identical(tiny_prepared, tmp_path, dtype):
    """The three passes, the re-feed's replica and the serial pass (one request per batch, on a sample of the
    pivots): under invariant kernels every channel of every pair is the same bit for bit, on the tiny model in bf16
    and in float32, where stock kernels move every re-fed prefix's KV (the control,
    ``test_stock_kernels_move_the_refed_kv_that_invariant_kernels_keep``; how far stock kernels move a real model's
    tokens in bf16: ``test_refeed_differs_from_exact_on_bf16`` on SmolLM2)."""
    engine, frame, pivots = campaign(tiny_prepared, tmp_path, "invariant", n_problems=3, rules=TINY_RULES, dtype=dtype)
    passes = {
        name: run(engine, frame, pivots, name, tmp_path, batch_size=3)
        for name in ("exact", "replica", "refeed", "refeed_replica", "serial")
    }
    assert set(passes["serial"]["batch_size"]) == {1}
    credit = {name: compute_credit(df, pivots, K, name, "graded") for name, df in passes.items()}
    agreement = channel_agreement(passes, credit)
    assert set(agreement["channel"]) >= {"token_ids", "answer", "correct", "next_topk", "a_hat"}
    assert_all_identical(agreement)
    assert passes["exact"]["next_digest"].equals(passes["refeed"]["next_digest"])
    kv = [max(d) for d in passes["refeed"]["kv_maxdiff"] if d is not None]
    assert kv and set(kv) == {0.0}
    # the prefix mismatch channel: every re-fed prefix token's log-prob is its decode-time one, bit for bit
    mismatch = mismatch_rows(frame, pivots, passes)
    assert set(mismatch["pass"]) == {"refeed", "refeed_replica"}
    assert mismatch.height == 2 * pivots.height and set(mismatch["share_identical"].drop_nulls()) == {1.0}
    assert set(mismatch["k3_kl"].drop_nulls()) == set(mismatch["rollout_probs_diff_max"].drop_nulls()) == {0.0}


def test_stock_kernels_move_the_refed_kv_that_invariant_kernels_keep(tiny_prepared, tmp_path):
    """The control of the invariant test: the same problems, seed and rules under stock kernels, in float32, where
    a prefill's GEMMs block their sums otherwise than a decode step's, so that the re-fed prefixes' KV moves from
    the decode-time KV: the invariant mode's zero is the kernels' doing. In bf16 the tiny model's moves mostly round
    away, so whether any shows depends on the CPU's GEMM (on an AVX2 EPYC: none of 16 rows of 3 problems, 2 of 36
    of 8; each of the 16 in float32)."""
    engine, frame, pivots = campaign(tiny_prepared, tmp_path, "stock", n_problems=3, rules=TINY_RULES, dtype="float32")
    refeed = run(engine, frame, pivots, "refeed", tmp_path, batch_size=3)
    kv = [max(d) for d in refeed["kv_maxdiff"] if d is not None]
    assert kv and max(kv) > 0.0


def test_serial_pass_runs_one_request_at_a_time_on_a_seeded_sample(tiny_stock, tmp_path):
    """serial: exact resume with batches of one request, on serial_pivots pivots chosen by the seed alone (the
    same sample on a rerun and on a resume), every row verified; its channels are compared with exact's rows of
    those pivots only."""
    engine, frame, pivots, _ = tiny_stock
    serial = run(engine, frame, pivots, "serial", tmp_path / "a", batch_size=8, serial_pivots=2)
    assert set(serial["batch_size"]) == {1} and serial["verified"].all()
    assert serial["pivot_id"].n_unique() == 2 and serial.height == 2 * 2 * K
    again = run(engine, frame, pivots, "serial", tmp_path / "b", batch_size=8, serial_pivots=2)
    assert again["pivot_id"].equals(serial["pivot_id"]) and again["token_ids"].equals(serial["token_ids"])
    exact = run(engine, frame, pivots, "exact", tmp_path / "a")
    credit = {
        name: compute_credit(df, pivots, K, name, "graded") for name, df in (("exact", exact), ("serial", serial))
    }
    assert credit["serial"]["eligible"].sum() <= 2  # pivots outside the sample: no rows, not eligible
    agreement = channel_agreement({"exact": exact, "serial": serial}, credit)
    present = agreement.filter(pl.col("channel") == "rows_present")
    assert present["share_identical"].to_list() == [1.0] and present["n"].to_list() == [2 * 2 * K]
    with pytest.raises(ValueError, match="serial_pivots"):
        replay.run_pass(
            engine, pivots, frame, pass_job("serial", "t", SEED, CONTINUE, k=K, batch_size=8), work_dir=tmp_path / "c"
        )


def test_refeed_replica_is_the_refeed_again_in_other_batches(tiny_stock, tmp_path):
    """refeed_replica: the same requests and noise as refeed, packed by its own schedule seed, its prefixes
    prefilled anew (the prefix_source column names the tag that keeps them apart in a shared cache)."""
    engine, frame, pivots, _ = tiny_stock
    refeed = run(engine, frame, pivots, "refeed", tmp_path, batch_size=3)
    again = run(engine, frame, pivots, "refeed_replica", tmp_path, batch_size=3)
    assert set(again["prefix_source"]) == {"refeed_ids#replica"} and set(refeed["prefix_source"]) == {"refeed_ids"}
    assert again["seed"].equals(refeed["seed"])
    assert set(again["schedule_seed"]) != set(refeed["schedule_seed"])


def test_refeed_text_pass_retokenizes_the_prefix_text(tiny_stock):
    engine, frame, pivots, out = tiny_stock
    requests = continuations.build_requests(
        pivots, frame, pass_name="refeed_text", k=1, seed=SEED, config_name="t", tokenizer=engine.tokenizer
    )
    for req in requests:
        assert req.text_prefix_ids is not None
        decode = engine.tokenizer.decode
        assert decode(list(req.text_prefix_ids)) == decode(list(req.prefix_ids))
    rows = run(engine, frame, pivots, "refeed_text", out)
    assert rows.height == 2 * K * pivots.height
    assert (rows["prefix_source"] == "refeed_text").all()
    # common random numbers: same seeds as the other passes
    exact = run(engine, frame, pivots, "exact", out / "again")
    assert rows.sort("pivot_id", "branch", "k")["seed"].equals(exact["seed"])


def test_refeed_cached_runs_in_the_refeeds_batches_over_cached_prompts(tiny_stock, tmp_path):
    """refeed_cached through the pass machinery: the re-feed's requests, seeds and batch layout, each row's prompt
    counted as served from cache and the rest as its recomputed tail, its prefix tokens scored, compared with exact
    and refeed in every channel."""
    engine, frame, pivots, _ = tiny_stock
    passes = {
        name: run(engine, frame, pivots, name, tmp_path, batch_size=3) for name in ("exact", "refeed", "refeed_cached")
    }
    cached, refeed = (passes[name].sort("pivot_id", "branch", "k") for name in ("refeed_cached", "refeed"))
    assert set(cached["prefix_source"]) == {"refeed_ids+prompt:cached"} and cached.height == refeed.height
    assert cached["seed"].equals(refeed["seed"]) and cached["schedule_seed"].equals(refeed["schedule_seed"])
    prompts = frame.select("problem_id", pl.col("prompt_ids").list.len().alias("prompt_len")).unique("problem_id")
    lens = cached.join(pivots.select("pivot_id", "problem_id"), on="pivot_id").join(prompts, on="problem_id")
    assert lens["cached_tokens"].equals(lens["prompt_len"].alias("cached_tokens"))
    credit = {name: compute_credit(df, pivots, K, name, "graded") for name, df in passes.items()}
    agreement = channel_agreement(passes, credit)
    pairs = agreement.filter(pl.col("pass_b") == "refeed_cached")
    assert set(pairs["pass_a"]) == {"exact", "refeed"} and {"token_ids", "next_topk", "a_hat"} <= set(pairs["channel"])
    present = pairs.filter(pl.col("channel") == "rows_present")
    assert present["share_identical"].to_list() == [1.0, 1.0]
    mismatch = mismatch_rows(frame, pivots, passes)
    assert mismatch.filter(pl.col("pass") == "refeed_cached").height == pivots.height


def test_equal_caches_give_byte_identical_kv_files(tiny_stock, tmp_path):
    """The manifest compares runs by checksum, so a stored cache must not carry run-to-run noise
    (safetensors writes metadata in hash-map order, which changes from one save to the next)."""
    _, frame, _, _ = tiny_stock
    layers = load_kv(frame.filter(pl.col("kv_file").is_not_null())["kv_file"][0], device="cpu")
    copies = set()
    for i in range(16):
        out = tmp_path / f"copy{i}.safetensors"
        save_kv(layers, layers[0][0].shape[-2], out)
        copies.add(out.read_bytes())
    assert len(copies) == 1


def test_sampler_noise_is_per_row_and_the_pruned_form_is_exact():
    from replaynoise.engines.sampling import sample_rows

    gen = torch.Generator().manual_seed(0)
    seeds, steps = torch.randint(0, 2**62, (64,), generator=gen), torch.randint(0, 99, (64,), generator=gen)
    for temperature, top_p, scale in ((0.7, 1.0, 3.0), (1.0, 0.9, 1.0), (0.3, 1.0, 10.0)):
        logits = torch.randn(64, 3000, generator=gen) * scale
        logits[:, 7] = logits[:, 3]  # a tie: both forms must take the lower index
        full = sample_rows(logits, seeds, steps, temperature, top_p, exhaustive=True)
        assert torch.equal(full, sample_rows(logits, seeds, steps, temperature, top_p))
        alone = torch.cat(
            [
                sample_rows(logits[i : i + 1], seeds[i : i + 1], steps[i : i + 1], temperature, top_p)
                for i in range(0, 64, 9)
            ]
        )
        assert torch.equal(alone, full[::9])  # a row's token does not depend on its batch
    # Gumbel-max samples the softmax: frequencies over many seeds match it
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(20000, 4)
    tokens = sample_rows(logits, torch.arange(20000), torch.zeros(20000, dtype=torch.int64), 1.0, 1.0)
    assert torch.allclose(torch.bincount(tokens, minlength=4) / 20000, torch.softmax(logits[0], 0), atol=0.01)


def test_every_nucleus_form_keeps_the_exact_nucleus_and_ties_together():
    """Every form of the top-p filter (the sort, and the threshold's search at 2 ways, the bisection, and at 3, 4
    and 16 ways, as the compiled sampler runs it) keeps exactly the tokens a float64 computation keeps (every
    token whose strictly better tokens hold less than top_p), with ties kept whole; a float32 cumulative sum over
    the sorted row, the usual form, moves the edge by several tokens per row over a long tail."""
    from replaynoise.engines.sampling import nucleus_by_bisection, nucleus_by_search, nucleus_by_sorting, search_passes

    forms = {"sorting": nucleus_by_sorting, "bisection": nucleus_by_bisection}
    forms |= {f"{w} ways": functools.partial(nucleus_by_search, ways=w) for w in (3, 4, 16)}
    assert [search_passes(w) for w in (2, 3, 4, 16)] == [30, 19, 15, 8]
    with pytest.raises(ValueError, match="at least 2 ways, not 1"):
        search_passes(1)

    def float64_dropped(scores, top_p):
        probs = torch.softmax(scores.double(), dim=-1)
        above = torch.stack(
            [(probs[r] * (scores[r][None, :] > scores[r][:, None])).sum(-1) for r in range(scores.shape[0])]
        )
        return above >= top_p

    gen = torch.Generator().manual_seed(0)
    for scale, top_p, dtype in (
        (0.01, 0.5, torch.float32),
        (1.0, 0.95, torch.float32),
        (3.0, 0.999, torch.float32),
        (30.0, 0.9, torch.float32),
        (2.0, 0.95, torch.bfloat16),
        (6.0, 0.95, torch.bfloat16),
        (2.0, 0.1, torch.float32),
    ):
        # bf16 logits, as a bf16 model's, hold many equal values: the nucleus's edge often cuts a tie
        scores = (torch.randn(8, 3000, generator=gen) * scale).to(dtype).to(torch.float32)
        scores[0, :1500] = scores[0, 0]  # a tie across half the row
        scores[1, :] = 0.0  # a flat row
        expected = float64_dropped(scores, top_p)
        for name, form in forms.items():
            kept = torch.isfinite(form(scores, top_p))
            assert torch.equal(~kept, expected), (name, scale, top_p, dtype)
            assert kept.sum(-1).min() >= 1
    for form in forms.values():
        # four equal tokens, each 0.25 of the mass: a 0.3 nucleus keeps all of them, not the first two
        assert torch.isfinite(form(torch.zeros(1, 4), 0.3)).all()
        scores = torch.tensor([[2.0, 1.0, 1.0, -5.0]])
        assert torch.isfinite(form(scores, 0.7)).tolist() == [[True, True, True, False]]
        assert torch.isfinite(form(scores, 0.5)).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_static_decode_matches_the_dynamic_decode(family, tmp_path):
    """The GPU fast path's step (static KV, grouped attention, on-device sampling), run eagerly on CPU in fp32,
    gives the same tokens and first-step logits as HF's own forward with a DynamicCache."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    vocab = 512
    shape = dict(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=vocab - 1,
    )
    torch.manual_seed(0)
    model = (
        LlamaForCausalLM(LlamaConfig(**shape))
        if family == "llama"
        else Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))
    ).eval()
    tok = SimpleNamespace(eos_token_id=vocab - 1)
    dynamic, static = hf_engine(model, tok, decode="dynamic"), hf_engine(model, tok, decode="static")
    sampling = SamplingSettings(1.0, 1.0, 16)
    (r,) = dynamic.generate_rollouts(
        [RolloutRequest("p", tuple(range(1, 30)), 5)],
        sampling,
        tmp_path,
        lambda ro: len(ro.prompt_ids) + len(ro.response_ids) - 1,
    )
    requests = branch_requests(r, range(2, len(r.response_ids) - 1, 4), k=3)
    a, b = dynamic.run_batch(requests, "decode_kv", sampling), static.run_batch(requests, "decode_kv", sampling)
    assert all(x.verified for x in a)
    assert [x.token_ids for x in a] == [y.token_ids for y in b]
    for x, y in zip(a, b):
        assert x.next_topk_ids == y.next_topk_ids
        assert max(abs(u - v) for u, v in zip(x.next_topk_logprobs, y.next_topk_logprobs)) < 1e-4


def test_static_layer_functions_match_the_layer_modules_bitwise_with_fp32_matmul():
    """The static decode's layer functions (compiled on CUDA, eager here) compute what the model's own modules
    compute, including the float32 GEMMs that cpu_matmul: fp32 swaps in for bf16 linear layers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from replaynoise.engines.hf.cpu_matmul import use_fp32_matmul
    from replaynoise.engines.hf.kernels import layer_in, layer_out, linear
    from replaynoise.engines.hf.static import StaticDecoder

    torch.manual_seed(0)
    model = (
        Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=64,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        )
        .to(torch.bfloat16)
        .eval()
    )
    assert use_fp32_matmul(model) == 7 + 1  # q, k, v, o, gate, up, down and the LM head
    assert use_fp32_matmul(model) == 0  # a second engine on the same model wraps nothing again
    layer = model.model.layers[0]
    w_in, w_out, (eps, fp32) = StaticDecoder._layer_weights(layer)
    assert fp32
    rows, heads, kv_heads, dim = 3, 4, 2, 16
    h = torch.randn(rows, 1, 64).to(torch.bfloat16)
    with torch.inference_mode():
        x = layer.input_layernorm(h)
        ones = torch.ones(rows, 1, 1, dim, dtype=torch.bfloat16)
        zeros = torch.zeros(rows, 1, 1, dim, dtype=torch.bfloat16)
        q, k, v = layer_in(h, ones, zeros, *w_in, eps, fp32, rows, heads, kv_heads, dim)  # RoPE at angle 0
        assert torch.equal(q, layer.self_attn.q_proj(x).view(rows, 1, heads, dim).transpose(1, 2))
        assert torch.equal(v, layer.self_attn.v_proj(x).view(rows, 1, kv_heads, dim).transpose(1, 2))
        o = torch.randn(rows, kv_heads, heads // kv_heads, dim).to(torch.bfloat16)
        mid = h + layer.self_attn.o_proj(o.reshape(rows, 1, heads * dim))
        expected = mid + layer.mlp(layer.post_attention_layernorm(mid))
        assert torch.equal(layer_out(h, o, *w_out, eps, fp32, rows, heads * dim), expected)
        plain = torch.nn.Linear(64, 8).to(torch.bfloat16)
        assert torch.equal(linear(x, plain.weight, plain.bias, False), plain(x))
