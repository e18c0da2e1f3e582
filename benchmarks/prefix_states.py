"""Where the per-pivot cost of a pass goes before decoding: exact's stored-KV load and verification probe against
refeed's prefill and kv_maxdiff record. On a GPU the two passes cost about the same (README: Performance); this
splits that cost into its parts, each timed per pivot (median over pivots) with the device synchronised.

    PYTHONPATH=. python benchmarks/prefix_states.py [--device cuda] [--prompt-len 128 1024] [--out DIR]

Qwen2.5-0.5B shape with random bf16 weights (as `replay_throughput.py gpu`); prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from replay_throughput import qwen25_05b, timed  # noqa: E402

from replaynoise.engines.base import ContinuationRequest, RolloutRequest, SamplingSettings  # noqa: E402
from replaynoise.engines.hf.engine import HFEngine, HFOptions  # noqa: E402
from replaynoise.engines.hf.kvfiles import load_kv  # noqa: E402


def per_pivot_ms(fn, requests, device: str) -> float:
    """Median milliseconds of ``fn(request)`` over the requests, each call synchronised on both sides."""
    return 1e3 * statistics.median(timed(lambda: fn(req), device)[1] for req in requests)  # noqa: B023 (called at once)


def measure(engine: HFEngine, prompt_len: int, rollouts: int, device: str) -> dict:
    vocab = engine.model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    kv_dir = Path(tempfile.mkdtemp(prefix="kv-"))
    requests = []
    for i in range(rollouts):
        prompt = tuple(int(t) for t in torch.randint(0, vocab - 1000, (prompt_len,), generator=gen))
        (r,) = engine.generate_rollouts(
            [RolloutRequest(f"p{i}", prompt, 100 + i)],
            SamplingSettings(1.0, 1.0, 64),
            kv_dir,
            lambda ro: len(ro.prompt_ids) + len(ro.response_ids) - 1,
        )
        for t in range(8, len(r.response_ids) - 1, 8):
            requests.append(
                ContinuationRequest(
                    f"p{i}@{t}",
                    "orig",
                    0,
                    1,
                    tuple(r.prompt_ids + r.response_ids[:t]),
                    r.response_ids[t],
                    r.kv_file,
                    r.kv_sha256,
                    r.logits_digests[t],
                )
            )
    files = {r.kv_file: r.kv_sha256 for r in requests}
    first_of_file = list({r.kv_file: r for r in requests}.values())

    def cold(fn):
        def go(req):
            engine.stored.clear()
            fn(req)

        return go

    for req in first_of_file:  # warm-up: kernels, allocator
        engine.decode_state(req)
        engine.prefix_state(req, "refeed_ids")
    row = {
        "prompt_len": prompt_len,
        "pivots": len(requests),
        "kv_files": len(files),
        "prefix_len_mean": statistics.mean(len(r.prefix_ids) for r in requests),
        "kv_file_mb_mean": statistics.mean(Path(f).stat().st_size for f in files) / 2**20,
    }
    row["kv_load_with_sha256_ms"] = per_pivot_ms(
        lambda r: load_kv(r.kv_file, r.kv_sha256, device=engine.device), first_of_file, device
    )
    row["kv_load_ms"] = per_pivot_ms(lambda r: load_kv(r.kv_file, None, device=engine.device), first_of_file, device)
    row["exact_state_cold_file_ms"] = per_pivot_ms(cold(engine.decode_state), first_of_file, device)
    row["exact_state_ms"] = per_pivot_ms(engine.decode_state, requests, device)  # file in memory: probe, checks
    row["refeed_prefill_ms"] = per_pivot_ms(lambda r: engine.forwards.prefill(list(r.prefix_ids)), requests, device)
    row["refeed_state_ms"] = per_pivot_ms(lambda r: engine.prefix_state(r, "refeed_ids"), requests, device)
    row["one_token_step_ms"] = per_pivot_ms(
        lambda r: engine.forwards.prefill(list(r.prefix_ids[-1:])), requests, device
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--rollouts", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of the same vocabulary (smoke test)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "out"))
    args = parser.parse_args()
    model = qwen25_05b(args.device, args.tiny)
    engine = HFEngine(
        model,
        SimpleNamespace(eos_token_id=model.config.eos_token_id, pad_token_id=0),
        HFOptions(kernels="stock", topk=5, decode="auto", cpu_matmul="fp32"),
    )
    rows = [measure(engine, n, args.rollouts, args.device) for n in args.prompt_len]
    keys = [k for k in rows[0] if k.endswith("_ms")]
    print(f"{'per pivot, median ms':<28}" + "".join(f"{'prompt ' + str(r['prompt_len']):>14}" for r in rows))
    for key in ("prefix_len_mean", "kv_file_mb_mean", *keys):
        print(f"{key:<28}" + "".join(f"{r[key]:>14.2f}" for r in rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"prefix_states_{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                "torch": torch.__version__,
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
