"""Where a rollout step's time goes on a GPU: the workflow's own ``rollouts.generate`` on a run's problems, profiled.

    PYTHONPATH=. python benchmarks/profile_rollouts.py RUN_DIR --configfile CFG --config NAME [--out FILE]

RUN_DIR holds a run's sampled problems (``results/problems/*.parquet``) and prepared model. The step runs twice into
scratch folders: once to warm up (kernels, graph capture), once under ``torch.profiler`` with CUDA events around
every decode step. Prints the phases (``progress.Phases``: prefill, load states, decode, results to host, store
KV), each phase's share of the loop, the decode step's GPU time against the weights-and-KV memory roofline, and the
busiest kernels and host operators. Nothing of the run is changed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.profile_pass import measured, prepared_model, publish, run_config, timed_steps
from benchmarks.replay_throughput import roofline
from replaynoise.engines import make_engine
from replaynoise.engines.base import SamplingSettings
from replaynoise.generation import rollouts
from replaynoise.generation.pivots import PivotRules
from replaynoise.io import read_parquet
from replaynoise.settings import PromptSettings, RolloutSettings


def run_step(engine, problems, cfg: dict, name: str, scratch: Path) -> tuple[float, int]:
    """One whole rollout step as the rule runs it, into ``scratch``; (wall seconds, tokens generated)."""
    s = cfg["configs"][name]
    start = time.perf_counter()
    job = rollouts.RolloutJob(
        config_name=name,
        seed=cfg["seed"],
        sampling=SamplingSettings(s["temperature"], s["top_p"], s["max_new_tokens"]),
        prompt=PromptSettings.of(cfg["prompt"]),
        rollouts=RolloutSettings.of(cfg["rollouts"]),
        rules=PivotRules.from_config(cfg["pivots"], s["block_size"]),
    )
    frame = rollouts.generate(engine, problems, job, kv_dir=scratch / "kv", work_dir=scratch / "work")
    torch.cuda.synchronize()
    return time.perf_counter() - start, sum(map(len, frame["response_ids"].to_list()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--configfile", type=Path, required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", type=Path, default=None, help="JSON summary")
    ap.add_argument("--commit", default=None, help="the commit measured, where the code's folder is no git clone")
    args = ap.parse_args(argv)

    cfg = run_config(args.run, args.configfile)
    settings = cfg["configs"][args.config]
    results = args.run / "results"
    engine = make_engine(settings, prepared_model(results, settings), topk=cfg["pivots"]["topk"], threads=8)
    problems = read_parquet(next((results / "problems").glob("*.parquet")))
    with tempfile.TemporaryDirectory(dir=args.run) as scratch:
        run_step(engine, problems, cfg, args.config, Path(scratch) / "warm")
        warm = dict(engine.phases.seconds)
        engine.phases.seconds.clear()
        events = timed_steps(engine)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall, tokens = run_step(engine, problems, cfg, args.config, Path(scratch) / "profiled")
    phases = dict(engine.phases.seconds)
    loop = sum(phases.values())
    averages = prof.key_averages()
    busy = sum(e.self_device_time_total for e in averages) / 1e6
    step_ms = sorted(a.elapsed_time(b) for a, b in events)
    rows = min(cfg["rollouts"]["batch_size"], problems.height * cfg["rollouts"]["per_problem"])  # one batch's rows
    roof = roofline(engine.model, rows, settings["max_new_tokens"] / 2 + 100)
    summary = {
        **measured(args.commit),
        "config": args.config,
        "device": torch.cuda.get_device_name(),
        "rows_per_batch": rows,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "phases_s": phases,
        "phase_share_of_loop": {k: v / loop for k, v in phases.items()},
        "warmup_phases_s": warm,
        "decode_steps": len(step_ms),
        "step_ms_median": step_ms[len(step_ms) // 2] if step_ms else None,
        "memory_roofline_step_ms": roof["seconds"] * 1e3,
        "gpu_busy_s": busy,
        "gpu_busy_share": busy / wall,
    }
    if step_ms:
        summary["memory_roofline_fraction"] = roof["seconds"] * 1e3 / summary["step_ms_median"]
    publish(summary, averages, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
