"""Generated tokens per second of the workflow's own rules, from a finished run (the path a user runs).

    PYTHONPATH=. python benchmarks/pipeline.py RUN_DIR [--out benchmarks/results/h200-pipeline.json]

RUN_DIR is the workflow's working directory (``--directory``). For every rollout and pass job it reads the
rule's Snakemake benchmark file (wall seconds of the whole job: start-up, model load, kernel compilation and
the work) and the table the job wrote (rows and generated tokens), and the log's closing line (seconds of the
generation loop alone). Rows: {rule, config, model, dtype, rows, generated_tokens, seconds, tokens_per_s,
loop_seconds, loop_tokens_per_s}, with the commit, the device and the versions of the run (provenance.json).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from importlib.metadata import version
from pathlib import Path

import polars as pl

from replaynoise.config import validate_config
from replaynoise.overlays import load_campaign
from replaynoise.provenance import hardware

LOOP = re.compile(r": done, (\d+) rows, (\d+) generated tokens in ([\d.]+) s")
PHASE = re.compile(r"([^,;]+?) ([\d.]+) s")
STEPS = re.compile(r"([^,]+?) (\d+)(?:,|$)")


def logged(log: Path, label: str) -> str | None:
    """What follows ``label`` on the log's last line that has it."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [line for line in text.splitlines() if label in line]
    return lines[-1].split(label, 1)[1] if lines else None


def phases(log: Path, label: str = ": time by phase: ") -> dict[str, float] | None:
    """Seconds per phase, from the log's "time by phase" line (progress.Phases) or another line of its form."""
    line = logged(log, label)
    return None if line is None else {name.strip(): float(s) for name, s in PHASE.findall(line)}


def steps(log: Path) -> dict[str, int] | None:
    """Model steps per phase (progress.Phases.count), where the engine logs them."""
    line = logged(log, ": steps by phase: ")
    return None if line is None else {name.strip(): int(n) for name, n in STEPS.findall(line)}


def loop_seconds(log: Path) -> float | None:
    found = LOOP.findall(log.read_text(errors="replace")) if log.is_file() else []
    return sum(float(s) for *_, s in found) if found else None


def rows_for(run: Path, config: dict) -> list[dict]:
    results = run / "results"
    out, others = [], set()
    for bench in sorted((results / "benchmarks").glob("*/*.tsv")):
        rule = bench.parent.name
        if rule in ("prepare_model", "train_grpo"):  # per model, not per shard: no generated-token rate
            continue
        cfg, shard = bench.stem.rsplit(".", 1)
        if cfg not in config["configs"]:  # another configuration file's, run on the same folder
            others.add(cfg)
            continue
        table_file = (
            results / "rollouts" / cfg / "shards" / f"{shard}.parquet"
            if rule == "generate_rollouts"
            else results / "passes" / cfg / rule.removeprefix("replay_") / f"{shard}.parquet"
        )
        if not table_file.is_file():
            continue  # the job did not finish
        seconds = float(pl.read_csv(bench, separator="\t")["s"][0])
        table = pl.read_parquet(table_file)
        if rule == "generate_rollouts":
            rows, tokens = table.height, int(table["response_ids"].list.len().sum())
        else:
            rows, tokens = table.height, int(table["n_tokens"].sum())
        log = results / "logs" / rule / f"{cfg}.{shard}.log"
        loop = loop_seconds(log)
        settings = config["configs"][cfg]
        out.append(
            {
                "rule": rule,
                "config": cfg,
                "shard": shard,
                "model": settings["model"],
                "dtype": settings["dtype"],
                "rows": rows,
                "generated_tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "loop_seconds": loop,
                "loop_tokens_per_s": tokens / loop if loop else None,
                "phases": phases(log),
                "steps": steps(log),
                "startup": phases(log, "engine start-up by phase: "),
                "gpu_memory": logged(log, ": GPU memory: "),
            }
        )
    if others:
        print(
            f"left out: the folder's configurations {sorted(others)}, which no configuration file given names",
            file=sys.stderr,
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--configfile",
        type=Path,
        default=None,
        help="the run's configuration, where the run has no provenance.json yet (it did not finish)",
    )
    ap.add_argument("--commit", default=None, help="the commit measured, where the run directory cannot tell")
    args = ap.parse_args(argv)
    path = args.run / "results" / "provenance.json"
    provenance = (
        json.loads(path.read_text())
        if path.is_file()
        else {
            "config": validate_config(load_campaign(args.configfile)),
            "hardware": hardware(),
            "packages": {name: version(name) for name in ("torch", "transformers", "snakemake", "polars")},
            "git": {"note": "no provenance.json: the run did not finish"},
        }
    )
    rows = rows_for(args.run, provenance["config"])
    print(
        f"{'rule':<22} {'config':<20} {'rows':>7} {'tokens':>9} {'job s':>7} {'tok/s':>8} {'loop s':>7} "
        f"{'loop tok/s':>10}"
    )
    for r in rows:
        loop = f"{r['loop_seconds']:7.1f} {r['loop_tokens_per_s']:10,.0f}" if r["loop_seconds"] else ""
        print(
            f"{r['rule']:<22} {r['config']:<20} {r['rows']:>7} {r['generated_tokens']:>9} {r['seconds']:7.1f} "
            f"{r['tokens_per_s']:8,.0f} {loop}"
        )
    if args.out:
        record = {
            "commit": args.commit or provenance.get("git", {}),
            "hardware": provenance.get("hardware"),
            "packages": {
                k: v
                for k, v in provenance.get("packages", {}).items()
                if k in ("torch", "transformers", "vllm", "sglang", "snakemake", "polars")
            },
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
