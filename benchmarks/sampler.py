"""The decode step's sampler alone on a GPU: the forms of the integer nucleus against the float32 one they replaced.

    PYTHONPATH=. python benchmarks/sampler.py [--rows 64 256 512] [--ways 2 4 8 16] [--vocab 151936] [--out FILE]

For each batch size: the exhaustive sampler (the one a static decoder captures) with the top-p filter of
``sampling.nucleus_by_sorting`` (eager decoders), of ``nucleus_by_bisection`` (eager, and compiled with inductor's
default settings, which split its reductions where rows are few) and of ``nucleus_by_search`` at each of ``--ways``
(compiled as a compiled decoder compiles it, with ``kernels.SAMPLER_INDUCTOR``; the engine's is
``kernels.SAMPLER_WAYS``, 2 ways being the bisection), against the same sampler with the nucleus of a full sort and
a float32 cumulative sum (the form before, kept here as the baseline; where inductor cannot compile it, as torch
2.11's split scan at 256 rows, its compiled time is null and the error is recorded).
Logits are bf16 at three spreads: near-flat (random weights: the nucleus is most of the vocabulary), moderate and
peaked (a trained model's typical row). Prints and writes milliseconds per call (CUDA events, median of 20 after
warm-up), the compile time, and how many rows' kept sets differ from a float64 computation's.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.profile_pass import measured
from replaynoise.engines import sampling
from replaynoise.engines.hf import kernels

#: the eager sampler a static decoder captures (it sorts), and the bisection run eagerly (compiled decoders search)
eager_sort = functools.partial(sampling.sample_rows, exhaustive=True, nucleus=sampling.nucleus_by_sorting)
bisecting = functools.partial(sampling.sample_rows, exhaustive=True, nucleus=sampling.nucleus_by_bisection)


def searching(ways: int):
    """The exhaustive sampler with a ``ways``-ary threshold search. Every form shares this code, and dynamo guards its
    compiled frames on ``ways`` (a closure's cell), so each compiles as itself."""

    def sampler(logits, seeds, steps, temperature, top_p):
        nucleus = functools.partial(sampling.nucleus_by_search, ways=ways)
        return sampling.sample_rows(logits, seeds, steps, temperature, top_p, exhaustive=True, nucleus=nucleus)

    sampler.__name__ = sampler.__qualname__ = f"searching_{ways}"
    return sampler


def compiled(fn, options: dict | None = None):
    """``fn`` compiled as a compiled decoder compiles its sampler: fixed shapes, one graph."""
    return torch.compile(fn, dynamic=False, fullgraph=True, options=options)


def bisecting_split(logits, seeds, steps, temperature, top_p):
    """``bisecting`` under a name of its own, so that its compilation with inductor's default settings is its own
    (dynamo caches a compiled frame by its code, whatever the settings): the form before ``SAMPLER_INDUCTOR``, whose
    split reductions took 4.69 ms of the 1.5B's step at 256 rows where 512 rows took 2.96
    (benchmarks/results/profile-step-1.5b-2026-12-06/)."""
    return bisecting(logits, seeds, steps, temperature, top_p)


def sorted_nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The baseline: sort, softmax, float32 cumulative sum, scatter back."""
    ordered, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    drop = torch.cumsum(probs, dim=-1) - probs >= top_p
    return torch.empty_like(scores).scatter_(-1, order, ordered.masked_fill(drop, float("-inf")))


def exact_dropped(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus in float64, ties kept whole (every token whose strictly better tokens hold less than top_p):
    the reference the forms are held to. A tie's first token's float64 cumulative mass is the mass above it."""
    ordered, order = torch.sort(scores.double(), dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    group = torch.cumsum(first, dim=-1) - 1  # each tie group's number, along the sorted row
    above = torch.zeros_like(before).scatter_add_(-1, group, torch.where(first, before, 0.0))
    dropped = above.gather(-1, group) >= top_p
    return torch.zeros_like(dropped).scatter_(-1, order, dropped)


def baseline_sampler(logits, seeds, steps, temperature, top_p):
    scores = sorted_nucleus(logits.to(torch.float32) / temperature, top_p)
    keys = sampling.row_keys(seeds, steps)
    return torch.argmax(scores + sampling.gumbel(keys, scores.shape[-1]), dim=-1)


def compiles(fn, *args) -> str | None:
    """None where inductor compiles ``fn`` for these arguments, else the error (the baseline's cumulative sum fails
    in inductor's split scan at some shapes): the baseline is a reference point, not the engine's code."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - any compiler failure is recorded, not fatal
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None


def median_ms(fn, *args, repeat: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--ways", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--commit", default=None, help="the commit measured, where the code's folder is no git clone")
    args = ap.parse_args(argv)
    t, p = args.temperature, args.top_p
    compiled_baseline, compiled_split = compiled(baseline_sampler), compiled(bisecting_split)
    torch._dynamo.config.cache_size_limit = 64  # every form at every batch size, none falling back to eager
    compiled_search = {w: compiled(searching(w), kernels.SAMPLER_INDUCTOR) for w in args.ways}
    compiled_engine = kernels.compiled_sampler()
    rows_out = []
    for rows in args.rows:
        gen = torch.Generator(device="cuda").manual_seed(rows)
        seeds = torch.randint(0, 2**62, (rows,), device="cuda", generator=gen)
        steps = torch.zeros(rows, dtype=torch.int64, device="cuda")
        for spread in (0.05, 2.0, 6.0):
            logits = (torch.randn(rows, args.vocab, device="cuda", generator=gen) * spread).to(torch.bfloat16)
            start = time.perf_counter()
            compiled_engine(logits, seeds, steps, t, p)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start
            baseline_error = compiles(compiled_baseline, logits, seeds, steps, t, p)
            scores = logits.to(torch.float32) / t
            reference = exact_dropped(scores, p)
            off = {
                name: int(((torch.isinf(fn(scores, p)) != reference).any(-1)).sum())
                for name, fn in (
                    ("bisection", sampling.nucleus_by_bisection),
                    ("integer sort", sampling.nucleus_by_sorting),
                    ("float32 cumsum", sorted_nucleus),
                )
            }
            sorted_tokens = eager_sort(logits, seeds, steps, t, p)
            same = torch.equal(compiled_engine(logits, seeds, steps, t, p), sorted_tokens)
            same_split = torch.equal(compiled_split(logits, seeds, steps, t, p), sorted_tokens)
            first_s, same_search = {}, {}
            for w, fn in compiled_search.items():
                start = time.perf_counter()
                same_search[w] = torch.equal(fn(logits, seeds, steps, t, p), sorted_tokens)
                torch.cuda.synchronize()
                first_s[w] = time.perf_counter() - start
            row = {
                "rows": rows,
                "vocab": args.vocab,
                "spread": spread,
                "top_p": p,
                "kept_mean": float((~reference).sum(-1).float().mean()),
                "ms": {
                    "float32 cumsum eager": median_ms(baseline_sampler, logits, seeds, steps, t, p),
                    "float32 cumsum compiled": None
                    if baseline_error
                    else median_ms(compiled_baseline, logits, seeds, steps, t, p),
                    "integer sort eager": median_ms(eager_sort, logits, seeds, steps, t, p),
                    "bisection eager": median_ms(bisecting, logits, seeds, steps, t, p),
                    "the engine's (kernels.compiled_sampler)": median_ms(compiled_engine, logits, seeds, steps, t, p),
                    "bisection compiled, inductor's default": median_ms(compiled_split, logits, seeds, steps, t, p),
                    **{
                        f"{w}-ary search compiled (the engine's settings)": median_ms(fn, logits, seeds, steps, t, p)
                        for w, fn in compiled_search.items()
                    },
                },
                "engine_ways": kernels.SAMPLER_WAYS,
                "engine_inductor_options": kernels.SAMPLER_INDUCTOR,
                "float32_cumsum_compile_error": baseline_error,
                "first_call_s": compile_s,
                "search_first_call_s": first_s,
                "rows_off_float64": off,
                "compiled_engine_equals_eager_sort": same,
                "compiled_split_bisection_equals_eager_sort": same_split,
                "compiled_search_equals_eager_sort": same_search,
            }
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    result = {**measured(args.commit), "device": torch.cuda.get_device_name(), "rows": rows_out}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
