"""FlashAttention 3 for the static decoders' step (``static_attention: fa3``), from the kernels vLLM's
wheel carries (``vllm/vllm_flash_attn/_vllm_fa3_C``, Hopper GPUs: H100, H200).

Why: the ``gemm`` attention reads every slot of a row's cache, masked or not, in two GEMMs and a float32 softmax;
FA3 reads each row's live positions only, in one kernel: one layer's decode attention ran 1.41-1.78x faster on an
H100 (benchmarks/results/fa3-attention-2026-12-07/). The library is loaded by its path, without importing vLLM
(whose import sets inductor and environment options of its own, which would change the engine's other kernels).

It reads the decoders' own cache layout, [rows, kv_heads, slots, head_dim], as a strided view (no copy) and a row's
live slots [first, end) with ``leftpad_k`` and ``seqused_k``. ``num_splits`` is fixed at 1, so a row's output is
computed by one program over its own positions in one order: a function of its query and its live KV alone,
whatever its batch-mates (FA3's own choice of splits would depend on the batch). Its sums are not the ``gemm``
attention's, so its numbers are its own: exact and replica still agree bitwise (the same kernel on the same
inputs), but a run with it is not a rerun of one without.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch

#: where vLLM's wheel keeps the FA3 library, under its package folder
LIBRARY = Path("vllm_flash_attn") / "_vllm_fa3_C.abi3.so"


@functools.cache
def fa3_forward() -> Callable[..., list[torch.Tensor]]:
    """vLLM's FA3 forward op, its library loaded on first use (once a process); a clear error where it cannot be."""
    spec = importlib.util.find_spec("vllm")
    where = [Path(p) / LIBRARY for p in (spec.submodule_search_locations or [])] if spec else []
    found = next((p for p in where if p.exists()), None)
    if found is None:
        raise RuntimeError(
            "static_attention fa3 (or REPLAYNOISE_STATIC_ATTENTION=fa3) runs FlashAttention 3 from vLLM's wheel "
            f"(vllm/{LIBRARY}), which this environment lacks ({'vllm not installed' if spec is None else where}); "
            "install vLLM (bash install.sh --vllm-cuda) or choose another attention"
        )
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
        raise RuntimeError(
            f"static_attention fa3 (or REPLAYNOISE_STATIC_ATTENTION=fa3): FlashAttention 3 needs a Hopper GPU "
            f"(sm90), not {device}"
        )
    torch.ops.load_library(str(found))
    return torch.ops._vllm_fa3_C.fwd


def attend_flash(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    first: torch.Tensor,
    end: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """One new token per row attending to its cache slots [first, end): ``q`` [rows, heads, 1, dim], ``keys`` and
    ``values`` [rows, kv_heads, slots, dim], ``first`` and ``end`` int32 [rows]; returns [rows, 1, heads, dim]
    (the query heads of a KV head consecutive, as ``kernels.attend``'s output reshapes)."""
    out = fa3_forward()(
        q.transpose(1, 2),  # [rows, 1, heads, dim]
        keys.transpose(1, 2),  # [rows, slots, kv_heads, dim], a view
        values.transpose(1, 2),
        None,  # k_new
        None,  # v_new
        None,  # q_v
        None,  # out
        None,  # cu_seqlens_q
        None,  # cu_seqlens_k
        None,  # cu_seqlens_k_new
        None,  # seqused_q
        end,  # seqused_k: the end of each row's live slots
        None,  # max_seqlen_q
        None,  # max_seqlen_k
        None,  # page_table
        None,  # kv_batch_idx
        first,  # leftpad_k: the first live slot of each row
        None,  # rotary_cos
        None,  # rotary_sin
        None,  # seqlens_rotary
        None,  # q_descale
        None,  # k_descale
        None,  # v_descale
        scaling,
        False,  # is_causal: one query, every live key
        -1,  # window_size_left
        -1,  # window_size_right
        0.0,  # softcap
        True,  # is_rotary_interleaved (no rotary here)
        None,  # scheduler_metadata
        1,  # num_splits: one program per row and head group (module docstring)
        None,  # pack_gqa: FA3's choice, from the shapes alone
        0,  # sm_margin
        None,  # s_aux
        1,  # cp_world_size
        0,  # cp_rank
        None,  # cp_tot_seqused_k
    )
    return out[0]
