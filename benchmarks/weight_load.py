"""How fast can a job's weights reach the GPU (issue 56, item 3: the fixed cost per job)? The 7B shape's random
weights (15.2 GB of bf16 safetensors, as benchmarks/scale.py makes them) loaded in fresh processes, the files in the
page cache as a run's later jobs find them: by transformers' ``from_pretrained`` with ``device_map`` on the GPU (what
``replaynoise.data.loading.load_weights`` does), by safetensors' ``safe_open`` straight to the GPU, and read into host
memory alone (no GPU), the bound of both.

    python benchmarks/weight_load.py DIR [--out FILE.json] [--repeats 2]

Needs a CUDA device, torch, transformers and safetensors; writes the model into DIR first where it is not there,
in benchmarks/static_attention.py's 7B shape (so the project's packages too, for that step alone).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CASES = ("transformers", "safetensors", "read")


def make(folder: Path) -> None:
    """The 7B shape of benchmarks/static_attention.py (imported here alone: the timed processes need none of it)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.static_attention import SHAPES

    cls, config = SHAPES["qwen2.5-7b"]
    with torch.device("cuda"):
        model = cls(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")


def case(name: str, folder: Path) -> float:
    """Seconds for one case in this (fresh) process, the imports apart."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    shards = sorted(folder.glob("*.safetensors"))
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # the CUDA context, not counted
    start = time.perf_counter()
    if name == "transformers":
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda", use_safetensors=True)
    elif name == "safetensors":
        kept = []
        for shard in shards:
            with safe_open(shard, framework="pt", device="cuda:0") as f:
                kept += [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118 - safe_open has no iteration
    else:
        buffer = bytearray(1 << 26)
        for shard in shards:
            with open(shard, "rb", buffering=0) as f:
                while f.readinto(buffer):
                    pass
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.case:
        print(json.dumps({"seconds": case(args.case, args.folder)}))
        return 0
    if not list(args.folder.glob("*.safetensors")):
        start = time.perf_counter()
        make(args.folder)
        print(f"made {args.folder} in {time.perf_counter() - start:.1f} s", flush=True)
    size = sum(p.stat().st_size for p in args.folder.glob("*.safetensors"))
    rows = []
    for repeat in range(args.repeats):
        for name in CASES:
            run = [sys.executable, __file__, str(args.folder), "--case", name]
            seconds = json.loads(
                subprocess.run(run, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            )
            rows.append({"case": name, "repeat": repeat, **seconds, "gb_per_s": size / seconds["seconds"] / 1e9})
            print(
                f"{name:>12} repeat {repeat}: {seconds['seconds']:.2f} s, {rows[-1]['gb_per_s']:.2f} GB/s", flush=True
            )
    import torch

    record = {"bytes": size, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
