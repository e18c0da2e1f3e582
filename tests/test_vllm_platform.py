"""vLLM settings that need no vLLM install (invariant-mode refusal, parse-time checks, pivot alignment), and the
engine's row-invariant replacements of vLLM kernels (with vLLM installed; the top-p filter's on a CUDA device)."""

from __future__ import annotations

import pytest
import yaml

from replaynoise.config import DEFAULT_CONFIG_PATH, ConfigError, validate_config
from replaynoise.engines import make_engine
from replaynoise.engines.vllm.build import (
    GPU_HEADROOM_GIB,
    PlatformError,
    check_invariant_platform,
    gpu_memory_share,
    patch_invariant_rms_norm,
    patch_invariant_top_k_top_p,
    row_invariant_add_rms_norm,
)
from replaynoise.generation.pivots import PivotRules, candidate_positions

NAME = "smollm2-bf16"


def vllm_config(**settings) -> dict:
    config = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    config["configs"][NAME].update(engine="vllm", **settings)
    return config


def test_vllm_on_cpu_validates():
    assert validate_config(vllm_config())["configs"][NAME]["engine"] == "vllm"


def test_invariant_on_cpu_is_refused_at_parse_time_naming_the_platform():
    with pytest.raises(ConfigError, match=r"configs\.smollm2-bf16\.kernels.*device is 'cpu'"):
        validate_config(vllm_config(kernels="invariant"))


def test_cpu_block_size_must_be_a_multiple_of_32():
    with pytest.raises(ConfigError, match=r"configs\.smollm2-bf16\.block_size: 16 is not a multiple of 32"):
        validate_config(vllm_config(block_size=16))
    validate_config(vllm_config(block_size=16, device="cuda"))  # the GPU backends take 16


def test_make_engine_refuses_invariant_before_loading_anything(tmp_path):
    settings = validate_config(vllm_config(device="cuda"))["configs"][NAME] | {"kernels": "invariant"}
    # tmp_path holds no model: reaching the model load would fail differently, so the refusal comes first
    with pytest.raises(PlatformError, match="invariant"):
        make_engine(settings | {"device": "cpu"}, tmp_path, topk=5, threads=1)


@pytest.mark.parametrize("capability, ok", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_invariant_needs_compute_capability_8(capability, ok):
    if ok:
        check_invariant_platform("cuda:1", cuda_capability=lambda index: capability)
    else:
        with pytest.raises(PlatformError, match=r"cuda:1 has 7\.5"):
            check_invariant_platform("cuda:1", cuda_capability=lambda index: capability)


def test_alignment_keeps_positions_whose_prefix_fills_whole_blocks():
    # prompt of 30 tokens, blocks of 32: prefix prompt + response[:t] has 30 + t tokens; t = 2, 34 fill blocks
    n = 40
    args = ([7] * n, [[7, 8, 9]] * n, [[-0.6, -0.8, -3.0]] * n, set(), None)
    assert candidate_positions(*args, PivotRules(block_size=32), prompt_len=30) == [2, 34]
    assert candidate_positions(*args, PivotRules(block_size=0), prompt_len=30) == list(range(1, n))


H200_BYTES = int(139.8 * 2**30)


def test_gpu_memory_share_asks_for_the_cache_and_headroom_only():
    """vLLM refuses to start unless gpu_memory_utilization of the GPU is free: with its default (0.92) a second
    job on the H200 failed at start while the first held 17 GiB. The share asked for is the cache plus headroom,
    so several small-model jobs fit one GPU."""
    share = gpu_memory_share(20, H200_BYTES)
    assert share == pytest.approx((20 + GPU_HEADROOM_GIB) / 139.8, abs=1e-4)
    assert 3 * share < 0.92  # three jobs of 20 GiB caches start side by side
    assert gpu_memory_share(1, H200_BYTES) < share


def test_gpu_memory_share_refuses_a_cache_larger_than_the_gpu_naming_the_key():
    with pytest.raises(ValueError, match=r"kv_cache_gib 200 .* 139.8 GiB"):
        gpu_memory_share(200, H200_BYTES)


def _reference_rms_norm(x, weight, eps):
    """A per-row RMSNorm in plain torch, standing in for vLLM's Triton kernel (which needs a GPU)."""
    xf = x.float()
    return (xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt()).to(x.dtype) * weight


def test_the_invariant_add_rms_norm_adds_elementwise_then_normalises_each_row_alone():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(7, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    weight = torch.rand(64, generator=gen).to(torch.bfloat16)
    x0, r0 = x.clone(), residual.clone()
    norm = row_invariant_add_rms_norm(_reference_rms_norm)
    out, summed = norm(x, weight, 1e-6, residual=residual)
    assert torch.equal(summed, (x0.float() + r0.float()).to(torch.bfloat16))
    assert torch.equal(out, _reference_rms_norm(summed, weight, 1e-6))
    assert torch.equal(x, x0) and torch.equal(residual, r0)  # out of place: the layer uses the returned pair
    # a row's result is the same alone as among the other rows
    alone, alone_summed = norm(x[2:3], weight, 1e-6, residual=residual[2:3])
    assert torch.equal(alone, out[2:3]) and torch.equal(alone_summed, summed[2:3])
    # without a residual it is the wrapped kernel itself
    assert torch.equal(norm(x, weight, 1e-6), _reference_rms_norm(x, weight, 1e-6))


def _installed_once(monkeypatch, module, name: str, patch) -> None:
    """``patch`` replaces ``module.name`` by a row-invariant function, and a second call wraps nothing again."""
    original = getattr(module, name)
    monkeypatch.setattr(module, name, original)  # restored after the test
    patch()
    installed = getattr(module, name)
    assert installed is not original and installed.row_invariant
    patch()
    assert getattr(module, name) is installed


def test_the_invariant_rms_norm_is_installed_once_where_vllm_s_rmsnorm_layer_looks_it_up(monkeypatch):
    layernorm = pytest.importorskip("vllm.model_executor.layers.layernorm")
    _installed_once(monkeypatch, layernorm, "rms_norm_batch_invariant", patch_invariant_rms_norm)


def _triton_top_k_top_p():
    """vLLM's sampler module on a CUDA device (where its Triton top-k/top-p kernel runs), or a skip."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("vLLM's Triton top-k/top-p kernel runs on a CUDA device only")
    sampler = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    assert getattr(sampler, "apply_top_k_top_p_triton", None) is not None, "vLLM's CUDA build without Triton"
    return sampler


def test_the_invariant_top_p_filters_a_row_alone_as_among_others(monkeypatch):
    """vLLM's own filter changes algorithm below 8 rows, and then keeps another nucleus for some rows; the
    installed one keeps every row's bitwise whatever number of rows a step samples (1, 3 and 7 of them, against
    160: more than the H200's 132 programs, so some run two rows), with top-p, top-k, and both."""
    sampler = _triton_top_k_top_p()
    torch = pytest.importorskip("torch")
    stock = sampler.apply_top_k_top_p
    monkeypatch.setattr(sampler, "apply_top_k_top_p", stock)  # restored after the test
    patch_invariant_top_k_top_p()
    filt = sampler.apply_top_k_top_p  # what vLLM's sampler now calls
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 160, 49152  # SmolLM2's vocabulary; logits from flat to peaked
    scale = torch.linspace(0.5, 12, rows, device="cuda")[:, None]
    logits = torch.randn(rows, vocab, device="cuda", generator=gen) * scale
    top_p, top_k = torch.full((rows,), 0.95, device="cuda"), torch.full((rows,), 40, device="cuda", dtype=torch.int32)
    for k, p in ((None, top_p), (top_k, None), (top_k, top_p)):
        together = filt(logits.clone(), k, p)
        kept = torch.isfinite(together).sum(1)
        assert (kept >= 1).all() and (kept < vocab).all()  # a real nucleus in every row
        for n in (1, 3, 7):
            for start in range(0, rows - n + 1, n):
                part = slice(start, start + n)
                alone = filt(logits[part].clone(), None if k is None else k[part], None if p is None else p[part])
                assert torch.equal(alone, together[part]), (n, start)
    assert filt(logits, None, None) is logits  # nothing to filter: untouched
    # vLLM's own top-p, one row at a time (its sort and cumsum), draws the edge elsewhere for some of these rows
    own = stock(logits.clone(), None, top_p)
    assert any(
        not torch.equal(
            torch.isfinite(stock(logits[r : r + 1].clone(), None, top_p[r : r + 1]))[0], torch.isfinite(own[r])
        )
        for r in range(rows)
    )


def test_the_invariant_top_p_is_installed_once_where_vllm_s_sampler_looks_it_up(monkeypatch):
    _installed_once(monkeypatch, _triton_top_k_top_p(), "apply_top_k_top_p", patch_invariant_top_k_top_p)
