"""The passes' decode attention against FlashAttention 3 (issue 56, item 2): one new token per row over a static
cache whose row r holds position p in slot p (the refilled decoder's layout), timed for the engine's compiled
``gemm`` attention (two batched GEMMs and a float32 softmax over every slot, the dead ones masked) and for the FA3
kernels vLLM's wheel carries (``vllm.vllm_flash_attn``, ``fa_version=3``), which read each row's live positions
only (``seqused_k``; the cache passed as one page a row). Random values at real head shapes; no model.

    PYTHONPATH=. python benchmarks/fa3_attention.py [--out FILE.json]

Needs an H100 or H200 and vLLM's environment. Per (shape, rows): the median time of one layer's attention over 50
calls (launched, and replayed from a CUDA graph as the engine runs its step), the live KV's bytes over the launched
time (TB/s), the largest difference of the two outputs, whether FA3 gives the same bits twice, and whether a row's
FA3 output is the same alone as in its batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import vllm.vllm_flash_attn as fa  # vLLM's environment (its wheel carries the FA3 kernels)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replaynoise.engines.hf.kernels import attend, compile_fixed  # noqa: E402

#: (query heads, KV heads, head dim) of the packaged 1.5B and of the 7B shape
SHAPES = {"qwen2.5-1.5b": (12, 2, 128), "qwen2.5-7b": (28, 4, 128)}


def timed(fn, reps: int = 50, graph: bool = False) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` calls, each between CUDA events; ``graph``: of its CUDA graph's
    replay, as the engine runs its step (no launch gaps)."""
    for _ in range(3):
        fn()
    if graph:
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        fn = captured.replay
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def case(name: str, rows: int, slots: int, seed: int = 0) -> dict:
    heads, kv_heads, dim = SHAPES[name]
    group, scaling = heads // kv_heads, dim**-0.5
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = {"device": "cuda", "dtype": torch.bfloat16}
    lengths = torch.randint(600, 1000, (rows,), generator=gen, device="cuda", dtype=torch.int32)
    q = torch.randn(rows, heads, 1, dim, generator=gen, **dev)
    # the engine's layout: [rows, kv_heads, slots, dim]; FA's: [pages = rows, page = slots, kv_heads, dim]
    keys = torch.randn(rows, kv_heads, slots, dim, generator=gen, **dev)
    values = torch.randn(rows, kv_heads, slots, dim, generator=gen, **dev)
    mask = (torch.arange(slots, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    k_fa, v_fa = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
    q_fa = q.reshape(rows, heads, dim)
    cu_q = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    pages = torch.arange(rows, device="cuda", dtype=torch.int32)[:, None]
    gemm = compile_fixed(attend)

    def ours():
        return gemm(q, keys, values, mask, scaling, rows, kv_heads, group, dim)

    def fa3(qq=q_fa, used=lengths, table=pages, n=rows):
        return fa.flash_attn_varlen_func(
            qq,
            k_fa,
            v_fa,
            1,
            cu_q[: n + 1],
            slots,
            seqused_k=used,
            softmax_scale=scaling,
            causal=True,
            block_table=table,
            fa_version=3,
        )

    a, b = ours().reshape(rows, heads, dim), fa3()
    live = int(lengths.sum()) * kv_heads * dim * 2 * 2  # K and V, bf16
    one = fa3(q_fa[5:6], lengths[5:6], pages[5:6], 1)
    out = {
        "shape": name,
        "rows": rows,
        "slots": slots,
        "mean_live_positions": float(lengths.float().mean()),
        "gemm_ms": timed(ours),
        "fa3_ms": timed(fa3),
        "gemm_graph_ms": timed(ours, graph=True),
        "fa3_graph_ms": timed(fa3, graph=True),
        "live_kv_bytes": live,
        "max_abs_difference": float((a.float() - b.float()).abs().max()),
        "fa3_same_bits_twice": bool(torch.equal(fa3(), b)),
        "fa3_row_alone_as_in_batch": bool(torch.equal(one[0], b[5])),
    }
    out["gemm_tb_per_s"] = live / out["gemm_ms"] / 1e9
    out["fa3_tb_per_s"] = live / out["fa3_ms"] / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--slots", type=int, default=1088)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = [case(name, n, args.slots) for name in SHAPES for n in args.rows]
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": rows}
    for r in rows:
        print(
            f"{r['shape']:>13} {r['rows']:>5} rows: gemm {r['gemm_ms']:.3f} ms"
            f" ({r['gemm_tb_per_s']:.2f} TB/s of live KV),"
            f" fa3 {r['fa3_ms']:.3f} ms ({r['fa3_tb_per_s']:.2f}), max |diff| {r['max_abs_difference']:.2e},"
            f" fa3 twice {r['fa3_same_bits_twice']}, alone as in batch {r['fa3_row_alone_as_in_batch']};"
            f" graph replays: gemm {r['gemm_graph_ms']:.3f} ms, fa3 {r['fa3_graph_ms']:.3f} ms"
        )
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
