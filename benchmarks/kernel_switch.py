"""Where decode and prefill part, one kernel setting at a time: an engine's FlashAttention 3 call (vLLM's or SGLang's)
and cuBLAS's GEMMs at the packaged Qwen models' shapes, random values, no model.

A re-fed prefix equals the decode-time state only where every kernel computes a position alike in both: the
attention of the query at position p over keys 0..p (a prefill's row p against one decode step), and each linear
layer's row (a GEMM of M = the prefill's tokens against one of M = the decode batch). This measures both:

- attention: for every key count 1..L, whether one decode step's output (the query at p, ``seqused_k`` p + 1, in a
  batch of B such rows) equals row p of a causal prefill of the whole sequence, bit for bit, in the engine's call
  (``--backend vllm``: ``vllm.vllm_flash_attn.flash_attn_varlen_func``; ``--backend sglang``:
  ``sgl_kernel.flash_attn.flash_attn_with_kvcache``, as SGLang's FA3 backend calls it for extend and decode; FA3,
  the cache paged as the engine pages it), varying one of: the head shape, the decode batch B (rows of the same
  length), the page size, ``num_splits`` (32: vLLM's bound under CUDA graphs, split by the kernel's scheduler; 0:
  the kernel's own heuristic, SGLang's stock mode; 1: one split, SGLang's deterministic mode);
- GEMMs: for each M in 1..``--max-m``, which rows of ``x[:M] @ W.T`` equal the same rows computed at M = 1:
  the M ranges that share the decode path's bits.

    PYTHONPATH=. python benchmarks/kernel_switch.py --out FILE.json [--backend sglang]

Needs an H100 or H200 and the engine's environment.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch

#: (query heads, KV heads, head dim, hidden, intermediate) of the packaged Qwen2.5-Coder models
SHAPES = {"qwen2.5-0.5b": (14, 2, 64, 896, 4864), "qwen2.5-1.5b": (12, 2, 128, 1536, 8960)}


def paged(x: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, T, kv_heads, dim] as vLLM's cache: [pages, page, kv_heads, dim], with each row's block table."""
    rows, t, h, d = x.shape
    n = -(-t // page)
    padded = torch.zeros(rows, n * page, h, d, dtype=x.dtype, device=x.device)
    padded[:, :t] = x
    table = torch.arange(rows * n, device=x.device, dtype=torch.int32).reshape(rows, n)
    return padded.reshape(rows * n, page, h, d), table


def vllm_call(fa, kc, vc, scale, num_splits):
    """vLLM's FA3 call: varlen queries over the paged cache."""

    def call(qq, cu_q, max_q, used, tab):
        return fa.flash_attn_varlen_func(
            qq,
            kc,
            vc,
            max_q,
            cu_q,
            int(used.max()),
            seqused_k=used,
            softmax_scale=scale,
            causal=True,
            block_table=tab,
            fa_version=3,
            num_splits=num_splits,
        )

    return call


def sglang_call(fa, kc, vc, scale, num_splits):
    """SGLang's FA3 call (its ``FlashAttentionBackend``): the queries over the paged cache with ``page_table`` and
    ``cache_seqlens``, for an extend (a re-fed prompt) and a decode step alike."""

    def call(qq, cu_q, max_q, used, tab):
        return fa.flash_attn_with_kvcache(
            q=qq,
            k_cache=kc,
            v_cache=vc,
            page_table=tab,
            cache_seqlens=used,
            cu_seqlens_q=cu_q,
            max_seqlen_q=max_q,
            softmax_scale=scale,
            causal=True,
            num_splits=num_splits,
        )

    return call


#: per backend: its page size and ``num_splits`` by default (vLLM: 16-token blocks, at most 32 splits under its
#: CUDA graphs; SGLang: one-token pages, the kernel's own heuristic under stock kernels)
BASE = {"vllm": (16, 32), "sglang": (1, 0)}
#: per backend: the module that carries its FA3 kernels, and the call as the engine makes it
BACKENDS = {"vllm": ("vllm.vllm_flash_attn", vllm_call), "sglang": ("sgl_kernel.flash_attn", sglang_call)}


def attention_case(
    backend: str, shape: str, length: int, batch: int, page: int, num_splits: int, seed: int = 0
) -> dict:
    """Key counts at which a decode step equals the prefill's row, for one setting."""
    heads, kv_heads, dim, *_ = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = {"device": "cuda", "dtype": torch.bfloat16}
    q = torch.randn(batch, length, heads, dim, generator=gen, **dev)
    k = torch.randn(batch, length, kv_heads, dim, generator=gen, **dev)
    v = torch.randn(batch, length, kv_heads, dim, generator=gen, **dev)
    kc, table = paged(k, page)
    vc, _ = paged(v, page)
    module, make_call = BACKENDS[backend]
    call = make_call(importlib.import_module(module), kc, vc, dim**-0.5, num_splits)

    i32 = {"device": "cuda", "dtype": torch.int32}
    prefill = call(q[0], torch.tensor([0, length], **i32), length, torch.tensor([length], **i32), table[:1])
    equal = []
    cu = torch.arange(batch + 1, **i32)
    for p in range(length):
        used = torch.full((batch,), p + 1, **i32)
        out = call(q[:, p], cu, 1, used, table)
        equal.append(bool(torch.equal(out[0], prefill[p])))
    first_unequal = next((p + 1 for p, e in enumerate(equal) if not e), None)
    bands = {}
    for lo, hi in ((1, 64), (65, 128), (129, 176), (177, 192), (193, 224), (225, 256), (257, 384), (385, length)):
        sel = equal[lo - 1 : hi]
        if sel:
            bands[f"{lo}-{hi}"] = sum(sel) / len(sel)
    return {
        "backend": backend,
        "shape": shape,
        "length": length,
        "batch": batch,
        "page": page,
        "num_splits": num_splits,
        "first_unequal_keys": first_unequal,
        "equal_share_by_keys": bands,
        "equal": "".join("1" if e else "0" for e in equal),
    }


def _ranges(same: list[bool]) -> list[list]:
    """[first M, last M, equal] runs of ``same`` (indexed from M = 1)."""
    ranges, start = [], 1
    for m in range(2, len(same) + 2):
        if m == len(same) + 1 or same[m - 1] != same[start - 1]:
            ranges.append([start, m - 1, same[start - 1]])
            start = m
    return ranges


def gemm_case(
    shape: str, name: str, k_in: int, n_out: int, max_m: int, bias: bool, prefill_m: int, seed: int = 0
) -> dict:
    """The M ranges in which every row of ``x[:M] @ W.T (+ b)`` equals the same row computed at M = 1, and the same
    row computed among ``prefill_m`` rows (a prefill's GEMM): a decode step of M sequences writes the prefill's bits
    where its M lies in the second kind of range."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(max(max_m, prefill_m), k_in, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n_out, k_in, generator=gen, device="cuda", dtype=torch.bfloat16) / k_in**0.5
    b = torch.randn(n_out, generator=gen, device="cuda", dtype=torch.bfloat16) if bias else None
    single = torch.stack([torch.nn.functional.linear(x[i : i + 1], w, b)[0] for i in range(max_m)])
    prefill = torch.nn.functional.linear(x[:prefill_m], w, b)
    same, as_prefill = [], []
    for m in range(1, max_m + 1):
        y = torch.nn.functional.linear(x[:m], w, b)
        same.append(bool(torch.equal(y, single[:m])))
        as_prefill.append(bool(torch.equal(y, prefill[:m])))
    return {
        "shape": shape,
        "layer": name,
        "in": k_in,
        "out": n_out,
        "bias": bias,
        "ranges_equal_to_m1": _ranges(same),
        "prefill_m": prefill_m,
        "ranges_equal_to_prefill": _ranges(as_prefill),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=sorted(BACKENDS), default="vllm")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--splits", type=int, nargs="+", default=[32, 0, 1])
    ap.add_argument("--max-m", type=int, default=600)
    ap.add_argument("--prefill-m", type=int, default=4096, help="rows of the prefill GEMM")
    ap.add_argument("--gemm-only", action="store_true", help="the GEMMs alone (no engine's kernels needed)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    record: dict = {
        "device": torch.cuda.get_device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "backend": args.backend,
        "attention": [],
        "gemm": [],
        "errors": [],
    }
    start = time.perf_counter()
    # one setting at a time from the engine's base, per shape: batch 8 and its page and splits at their defaults
    _, page0, splits0 = base = (8, *BASE[args.backend])
    settings = (
        {(b, page0, splits0) for b in args.batches}
        | {(8, p, splits0) for p in args.pages}
        | {(8, page0, s) for s in args.splits}
        | {base}
    )
    for shape in [] if args.gemm_only else SHAPES:
        for batch, page, splits in sorted(settings):
            try:
                r = attention_case(args.backend, shape, args.length, batch, page, splits)
            except Exception as error:  # a setting the kernel refuses is a finding, not the end of the probe
                record["errors"].append(f"{shape} batch {batch} page {page} splits {splits}: {error!r}"[:500])
                continue
            record["attention"].append(r)
            print(
                f"{shape} batch {batch:>3} page {page:>2} splits {splits}: first unequal at "
                f"{r['first_unequal_keys']} keys; {r['equal_share_by_keys']}",
                flush=True,
            )
    for shape, (heads, kv_heads, dim, hidden, inter) in SHAPES.items():
        layers = {
            "qkv": (hidden, (heads + 2 * kv_heads) * dim),
            "o": (heads * dim, hidden),
            "gate_up": (hidden, 2 * inter),
            "down": (inter, hidden),
        }
        for name, (k_in, n_out) in layers.items():
            r = gemm_case(shape, name, k_in, n_out, args.max_m, name == "qkv", args.prefill_m)
            record["gemm"].append(r)
            print(
                f"{shape} {name} {k_in}->{n_out}: M ranges equal to M=1: {r['ranges_equal_to_m1']}; to the same rows "
                f"among {args.prefill_m}: {r['ranges_equal_to_prefill']}",
                flush=True,
            )
    record["seconds"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
