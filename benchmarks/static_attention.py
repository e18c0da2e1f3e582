"""Which attention the static decoder should use (``REPLAYNOISE_STATIC_ATTENTION``): one decode step, compiled and
replayed from its CUDA graph as a pass runs it, timed for each attention at real model shapes (random weights:
the step's cost does not depend on their values) and the batch sizes and contexts of the H200 runs.

    PYTHONPATH=. python benchmarks/static_attention.py [--out FILE.json]

Needs a CUDA device and the workflow's packages (on a machine without network: their wheels copied there), no model
weights. Prints one row per (model, rows, prefix) with the median step time of each attention over several loads
of the decoder.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replaynoise.engines.hf.states import bucket  # noqa: E402
from replaynoise.engines.hf.static import StaticDecoder  # noqa: E402

#: what the Qwen2.5(-Coder) sizes packaged here share: vocabulary, two KV heads, norm, RoPE, tied embeddings
QWEN25 = functools.partial(
    Qwen2Config,
    vocab_size=151936,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
#: the configurations of the packaged models (their config.json), as (class, config)
SHAPES = {
    "smollm2-135m": (
        LlamaForCausalLM,
        LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=True,
        ),
    ),
    "qwen2.5-0.5b": (
        Qwen2ForCausalLM,
        QWEN25(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    ),
    # Qwen2.5-Coder-1.5B-Instruct's (the ladder's packaged 1.5B; benchmarks/profile_step.py)
    "qwen2.5-1.5b": (
        Qwen2ForCausalLM,
        QWEN25(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    ),
    # Qwen2.5-7B's (benchmarks/scale.py's random-weight shape: four KV heads, untied head)
    "qwen2.5-7b": (
        Qwen2ForCausalLM,
        QWEN25(
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        ),
    ),
}
#: (model, rows, prefix): the H200 pipeline runs' batches (1,024 rows, mean prefix 90) and a longer context
CASES = [("smollm2-135m", 1024, 90), ("smollm2-135m", 256, 90), ("qwen2.5-0.5b", 1024, 90), ("qwen2.5-0.5b", 256, 400)]
ATTENTIONS = ("sdpa", "gemm")
STEPS = 32


def step_ms(model, rows: int, prefix: int, attention: str, loads: int = 5) -> float:
    """Median GPU time of one graph-replayed step, over ``loads`` fills of the decoder of STEPS steps each."""
    cfg = model.config
    decoder = StaticDecoder(model, rows, bucket(prefix + STEPS + 1), graphs=True, attention=attention)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    state = torch.randn(
        cfg.num_hidden_layers, 2, 1, cfg.num_key_value_heads, prefix, head_dim, device="cuda", dtype=torch.bfloat16
    )
    times = []
    for load in range(loads):
        decoder.load([state], [prefix], [0] * rows, list(range(rows)), [5] * rows, (0.7, 1.0))
        for step in range(STEPS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            decoder.step()
            end.record()
            if load and step >= 2:  # the first load compiles and captures
                times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("static_attention.py times CUDA graphs: it needs a CUDA device")
    rows_out, models = [], {}
    print(f"{'model':<14}{'rows':>6}{'prefix':>8}{'slots':>7}" + "".join(f"{a + ' ms':>10}" for a in ATTENTIONS))
    for name, rows, prefix in CASES:
        if name not in models:
            cls, config = SHAPES[name]
            torch.manual_seed(0)
            with torch.device("cuda"):
                models = {name: cls(config).to(torch.bfloat16).eval()}  # one model on the device at a time
        times = {a: step_ms(models[name], rows, prefix, a) for a in ATTENTIONS}
        rows_out.append(
            {
                "model": name,
                "rows": rows,
                "prefix": prefix,
                "slots": bucket(prefix + STEPS + 1),
                "step_ms": times,
                "device": torch.cuda.get_device_name(),
            }
        )
        print(
            f"{name:<14}{rows:>6}{prefix:>8}{bucket(prefix + STEPS + 1):>7}"
            + "".join(f"{times[a]:>10.3f}" for a in ATTENTIONS),
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps({"torch": torch.__version__, "rows": rows_out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
