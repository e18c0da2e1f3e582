"""Where decode and prefill part, one kernel setting at a time: vLLM's FlashAttention 3 and cuBLAS's GEMMs at the
packaged Qwen models' shapes, random values, no model.

A re-fed prefix equals the decode-time state only where every kernel computes a position alike in both: the
attention of the query at position p over keys 0..p (a prefill's row p against one decode step), and each linear
layer's row (a GEMM of M = the prefill's tokens against one of M = the decode batch). This measures both:

- attention: for every key count 1..L, whether one decode step's output (the query at p, ``seqused_k`` p + 1, in a
  batch of B such rows) equals row p of a causal prefill of the whole sequence, bit for bit, in vLLM's call
  (``vllm.vllm_flash_attn.flash_attn_varlen_func``, FA3, the cache paged as vLLM pages it), varying one of: the
  head shape, the decode batch B (rows of the same length), the page size, ``num_splits`` (32: vLLM's bound under
  CUDA graphs, split by the kernel's scheduler; 0: the kernel's own heuristic; 1: one split);
- GEMMs: for each M in 1..``--max-m``, which rows of ``x[:M] @ W.T`` equal the same rows computed at M = 1:
  the M ranges that share the decode path's bits.

    PYTHONPATH=. python benchmarks/kernel_switch.py --out FILE.json

Needs an H100 or H200 and vLLM's environment.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import vllm.vllm_flash_attn as fa  # vLLM's environment: its wheel carries the FA3 kernels

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


def attention_case(shape: str, length: int, batch: int, page: int, num_splits: int, seed: int = 0) -> dict:
    """Key counts at which a decode step equals the prefill's row, for one setting."""
    heads, kv_heads, dim, *_ = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = {"device": "cuda", "dtype": torch.bfloat16}
    q = torch.randn(batch, length, heads, dim, generator=gen, **dev)
    k = torch.randn(batch, length, kv_heads, dim, generator=gen, **dev)
    v = torch.randn(batch, length, kv_heads, dim, generator=gen, **dev)
    kc, table = paged(k, page)
    vc, _ = paged(v, page)
    scale = dim**-0.5

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
        "shape": shape,
        "length": length,
        "batch": batch,
        "page": page,
        "num_splits": num_splits,
        "first_unequal_keys": first_unequal,
        "equal_share_by_keys": bands,
        "equal": "".join("1" if e else "0" for e in equal),
    }


def gemm_case(shape: str, name: str, k_in: int, n_out: int, max_m: int, bias: bool, seed: int = 0) -> dict:
    """The M ranges in which every row of ``x[:M] @ W.T (+ b)`` equals the same row computed at M = 1."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(max_m, k_in, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n_out, k_in, generator=gen, device="cuda", dtype=torch.bfloat16) / k_in**0.5
    b = torch.randn(n_out, generator=gen, device="cuda", dtype=torch.bfloat16) if bias else None
    single = torch.stack([torch.nn.functional.linear(x[i : i + 1], w, b)[0] for i in range(max_m)])
    same = []
    for m in range(1, max_m + 1):
        y = torch.nn.functional.linear(x[:m], w, b)
        same.append(bool(torch.equal(y, single[:m])))
    ranges, start = [], 1
    for m in range(2, max_m + 2):
        if m == max_m + 1 or same[m - 1] != same[start - 1]:
            ranges.append([start, m - 1, same[start - 1]])
            start = m
    return {"shape": shape, "layer": name, "in": k_in, "out": n_out, "bias": bias, "ranges_equal_to_m1": ranges}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--splits", type=int, nargs="+", default=[32, 0, 1])
    ap.add_argument("--max-m", type=int, default=600)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    record: dict = {
        "device": torch.cuda.get_device_name(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "attention": [],
        "gemm": [],
        "errors": [],
    }
    start = time.perf_counter()
    # one setting at a time from a base (batch 8, page 16, vLLM's 32 splits at most), per shape
    settings = (
        {(b, 16, 32) for b in args.batches} | {(8, p, 32) for p in args.pages} | {(8, 16, s) for s in args.splits}
    )
    for shape in SHAPES:
        for batch, page, splits in sorted(settings):
            try:
                r = attention_case(shape, args.length, batch, page, splits)
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
            r = gemm_case(shape, name, k_in, n_out, args.max_m, bias=name == "qkv")
            record["gemm"].append(r)
            print(f"{shape} {name} {k_in}->{n_out}: M ranges equal to M=1: {r['ranges_equal_to_m1']}", flush=True)
    record["seconds"] = round(time.perf_counter() - start, 1)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
