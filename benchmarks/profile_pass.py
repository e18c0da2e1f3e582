"""Where a replay pass's time goes on a GPU: real batches of the workflow's own pass, profiled.

    PYTHONPATH=. python benchmarks/profile_pass.py RUN_DIR --configfile CFG --config NAME --pass exact [--batches 8]

RUN_DIR holds a run's rollouts and pivots (``snakemake ... results/pivots/NAME.parquet`` is enough). The pass's
batches are those of its real schedule, built as the rule builds them (``continuations.build_requests``,
``make_schedule``, ``with_restep_once``). Two batches warm up (kernel compilation, graph capture); the next N
run with CUDA events around every decode step, then N more under ``torch.profiler``. Prints the phases
(``progress.Phases``), the decode step's GPU time against its roofline (weights and every row's KV read once per
step at 4.8 TB/s, ``replay_throughput.roofline``), the GPU's busy share of the profiled wall time, and the
busiest kernels and host operators.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.replay_throughput import roofline
from replaynoise.config import validate_config
from replaynoise.engines import make_engine
from replaynoise.engines.base import SamplingSettings
from replaynoise.generation import continuations, passes, replay
from replaynoise.io import read_json, read_parquet
from replaynoise.overlays import load_campaign
from replaynoise.provenance import git_commit


def timed_steps(engine) -> list:
    """Wrap every static decoder's ``step`` so each records CUDA events around it; returns the event list."""
    events: list = []
    for decoder in engine.forwards.decoders.values():
        if getattr(decoder.step, "timed", False):
            continue
        inner = decoder.step

        def step(inner=inner):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner()
            end.record()
            events.append((start, end))
            return out

        step.timed = True
        decoder.step = step
    return events


def run_config(run: Path, configfile: Path) -> dict:
    """The run's configuration, validated from its folder, where its relative model paths resolve (the workflow
    runs there)."""
    raw = load_campaign(configfile.resolve())
    with contextlib.chdir(run):
        return validate_config(raw)


def measured(commit: str | None) -> dict:
    """What a result was measured with: the commit (given, or this folder's git HEAD) and torch's version."""
    return {"commit": commit or git_commit(Path(__file__).parents[1]).get("commit"), "torch": torch.__version__}


def publish(summary: dict, averages, out: Path | None) -> None:
    """Print the summary and the busiest kernels and host operators; write the summary to ``out`` if given."""
    print(json.dumps(summary, indent=1))
    print(averages.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
    print(averages.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    if out:
        out.write_text(json.dumps(summary, indent=1) + "\n")


def prepared_model(results: Path, settings: dict) -> Path:
    """The run's prepared directory of the configuration's model and dtype, found by the description
    ``prepare_model`` wrote into it (not by re-deriving the workflow's directory names)."""
    for info in sorted(results.glob("models/*/replaynoise-model.json")):
        described = read_json(info)
        if described["spec"] == settings["model"] and described["dtype"] == settings["dtype"]:
            return info.parent
    raise SystemExit(f"{results}/models holds no prepared {settings['model']} in {settings['dtype']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--configfile", type=Path, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--pass", dest="pass_name", default="exact", choices=sorted(passes.PASSES))
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="JSON summary")
    ap.add_argument("--commit", default=None, help="the commit measured, where the code's folder is no git clone")
    args = ap.parse_args(argv)

    cfg = run_config(args.run, args.configfile)
    settings, r = cfg["configs"][args.config], cfg["replay"]
    results = args.run / "results"
    engine = make_engine(settings, prepared_model(results, settings), topk=cfg["pivots"]["topk"], threads=8)
    pivots = read_parquet(results / "pivots" / f"{args.config}.parquet")
    rollouts = read_parquet(results / "rollouts" / args.config / "rollouts.parquet")
    kv_dirs = sorted((results / "rollouts" / args.config / "kv").iterdir())
    requests = continuations.build_requests(
        pivots,
        rollouts,
        pass_name=args.pass_name,
        k=r["k"],
        seed=cfg["seed"],
        config_name=args.config,
        tokenizer=engine.tokenizer,
        kv_dirs=kv_dirs,
    )
    schedule = continuations.make_schedule(
        len(requests), r["batch_size"], continuations.schedule_seed(cfg["seed"], args.config, args.pass_name)
    )
    requests = replay.with_restep_once(requests, schedule)
    batches = [[requests[i] for i in rows] for rows in schedule]
    source = passes.PASSES[args.pass_name].source
    sampling = SamplingSettings(
        settings["temperature"] if r["temperature"] is None else r["temperature"],
        settings["top_p"] if r["top_p"] is None else r["top_p"],
        r["max_new_tokens"],
    )
    n = args.batches
    if len(batches) < 2 + 2 * n:
        raise SystemExit(f"the pass has {len(batches)} batches; --batches {n} needs {2 + 2 * n}")

    for batch in batches[:2]:
        engine.run_batch(batch, source, sampling)
    torch.cuda.synchronize()
    warm = dict(engine.phases.seconds)
    engine.phases.seconds.clear()

    events = timed_steps(engine)
    start, tokens = time.perf_counter(), 0
    for batch in batches[2 : 2 + n]:
        tokens += sum(len(res.token_ids) for res in engine.run_batch(batch, source, sampling))
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    step_ms = [a.elapsed_time(b) for a, b in events]
    phases = dict(engine.phases.seconds)

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for batch in batches[2 + n : 2 + 2 * n]:
            engine.run_batch(batch, source, sampling)
        torch.cuda.synchronize()
        profiled_wall = time.perf_counter() - start
    averages = prof.key_averages()
    busy = sum(e.self_device_time_total for e in averages) / 1e6

    lengths = [len(req.prefix_ids) for batch in batches[2 : 2 + n] for req in batch]
    context = sum(lengths) / len(lengths) + r["max_new_tokens"] / 2
    roof = roofline(engine.model, r["batch_size"], context)
    median_step = sorted(step_ms)[len(step_ms) // 2]
    summary = {
        **measured(args.commit),
        "config": args.config,
        "pass": args.pass_name,
        "device": torch.cuda.get_device_name(),
        "batch_size": r["batch_size"],
        "batches": n,
        "rows": sum(map(len, batches[2 : 2 + n])),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "phases_s": phases,
        "warmup_phases_s": warm,
        "decode_steps": len(step_ms),
        "step_ms_median": median_step,
        "step_ms_sum": sum(step_ms),
        "roofline_step_ms": roof["seconds"] * 1e3,
        "roofline_fraction": roof["seconds"] * 1e3 / median_step,
        "mean_context": context,
        "profiled_wall_s": profiled_wall,
        "gpu_busy_s": busy,
        "gpu_busy_share": busy / profiled_wall,
    }
    publish(summary, averages, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
