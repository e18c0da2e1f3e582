"""Where one refilled static decode step's GPU time goes (issue 56): the step a pass replays from its CUDA graph
(``static.RefillDecoder``, the stock ``static_rows`` decoder), at a real model's shape with random weights (a step's
kernels and their cost do not depend on the weights' values), for several row counts at one cache length.

    PYTHONPATH=. python benchmarks/profile_step.py [--shape qwen2.5-1.5b] [--rows 256 512 1024] [--length 1088]
        [--out FILE.json] [--commit SHA]

Why: on the real 1.5B a refilled step of 256 rows took 11.4 ms, as long as one of 512 rows (11.6 ms;
``benchmarks/results/real-1.5b-refill-2026-12-06/``), while the step's memory roofline (weights and every row's
cache read once) is about 3 and 5 ms. Those numbers were decode seconds over decode steps, host work included.
This separates the captured step's own GPU time (CUDA events around graph replays) from the rest, and splits that
GPU time by kernel (``torch.profiler``): the sampler's kernels, attention, GEMMs. Needs a CUDA device and the
workflow's packages (on a machine without network: their wheels copied there), no model weights.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.profile_pass import measured  # noqa: E402
from benchmarks.static_attention import SHAPES  # noqa: E402
from replaynoise.engines.hf.kernels import compiled_sampler, static_attention  # noqa: E402
from replaynoise.engines.hf.static import RefillDecoder  # noqa: E402

#: kernel name patterns -> the part of the step they belong to (first match wins; the rest is "other"). The
#: ``gemm`` attention's two batched GEMMs are cuBLAS kernels like the projections' and count as "gemm"; its
#: softmax, and the whole of the ``sdpa`` and ``efficient`` kernels, as "attention"
GROUPS = [
    ("attention", re.compile(r"attention|fmha|flash|softmax|sdpa", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|cublas|nvjet|matmul", re.I)),
    ("triton", re.compile(r"^triton_", re.I)),
    ("copy/fill", re.compile(r"copy|fill|scatter|index|elementwise|vectorized", re.I)),
]


def group_of(name: str) -> str:
    return next((g for g, pattern in GROUPS if pattern.search(name)), "other")


def kernel_ms(prof, calls: int) -> dict[str, float]:
    """Each kernel's device time per call (of ``calls`` profiled), by name, from a CUDA-only profile."""
    return {
        e.key: e.self_device_time_total / 1000.0 / calls for e in prof.key_averages() if e.self_device_time_total > 0
    }


def admitted(model, rows: int, length: int, prefix: int) -> RefillDecoder:
    """A refilled decoder of ``rows`` rows and ``length`` slots, every row admitted with a random prefix of
    ``prefix`` positions and started with the paper's sampling (T 0.7, top_p 0.95)."""
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    decoder = RefillDecoder(model, rows, length, graphs=True, attention=static_attention())
    state = torch.randn(
        cfg.num_hidden_layers, 2, 1, cfg.num_key_value_heads, prefix, head_dim, device="cuda", dtype=torch.bfloat16
    )
    decoder.admit(list(range(rows)), [state] * rows, [prefix] * rows, list(range(rows)), [5] * rows)
    decoder.start((0.7, 0.95))
    return decoder


def measure(model, rows: int, length: int, prefix: int, steps: int, profiled: int) -> dict:
    decoder = admitted(model, rows, length, prefix)
    for _ in range(3):  # eager first step (compilation), capture, one replay
        decoder.step()
    torch.cuda.synchronize()
    events = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        decoder.step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    step_ms = statistics.median(a.elapsed_time(b) for a, b in events)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            decoder.step()
        torch.cuda.synchronize()
    kernels = kernel_ms(prof, profiled)
    groups: defaultdict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        groups[group_of(name)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    vocab = model.config.vocab_size
    del decoder
    torch.cuda.empty_cache()
    sampler_ms = sampler_time(rows, vocab, profiled)
    torch.cuda.empty_cache()
    return {
        "rows": rows,
        "length": length,
        "prefix": prefix,
        "step_ms": step_ms,
        "kernel_ms_per_step": sum(kernels.values()),
        "sampler_kernel_ms": sampler_ms,
        "groups_ms": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [{"kernel": k[:160], "ms": ms} for k, ms in top],
    }


def sampler_time(rows: int, vocab: int, calls: int) -> float:
    """The GPU time of the passes' sampler alone (``kernels.compiled_sampler``: Gumbel-max with the top-p filter's
    threshold search at ``kernels.SAMPLER_WAYS`` ways, T 0.7, top_p 0.95) on [rows, vocab] float32 logits: its
    kernels' device time per call. The step hands it the head's bf16 logits, so this reads twice the step's logit
    bytes: a measure of how the sampler's cost moves with rows, not the step's own sampler time (which is among the
    step's kernels)."""
    sample = compiled_sampler()
    logits = torch.randn(rows, vocab, device="cuda") * 4
    seeds = torch.arange(rows, device="cuda", dtype=torch.int64)
    steps = torch.zeros(rows, device="cuda", dtype=torch.int64)
    for _ in range(3):
        sample(logits, seeds, steps, 0.7, 0.95)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            sample(logits, seeds, steps, 0.7, 0.95)
        torch.cuda.synchronize()
    return sum(kernel_ms(prof, calls).values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen2.5-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--length", type=int, default=1088, help="cache slots (the real 1.5B's refilled decoders: 1,088)")
    ap.add_argument("--prefix", type=int, default=600)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profiled", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--commit", default=None, help="the commit measured, where the code's folder is no git clone")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_step.py times CUDA graphs: it needs a CUDA device")
    cls, config = SHAPES[args.shape]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = cls(config).to(torch.bfloat16).eval()
    results = []
    for rows in args.rows:
        r = measure(model, rows, args.length, args.prefix, args.steps, args.profiled)
        results.append(r)
        print(
            f"{args.shape} rows {rows} slots {args.length}: step {r['step_ms']:.3f} ms (events), kernels "
            f"{r['kernel_ms_per_step']:.3f} ms, sampler alone {r['sampler_kernel_ms']:.3f} ms; "
            + ", ".join(f"{g} {ms:.3f}" for g, ms in r["groups_ms"].items()),
            flush=True,
        )
        for k in r["top_kernels_ms"][:8]:
            print(f"    {k['ms']:8.3f} ms  {k['kernel'][:120]}", flush=True)
    report = {
        "shape": args.shape,
        **measured(args.commit),
        "device": torch.cuda.get_device_name(),
        "attention": static_attention(),
        "results": results,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
