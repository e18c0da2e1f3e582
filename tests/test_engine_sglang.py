"""The SGLang engine (issue 55). On CPU: its settings (SGLang's defaults, recorded and hashed), the refusals by key,
the missing package refused before any job, and the engine's own logic over a stand-in for ``sglang.Engine`` that
keeps a prefix cache as SGLang's radix tree does. On an NVIDIA GPU with SGLang installed (``.venv-sglang-cuda``):
the exact pass reads the decode-time state, re-feeds miss it, and the deterministic mode is exactly zero."""

from __future__ import annotations

import copy
import fcntl
import functools
import importlib
import importlib.util
import logging
import multiprocessing
import os
import random
import runpy
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import yaml
from helpers import configuration

from replaynoise.config import analysis_hash, validate_config
from replaynoise.engines.base import ContinuationRequest, RolloutRequest, SamplingSettings, VerificationError
from replaynoise.engines.recipes import chained_digests, read_recipe
from replaynoise.engines.sglang import engine as sglang_engine
from replaynoise.engines.sglang import plugin
from replaynoise.engines.sglang.engine import EngineError, SGLangEngine, described, engine_kwargs
from replaynoise.engines.sglang.launch import (
    NUMERIC,
    PROBE,
    check_seeded,
    checked_pool,
    checked_server_args,
    logging_kept,
    start_lock,
)
from replaynoise.fingerprint import environment_fingerprint
from replaynoise.machine import platform_problems
from replaynoise.settings import ConfigError

BASE = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "config.yaml").read_text())


def sglang_config(**given) -> dict:
    config = copy.deepcopy(BASE)
    config["configs"] = {"s": {"model": "smollm2-135m", "engine": "sglang", "kernels": "invariant", "device": "cuda"}}
    config["configs"]["s"].update(given)
    return config


# ------------------------------------------------------------------------------------------- settings
def test_the_sglang_block_holds_sglangs_own_defaults_and_enters_the_analysis_hash():
    settings = validate_config(sglang_config())["configs"]["s"]
    assert settings["sglang"] == {
        "attention_backend": None,
        "chunked_prefill_size": None,
        "context_length": None,
        "disable_cuda_graph": False,
        "disable_radix_cache": False,
        "max_running_requests": None,
        "mem_fraction_static": None,
        "page_size": 1,
    }
    base = analysis_hash(validate_config(sglang_config()))
    assert analysis_hash(validate_config(sglang_config(sglang={"chunked_prefill_size": 4096}))) != base
    assert analysis_hash(validate_config(sglang_config(sglang={"page_size": 1}))) == base  # the default, written out


def test_the_engine_gets_the_keys_given_and_the_deterministic_mode():
    settings = validate_config(sglang_config(sglang={"attention_backend": "triton", "max_running_requests": 64}))
    kwargs = engine_kwargs(settings["configs"]["s"])
    assert kwargs["attention_backend"] == "triton" and kwargs["max_running_requests"] == 64
    assert kwargs["enable_deterministic_inference"] is True and kwargs["page_size"] == 1
    assert kwargs["sampling_backend"] == "pytorch"  # the sampler that takes per-request seeds with top-p
    assert "mem_fraction_static" not in kwargs  # null: SGLang's own default, not passed


def test_stock_kernels_are_sglangs_own_with_seeded_sampling():
    settings = validate_config(sglang_config(kernels="stock"))["configs"]["s"]
    kwargs = engine_kwargs(settings)
    assert kwargs["enable_deterministic_inference"] is False and kwargs["sampling_backend"] == "pytorch"
    assert analysis_hash(validate_config(sglang_config(kernels="stock"))) != analysis_hash(
        validate_config(sglang_config())
    )


def test_the_installed_package_declares_its_sglang_plugin():
    """The entry point SGLang's plugin loader reads, as pyproject.toml declares it (an editable install makes it)."""
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    target = project["entry-points"]["sglang.srt.plugins"]["replaynoise_seeded_sampling"]
    module, function = target.split(":")
    assert getattr(importlib.import_module(module), function) is plugin.register


SCRIPT = """
import multiprocessing, sys
sys.path.insert(0, {repo!r})
from replaynoise.engines.sglang.launch import children_import_plugin
print("script body", flush=True)
probe = "import sys; m = sys.modules['__mp_main__']; print('child main', m.__file__.rsplit('/', 1)[-1], flush=True)"
child = multiprocessing.get_context("spawn").Process(target=exec, args=(probe,))
if {safe}:
    with children_import_plugin():
        child.start()
else:
    child.start()
child.join()
print("main spec", getattr(sys.modules["__main__"].__spec__, "name", None), flush=True)
"""


@pytest.mark.parametrize(("safe", "as_module"), [(True, False), (True, True), (False, False)])
def test_sglangs_spawned_processes_import_the_plugin_not_the_script_that_started_them(tmp_path, safe, as_module):
    """A Snakemake script is a file without a __main__ guard; SGLang spawns its scheduler. Unguarded, the spawned child
    runs the script again (and would build a second engine); under children_import_plugin it imports the plugin
    module instead (which hooks its sampling there), and the main module's spec is restored: none for a file, its own
    for a module run with -m (pytest's, say)."""
    (tmp_path / "script.py").write_text(SCRIPT.format(repo=str(Path(__file__).resolve().parents[1]), safe=safe))
    command = [sys.executable, "-m", "script"] if as_module else [sys.executable, str(tmp_path / "script.py")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if safe:
        assert run.returncode == 0, run.stderr
        spec = "script" if as_module else "None"
        assert run.stdout.splitlines() == ["script body", "child main plugin.py", f"main spec {spec}"]
    else:
        assert run.stdout.count("script body") == 2  # the child ran the script's body again


# runpy warns that the module is already imported (by this test file): a spawned process imports it fresh
@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
def test_the_plugin_registers_its_hook_when_a_spawned_process_imports_it_first(monkeypatch):
    registry = Registry()
    hook_registry = SimpleNamespace(HookRegistry=registry, HookType=SimpleNamespace(AFTER="after"))
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins.hook_registry", hook_registry)
    monkeypatch.setenv(plugin.SEEDED, "1")
    runpy.run_module("replaynoise.engines.sglang.plugin", run_name="__mp_main__")
    assert [(target, kind) for target, _, kind in registry.hooks] == [(plugin.TARGET, "after")]
    monkeypatch.setenv(plugin.SEEDED, "0")  # the deterministic mode: nothing to hook
    runpy.run_module("replaynoise.engines.sglang.plugin", run_name="__mp_main__")
    assert len(registry.hooks) == 1


# ------------------------------------------------------------------------------------------- the plugin
class Registry:
    def __init__(self) -> None:
        self.hooks = []

    def register(self, target, hook, hook_type):
        self.hooks.append((target, hook, hook_type))


def test_the_plugin_hooks_only_where_the_engine_asks(monkeypatch):
    registry = Registry()
    monkeypatch.delenv(plugin.SEEDED, raising=False)
    assert plugin.register(registry, "after") is False and registry.hooks == []
    monkeypatch.setenv(plugin.SEEDED, "0")  # the deterministic mode seeds by itself
    assert plugin.register(registry, "after") is False
    monkeypatch.setenv(plugin.SEEDED, "1")
    assert plugin.register(registry, "after") is True
    ((target, hook, hook_type),) = registry.hooks
    assert target.endswith("SamplingBatchInfo.from_schedule_batch") and hook_type == "after"


class BatchInfo:
    """SGLang's ``SamplingBatchInfo``, as far as the hook sees it: a classmethod that builds a batch's info."""

    seeds = None

    @classmethod
    def from_schedule_batch(cls, batch, vocab_size):
        return SimpleNamespace(sampling_seed=cls.seeds, vocab_size=vocab_size)


def hooked_as_sglang_does(hook):
    """``BatchInfo.from_schedule_batch`` wrapped as SGLang 0.5.16's ``HookRegistry`` wraps a classmethod with an AFTER
    hook (``_apply_target`` unwraps it, ``_wrap_fn`` calls ``hook(result, *args)``, the classmethod is restored)."""
    original = BatchInfo.__dict__["from_schedule_batch"].__func__

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        modified = hook(result, *args, **kwargs)
        return modified if modified is not None else result

    return type("Hooked", (BatchInfo,), {"from_schedule_batch": classmethod(wrapper)})


def test_the_hook_gives_each_request_its_seed_as_the_deterministic_mode_does(monkeypatch):
    monkeypatch.setenv(plugin.SEEDED, "1")
    registry = Registry()
    plugin.register(registry, "after")
    hooked = hooked_as_sglang_does(registry.hooks[0][1])
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=s)) for s in (7, None, 2**40)]
    batch = SimpleNamespace(reqs=reqs, device="cpu")
    info = hooked.from_schedule_batch(batch, 151_936)
    assert info.sampling_seed.dtype == torch.int64 and info.sampling_seed.tolist() == [7, 42, 2**40]
    assert info.vocab_size == 151_936
    hooked.seeds = given = torch.tensor([5, 6, 8])  # the deterministic mode's own tensor is left as it is
    assert hooked.from_schedule_batch(batch, 151_936).sampling_seed is given


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"device": "cpu"}, r"configs\.s\.device: 'cpu' with engine sglang"),
        ({"sglang": {"disable_radix_cache": True}}, r"configs\.s\.sglang\.disable_radix_cache: true"),
        ({"sglang": {"attention_backend": "flashinfer"}}, r"configs\.s\.sglang\.attention_backend: 'flashinfer'"),
        ({"sglang": {"context_length": 50}}, r"configs\.s\.sglang\.context_length: 50 positions do not hold"),
        ({"sglang": {"max_total_tokens": 50}}, r"configs\.s\.sglang\.max_total_tokens: a KV pool of 50 tokens"),
        ({"sglang": {"max_total_tokens": 0}}, r"configs\.s\.sglang\.max_total_tokens"),
        ({"sglang": {"page_size": "1"}}, r"configs\.s\.sglang\.page_size"),
        ({"vllm": {}}, r"configs\.s\.vllm: settings of the vllm engine, but .* 'sglang'"),
    ],
)
def test_what_the_engine_cannot_measure_is_refused_by_key(given, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(sglang_config(**given))


def test_an_sglang_block_beside_another_engine_is_refused():
    config = sglang_config(engine="vllm", kernels="stock", sglang={})
    with pytest.raises(ConfigError, match=r"configs\.s\.sglang: settings of the sglang engine, but .* 'vllm'"):
        validate_config(config)


def test_transplant_passes_are_refused_for_sglang():
    config = sglang_config()
    config["replay"] = {**config.get("replay", {}), "passes": ["exact", "replica", "refeed", "transplant_refeed"]}
    with pytest.raises(ConfigError, match=r"engine: sglang keeps its KV inside SGLang"):
        validate_config(config)


def test_a_missing_sglang_is_refused_before_any_job(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    config = validate_config(sglang_config())
    problems = platform_problems(config, dev=Path("/nonexistent"))
    assert any("configs.s.engine: 'sglang', but SGLang is not installed" in p for p in problems)
    assert any("install.sh --sglang-cuda" in p for p in problems)


# ------------------------------------------------------------------------------------------- the engine's logic
class RadixStandIn:
    """What the engine asks of SGLang's generate (``SaltedEngine``), on CPU: a request's tokens follow from its sampling
    seed alone (or, with ``seeded=False``, from one generator, as SGLang's stock sampler without the plugin), and a
    prompt reads from the cache the longest prefix that an earlier request under the same salt (``extra_key``) covers
    with its prompt and output, less its last token, in whole pages (SGLang's radix-tree match)."""

    def __init__(self, page_size: int = 1, forget: bool = False, seeded: bool = True) -> None:
        self.page_size, self.forget, self.seeded, self.tree, self.calls = page_size, forget, seeded, [], []
        self.shared = random.Random(0)

    def generate(
        self, input_ids, extra_key, sampling_params, return_logprob=True, top_logprobs_num=0, logprob_start_len=None
    ):
        self.calls.append(len(input_ids))
        starts = logprob_start_len if isinstance(logprob_start_len, list) else [logprob_start_len] * len(input_ids)
        return [
            self.one(ids, salt, params, start, top_logprobs_num)
            for ids, salt, params, start in zip(input_ids, extra_key, sampling_params, starts)
        ]

    def one(self, ids, salt, params, start, top_logprobs_num):
        common = [
            next((i for i, (a, b) in enumerate(zip(ids, seq)) if a != b), min(len(ids), len(seq)))
            for key, seq in self.tree
            if key == salt
        ]
        hit = min(max(common, default=0), len(ids) - 1) // self.page_size * self.page_size
        rng = random.Random(params.get("sampling_seed", 0) * 7919 + len(ids)) if self.seeded else self.shared
        tokens = [rng.randrange(10, 90) for _ in range(params["max_new_tokens"])]
        meta = {
            "finish_reason": {"type": "length"},
            "cached_tokens": 0 if self.forget else hit,
            "output_token_logprobs": [(-0.25 - 0.01 * j, t, None) for j, t in enumerate(tokens)],
            "output_top_logprobs": [[(-0.25, t, None), (-1.5, t + 1, None)][:top_logprobs_num] for t in tokens],
        }
        if start is not None:  # tokens start, start + 1, ...: the first has no value (SGLang's shape)
            meta["input_token_logprobs"] = [(None if j == 0 else -0.5, t, None) for j, t in enumerate(ids[start:])]
        self.tree.append((salt, list(ids) + tokens))
        return {"output_ids": tokens, "meta_info": meta}


SAMPLING = SamplingSettings(temperature=0.7, top_p=0.95, max_new_tokens=6)


def engine(stand_in: RadixStandIn) -> SGLangEngine:
    return SGLangEngine(stand_in, tokenizer=None, eos=set(), topk=2, page_size=stand_in.page_size)


@pytest.fixture
def stored(tmp_path):
    """Two rollouts generated in one 'process' (their own stand-in), kept as recipes."""
    requests = [RolloutRequest(f"p{i}", (1, 2, 3, 4 + i), seed=11 + i, rollout=0) for i in range(2)]
    return engine(RadixStandIn()).generate_rollouts(requests, SAMPLING, tmp_path, lambda r: len(r.response_ids))


def continuation(rollout, t: int, branch: int = 99) -> ContinuationRequest:
    prefix = tuple(rollout.prompt_ids + rollout.response_ids[:t])
    return ContinuationRequest(
        f"{rollout.problem_id}/r0@{t}",
        "orig",
        0,
        seed=5,
        prefix_ids=prefix,
        branch_token=branch,
        kv_file=rollout.kv_file,
        kv_sha256=rollout.kv_sha256,
        expected_digest=rollout.logits_digests[t],
        restep=False,
    )


def test_rollouts_store_an_sglang_recipe_and_each_tokens_log_prob(stored):
    for rollout in stored:
        recipe = read_recipe(rollout.kv_file, rollout.kv_sha256, engine="sglang")
        assert recipe["batch"][recipe["index"]]["seed"] in (11, 12)
        assert len(rollout.token_logprobs) == len(rollout.response_ids) == 6
    with pytest.raises(VerificationError, match="not a vllm rollout recipe"):
        read_recipe(stored[0].kv_file, stored[0].kv_sha256, engine="vllm")


def test_exact_regenerates_in_a_new_process_and_reads_the_decode_time_state(stored):
    stand_in = RadixStandIn(page_size=1)
    fresh = engine(stand_in)
    results = fresh.run_batch([continuation(r, 3) for r in stored], "decode_kv", SAMPLING)
    assert stand_in.calls == [2, 2]  # the rollouts' batch regenerated once for both, then the continuations
    for rollout, result in zip(stored, results):
        assert (
            result.verified and result.expected_cached_tokens == len(rollout.prompt_ids) + 3
        )  # L + t, all but the branch
        assert result.cached_tokens == result.expected_cached_tokens


def test_a_continuation_builds_only_its_first_step_s_top_k_and_keeps_every_result(stored, monkeypatch):
    """Continuations read their first step's top-k alone: building only it leaves every result as building every
    step's did, and rollouts (whose every step a pivot and a regeneration read) keep all of theirs."""
    requests = [continuation(r, 3) for r in stored]
    full = SGLangEngine.submit
    monkeypatch.setattr(SGLangEngine, "submit", lambda self, *a, positions=None: full(self, *a))
    every = engine(RadixStandIn()).run_batch(requests, "decode_kv", SAMPLING)
    monkeypatch.setattr(SGLangEngine, "submit", full)
    built, position = [], sglang_engine._position
    monkeypatch.setattr(sglang_engine, "_position", lambda *a: built.append(a) or position(*a))
    first = engine(RadixStandIn()).run_batch(requests, "decode_kv", SAMPLING)
    assert first == every
    assert len(built) == 2 * 6 + 2  # the two rollouts regenerated, all 6 steps each; one step per continuation


def test_a_page_of_four_expects_whole_pages_only(stored):
    fresh = engine(RadixStandIn(page_size=4))
    (result,) = fresh.run_batch([continuation(stored[0], 3)], "decode_kv", SAMPLING)
    assert result.expected_cached_tokens == 4 and result.verified  # 4 + 3 tokens before the branch: one whole page


def test_a_cache_miss_or_a_changed_rollout_makes_exact_rows_unverified(stored):
    (missed,) = engine(RadixStandIn(forget=True)).run_batch([continuation(stored[0], 3)], "decode_kv", SAMPLING)
    assert not missed.verified and missed.cached_tokens == 0
    changed = continuation(stored[0], 3)
    changed = ContinuationRequest(**{**changed.__dict__, "expected_digest": chained_digests([b"other"])[0]})
    (result,) = engine(RadixStandIn()).run_batch([changed], "decode_kv", SAMPLING)
    assert not result.verified


def test_a_refeed_in_its_own_process_reads_no_decode_time_state(stored):
    results = engine(RadixStandIn()).run_batch([continuation(r, 3) for r in stored], "refeed_ids", SAMPLING)
    assert all(r.verified and r.expected_cached_tokens is None for r in results)
    assert results[0].cached_tokens == 0  # nothing before it in this process
    assert results[1].cached_tokens <= 3  # at most the shared prompt of the first request, never a response


def test_a_refeed_beside_resumed_rollouts_reads_none_of_their_state(stored):
    """Salts keep a pass's re-feeds off the decode-time entries even in one process (a replica and a re-feed, or a
    test's two passes, in one engine), and each rollout off another's prompt entries."""
    stand_in = RadixStandIn()
    shared = engine(stand_in)
    shared.run_batch([continuation(r, 3) for r in stored], "decode_kv", SAMPLING)
    refeeds = shared.run_batch([continuation(r, 3) for r in stored], "refeed_ids", SAMPLING)
    assert [r.cached_tokens for r in refeeds] == [0, 3]  # the first computed it all; the second shares its prompt
    salts = [salt for salt, _ in stand_in.tree]
    assert salts[:2] == ["rollout:p0:11", "rollout:p1:12"] and salts[-2:] == ["pass:refeed_ids"] * 2


class OneSeed(RadixStandIn):
    """A sampler that draws every request from one seed (a seed lost on its way), however the request asks."""

    def one(self, ids, salt, params, start, top_logprobs_num):
        return super().one(ids, salt, {**params, "sampling_seed": 42}, start, top_logprobs_num)


def test_stock_sampling_that_ignores_the_seeds_is_caught_before_any_request():
    check_seeded(RadixStandIn(), [1, 2, 3])  # one seed, the same tokens; another seed, others: passes
    with pytest.raises(EngineError, match=r"ignores the request seeds.*replaynoise\.engines\.sglang\.plugin"):
        check_seeded(RadixStandIn(seeded=False), [1, 2, 3])
    with pytest.raises(EngineError, match=r"same tokens for one request under two seeds"):
        check_seeded(OneSeed(), [1, 2, 3])
    assert PROBE["ignore_eos"] and PROBE["temperature"] > 1  # free-running: unseeded draws differ
    assert PROBE["top_p"] < 1  # the runs' sampler path, not the plain one


def test_a_prefix_is_scored_from_its_response_start(stored):
    request = ContinuationRequest(**{**continuation(stored[0], 3).__dict__, "restep": True, "response_start": 4})
    (result,) = engine(RadixStandIn()).run_batch([request], "refeed_ids", SAMPLING)
    assert result.prefix_logprobs == [-0.5] * 3  # the three response tokens of the prefix


def test_what_sglang_made_of_the_settings_is_checked_once_built():
    settings = validate_config(sglang_config())["configs"]["s"]
    built = SimpleNamespace(disable_radix_cache=False, page_size=1, attention_backend="fa3", sampling_backend="pytorch")
    assert checked_server_args(built, settings) == 1
    assert checked_server_args(SimpleNamespace(**{**built.__dict__, "page_size": 128}), settings) == 128
    with pytest.raises(EngineError, match="turned its radix cache off"):
        checked_server_args(SimpleNamespace(**{**built.__dict__, "disable_radix_cache": True}), settings)
    with pytest.raises(EngineError, match="chose the 'flashinfer' sampler, which draws no request from its own seed"):
        checked_server_args(SimpleNamespace(**{**built.__dict__, "sampling_backend": "flashinfer"}), settings)


def test_the_decode_graphs_bound_sglang_chose_is_logged(caplog):
    settings = validate_config(sglang_config())["configs"]["s"]
    graphs = SimpleNamespace(decode=SimpleNamespace(max_bs=256))  # SGLang 0.5.16's on an H100
    built = SimpleNamespace(disable_radix_cache=False, page_size=1, sampling_backend="pytorch")
    built.disable_cuda_graph, built.cuda_graph_config = False, graphs
    with caplog.at_level(logging.INFO, logger="replaynoise.engines.sglang.launch"):
        checked_server_args(built, settings)
        checked_server_args(SimpleNamespace(**{**built.__dict__, "disable_cuda_graph": True}), settings)
    messages = [r.getMessage() for r in caplog.records if not r.getMessage().startswith("SGLang chose:")]
    assert messages == [
        "SGLang captures decode CUDA graphs for batches of up to 256 rows (sglang.cuda_graph_max_bs_decode); larger "
        "batches decode without them"
    ]


def test_what_sglang_resolved_by_gpu_is_logged_at_every_build(caplog):
    """The attention backends, chunked prefill and scheduling SGLang chose (issue 55: two leases of one campaign on
    other cards gave other rates, and the later one's log no longer held SGLang's own server_args line)."""
    settings = validate_config(sglang_config())["configs"]["s"]
    built = SimpleNamespace(disable_radix_cache=False, page_size=1, sampling_backend="pytorch", disable_cuda_graph=True)
    built.attention_backend, built.chunked_prefill_size, built.max_running_requests = "fa3", 8192, None
    with caplog.at_level(logging.INFO, logger="replaynoise.engines.sglang.launch"):
        checked_server_args(built, settings)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("SGLang chose: attention_backend='fa3', prefill_attention_backend='absent', ")
    assert "chunked_prefill_size=8192" in line and "max_running_requests=None" in line


@pytest.mark.parametrize("given", [{}, {"attention_backend": "triton", "max_total_tokens": 720_000}])
def test_every_setting_that_moves_a_pass_s_bits_is_pinned_or_recorded_in_the_fingerprint(tmp_path, caplog, given):
    """Each setting the regime probe found to move the bits (or that sizes the batches) reaches a run's fingerprint:
    from the configuration where it is given, else from what the build logged SGLang resolved. A setting that was
    neither would let two runs of one file on two cards differ with nothing to show why."""
    settings = validate_config(sglang_config(kernels="stock", sglang=given))["configs"]["s"]
    kwargs = engine_kwargs(settings)
    built = SimpleNamespace(disable_radix_cache=False, page_size=1, sampling_backend="pytorch")
    built.disable_cuda_graph, built.attention_backend = False, "fa3"
    built.chunked_prefill_size, built.max_running_requests = 8192, 1024
    built.cuda_graph_config = SimpleNamespace(decode=SimpleNamespace(max_bs=256))
    with caplog.at_level(logging.INFO, logger="replaynoise.engines.sglang"):
        logging.getLogger("replaynoise.engines.sglang.engine").info("SGLang engine: %s", described(kwargs))
        checked_server_args(built, settings)
        checked_pool({"max_total_num_tokens": 720_000}, settings, 1)
    (tmp_path / "replay_exact").mkdir()
    lines = "".join(f"x INFO y: {r.getMessage()}\n" for r in caplog.records)
    (tmp_path / "replay_exact" / "s.000.log").write_text(lines)
    recorded = environment_fingerprint(validate_config(sglang_config(kernels="stock", sglang=given)), tmp_path)
    resolved = recorded["engines"]["s"]["resolved"]
    assert {name for name in NUMERIC.values() if name not in resolved} == set()
    assert resolved["kv_pool_tokens"] == "720000" and resolved["max_running_requests"] == "1024"
    # the one setting SGLang resolves from the memory free at the job's start, not from card and model: a pool left
    # to it is named in the job's log
    unpinned = [r for r in caplog.records if "sized its KV pool" in r.getMessage()]
    assert len(unpinned) == (0 if "max_total_tokens" in given else 1)


@pytest.mark.parametrize(
    ("key", "value"),
    [("cuda_graph_max_bs_decode", 1024), ("max_total_tokens", 700_000)],
)
def test_a_key_added_after_the_first_runs_is_absent_unless_given_and_then_reaches_the_engine(key, value):
    """Absent, SGLang chooses (its decode-graph bound; a pool sized from free memory) and no earlier run's hash
    moves; given, it is passed on and enters the hash; a value below 1 or null is refused by key."""
    base = validate_config(sglang_config(kernels="stock"))
    assert key not in base["configs"]["s"]["sglang"]
    assert key not in engine_kwargs(base["configs"]["s"])
    given = validate_config(sglang_config(kernels="stock", sglang={key: value}))
    assert engine_kwargs(given["configs"]["s"])[key] == value
    assert analysis_hash(given) != analysis_hash(base)
    for refused in (0, None):
        with pytest.raises(ConfigError, match=rf"configs\.s\.sglang\.{key}"):
            validate_config(sglang_config(sglang={key: refused}))


def test_a_kv_pool_smaller_than_the_one_asked_for_stops_the_job(caplog):
    """SGLang takes the smaller of max_total_tokens and what free memory holds (a warning at its log level error,
    so unseen): the batches it admits would then differ from the other jobs' of the configuration."""
    asked = validate_config(sglang_config(sglang={"max_total_tokens": 700_000, "mem_fraction_static": 0.55}))
    settings = asked["configs"]["s"]
    assert checked_pool({"max_total_num_tokens": 700_000}, settings, 1) == 700_000
    assert checked_pool({"max_total_num_tokens": 699_904}, settings, 128) == 699_904  # whole pages: not short
    with pytest.raises(
        EngineError,
        match=r"KV pool of 699999 tokens, fewer than sglang\.max_total_tokens 700000.*"
        r"mem_fraction_static 0\.55",
    ):
        checked_pool({"max_total_num_tokens": 699_999}, settings, 1)
    assert "sglang.max_total_tokens pins it" not in caplog.text
    free = validate_config(sglang_config())["configs"]["s"]
    assert checked_pool({"max_total_num_tokens": 12}, free, 1) == 12  # not asked: whatever SGLang built
    assert "KV pool (12 tokens) from the GPU memory free at this job's start" in caplog.text  # and said so


def test_the_jobs_warnings_outlive_sglangs_logging_setup(caplog, tmp_path):
    """SGLang's configure_logger forces the root logging to its log level (error) in the building process, closing
    the handlers it removes; the engine's later warnings (an unverified row, the KV pool) must still reach the job's
    log, a file opened for writing included (a closed FileHandler of mode 'w' drops every record)."""
    job_log = logging.FileHandler(tmp_path / "job.log", mode="w")
    logging.getLogger().addHandler(job_log)
    log = logging.getLogger("replaynoise.engines.recipes")
    with caplog.at_level(logging.INFO):
        with logging_kept():
            logging.basicConfig(level=logging.ERROR, force=True)  # what SGLang 0.5.16 does
        log.warning("pivot p a/0: 3 prefix tokens from cache, 9 expected: unverified")
    assert [r.getMessage() for r in caplog.records] == [
        "pivot p a/0: 3 prefix tokens from cache, 9 expected: unverified"
    ]
    logging.getLogger().removeHandler(job_log)
    job_log.close()
    assert (tmp_path / "job.log").read_text() == "pivot p a/0: 3 prefix tokens from cache, 9 expected: unverified\n"


@pytest.mark.parametrize("pool", [1_000, 999])
def test_build_queues_sglang_checks_its_pool_and_shuts_it_down_when_a_check_fails(monkeypatch, tmp_path, pool):
    """engine.build over a stand-in for sglang.Engine: the engine is built holding the machine's start lock, its
    pool is checked against max_total_tokens, and a failed check shuts the built engine down (its processes would
    otherwise keep their share of the GPU)."""
    from replaynoise.engines.sglang import launch
    from replaynoise.progress import Phases

    monkeypatch.setattr(launch, "START_LOCK", tmp_path / "start.lock")
    seen = []

    class Built:
        server_args = SimpleNamespace(
            disable_radix_cache=False, page_size=1, sampling_backend="pytorch", disable_cuda_graph=True
        )

        def __init__(self, **kwargs):
            fd = os.open(launch.START_LOCK, os.O_RDONLY)
            try:  # another descriptor of the lock: refused while the build holds it
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append("built unlocked")
            except BlockingIOError:
                seen.append(("built locked", kwargs["max_total_tokens"]))
            finally:
                os.close(fd)

        def get_server_info(self):
            return {"max_total_num_tokens": pool}

        def shutdown(self):
            seen.append("shutdown")

    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    sys.modules["sglang"].Engine = Built
    sys.modules["sglang.srt.managers.io_struct"].GenerateReqInput = dict
    monkeypatch.setattr(sglang_engine, "model_weights_dir", lambda folder: folder)
    monkeypatch.setattr(sglang_engine, "load_tokenizer", lambda weights: lambda text: {"input_ids": [1, 2]})
    monkeypatch.setattr(sglang_engine, "check_seeded", lambda engine, ids: seen.append("seed check"))
    monkeypatch.setattr(sglang_engine, "eos_ids", lambda weights, tokenizer: {0})
    monkeypatch.setattr(sglang_engine, "stop_token_ids", lambda tokenizer, stop: set())
    settings = validate_config(sglang_config(kernels="stock", sglang={"max_total_tokens": 1_000}))["configs"]["s"]
    build = functools.partial(sglang_engine.build, settings, tmp_path, topk=5, threads=1, startup=Phases())
    if pool < 1_000:
        with pytest.raises(EngineError, match="KV pool of 999 tokens, fewer than sglang.max_total_tokens 1000"):
            build()
        assert seen == [("built locked", 1_000), "shutdown"]
    else:
        assert isinstance(build(), SGLangEngine)
        assert seen == [("built locked", 1_000), "seed check"]
    fd = os.open(launch.START_LOCK, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the build, whichever way it ended
    os.close(fd)


def _hold_start(path: str, events, hold_s: float) -> None:
    with start_lock(Path(path)):
        events.put(("in", time.monotonic(), os.getpid()))
        time.sleep(hold_s)
        events.put(("out", time.monotonic(), os.getpid()))


def test_sglang_engines_on_one_gpu_build_one_at_a_time(tmp_path):
    """Each engine's build holds the GPU's start lock, so a second job's SGLang measures free memory only once the
    first has built its pool; across processes (flock), and released by a job that ends."""
    events = multiprocessing.get_context("fork").Queue()
    jobs = [
        multiprocessing.get_context("fork").Process(target=_hold_start, args=(str(tmp_path / "gpu.lock"), events, 0.4))
        for _ in range(2)
    ]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=30)
    # in the order the events happened, not the order they reached the queue: each process's feeder thread sends
    # its "out" after put() returns, which can be after the lock is released and the other's "in" is sent (the
    # suite on two busy cores got them crossed once)
    seen = sorted((events.get(timeout=5) for _ in range(4)), key=lambda event: event[1])
    assert [kind for kind, _, _ in seen] == ["in", "out", "in", "out"]
    assert seen[0][2] == seen[1][2] != seen[2][2] == seen[3][2]  # one job in and out, then the other
    assert all(job.exitcode == 0 for job in jobs)
    (tmp_path / "gpu.lock").chmod(0o444)  # another user's lock file, say: read-only serves
    _hold_start(str(tmp_path / "gpu.lock"), events, 0.0)
    assert [events.get(timeout=5)[0] for _ in range(2)] == ["in", "out"]


def test_transplants_are_refused_by_the_engine_too(stored):
    from replaynoise.engines.base import PrefixKind, PrefixSource

    source = PrefixSource(PrefixKind.DECODE_KV, donor=PrefixKind.REFEED_IDS, layers=(0, 2))
    with pytest.raises(ValueError, match="keeps its KV inside SGLang"):
        engine(RadixStandIn()).run_batch([continuation(stored[0], 3)], source, SAMPLING)


def test_the_cached_refeed_is_refused_by_the_engine_by_name(stored):
    from replaynoise.generation.passes import PASSES

    with pytest.raises(ValueError, match="pass refeed_cached .* the SGLang engine .* engine: hf"):
        engine(RadixStandIn()).run_batch([continuation(stored[0], 3)], PASSES["refeed_cached"].source, SAMPLING)


# ------------------------------------------------------------------------------------------- on a GPU
ON_GPU = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None or not torch.cuda.is_available(),
    reason="the SGLang engine runs on an NVIDIA GPU with SGLang installed (bash install.sh --sglang-cuda)",
)


@pytest.fixture(scope="module", params=["invariant", "stock"])
def gpu_engine(request, smollm2_dir):
    """One SGLang engine per kernel mode, shut down before the next starts (each takes a share of the GPU)."""
    from replaynoise.engines import make_engine

    settings = configuration(
        engine="sglang", kernels=request.param, device="cuda", max_new_tokens=24, sglang={"mem_fraction_static": 0.15}
    )
    built = make_engine(settings, smollm2_dir, topk=5, threads=1)
    yield request.param, built
    built.engine.shutdown()


@pytest.mark.slow
@ON_GPU
def test_on_a_gpu_exact_reads_the_decode_time_state_in_any_batch_and_a_refeed_misses_it(gpu_engine, tmp_path):
    """A rollout regenerated after its cache is gone (as in an exact pass's own process) is the stored one bitwise,
    its resumed continuation reads the decode-time state (the hit SGLang reports is the one expected), a re-feed under
    its pass's salt reads none of it, and a continuation's draws follow its seed. Under the deterministic mode a
    resumed continuation is also the same alone and in another batch. Whether a re-feed's first step equals the
    resumed one is the finding a campaign reports (SGLang's own test expects decode and prefill to differ there), so
    it is printed, not asserted."""
    kernels, built = gpu_engine
    sampling = SamplingSettings(temperature=0.7, top_p=0.95, max_new_tokens=24)
    prompt = tuple(built.tokenizer("Write a long story about a cat and a dog.")["input_ids"])
    requests = [RolloutRequest("q", prompt, seed=3 + i, rollout=i) for i in range(8)]
    drawn = built.generate_rollouts(requests, sampling, tmp_path, lambda r: 24)
    rollouts = sorted(drawn, key=lambda r: -len(r.response_ids))[:2]  # some end at once; two that do not
    assert all(len(r.response_ids) >= 4 for r in rollouts), [r.response_ids for r in drawn]
    assert built.engine.flush_cache().success
    fresh = SGLangEngine(built.engine, built.tokenizer, built.eos_ids, topk=5, page_size=built.page_size)
    t = len(rollouts[0].response_ids) // 2
    request = continuation(rollouts[0], t, branch=rollouts[0].response_ids[t])
    (alone,) = fresh.run_batch([request], "decode_kv", sampling)
    assert alone.verified and alone.cached_tokens == alone.expected_cached_tokens == len(prompt) + t
    (again,) = fresh.run_batch([request], "decode_kv", sampling)
    assert again.token_ids == alone.token_ids  # same seed, same state, alone: the same draws
    u = len(rollouts[1].response_ids) // 2
    other = ContinuationRequest(**{**continuation(rollouts[1], u).__dict__, "pivot_id": f"q/other@{u}", "seed": 9})
    batched, other_result = fresh.run_batch([request, other], "decode_kv", sampling)
    assert batched.verified and other_result.verified
    if kernels == "invariant":
        assert (batched.token_ids, batched.next_topk_logprobs) == (alone.token_ids, alone.next_topk_logprobs)
    (refeed,) = fresh.run_batch([request], "refeed_ids", sampling)
    assert refeed.cached_tokens == 0  # the pass's salt: none of the decode-time state, its prefix computed
    same = refeed.next_topk_logprobs == alone.next_topk_logprobs
    print(
        f"{kernels}: exact vs re-feed first step bitwise equal: {same}; in a batch of two equal to alone: "
        f"{(batched.token_ids, batched.next_topk_logprobs) == (alone.token_ids, alone.next_topk_logprobs)}"
    )
