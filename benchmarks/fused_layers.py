"""The static decode step on a GPU with the layer body compiled by inductor (the default on CUDA) against the
same functions run eagerly (one kernel per operation): ms per step and continuation tokens/s.

    python benchmarks/fused_layers.py            # needs CUDA; Qwen2.5-0.5B shape, random bf16 weights

Writes fused_layers.json to $OUT (or the current directory). Measured on an H200 (torch 2.11, 128 steps after a
prefix of 288 positions): 512 rows 7.71 -> 5.41 ms per step (66,391 -> 94,676 tok/s); 1,024 rows 13.09 -> 9.91 ms
(78,205 -> 103,340 tok/s). The prototype that gave these numbers ran the same layer functions as a subclass.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.replay_throughput import qwen25_05b  # noqa: E402
from replaynoise.engines.hf.kernels import attend, layer_in, layer_out  # noqa: E402
from replaynoise.engines.hf.static import StaticDecoder  # noqa: E402


def bench(model, rows: int, prefix: int, steps: int, fused: bool) -> tuple[dict, torch.Tensor]:
    decoder = StaticDecoder(model, rows, prefix + steps + 1, graphs=True, attention="gemm")
    if not fused:
        decoder.layer_in, decoder.attend, decoder.layer_out = layer_in, attend, layer_out
    shape = (1, decoder.n_kv, prefix, decoder.head_dim)
    state = [
        [
            (
                torch.randn(shape, device="cuda", dtype=torch.bfloat16),
                torch.randn(shape, device="cuda", dtype=torch.bfloat16),
            )
            for _ in model.model.layers
        ]
    ]
    args = (state, [prefix], [0] * rows, list(range(rows)), [5] * rows, (1.0, 1.0))
    start = time.perf_counter()
    decoder.load(*args)
    decoder.step(), decoder.step()  # eager warm-up (compilation), then the graph capture
    torch.cuda.synchronize()
    warm = time.perf_counter() - start
    decoder.load(*args)
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = [decoder.step()[1].clone() for _ in range(steps)]
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    return {"ms_per_step": seconds * 1e3, "tok_s": rows / seconds, "warm_s": warm}, torch.stack(tokens)


def main() -> None:
    model = qwen25_05b("cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for rows in (512, 1024):
        eager, eager_tokens = bench(model, rows, 288, 128, fused=False)
        fused, fused_tokens = bench(model, rows, 288, 128, fused=True)
        fused["tokens_equal_to_eager"] = float((fused_tokens == eager_tokens).float().mean())
        out[str(rows)] = {"eager": eager, "fused": fused}
        print(
            f"{rows} rows: eager {eager['ms_per_step']:.2f} ms ({eager['tok_s']:,.0f} tok/s), fused "
            f"{fused['ms_per_step']:.2f} ms ({fused['tok_s']:,.0f} tok/s)",
            flush=True,
        )
    Path(os.environ.get("OUT", "."), "fused_layers.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
