"""Does vLLM's top-k/top-p filter draw a row's nucleus the same alone as among other rows?

vLLM 0.26 filters with a Triton kernel from 8 rows on and with a sort and ``torch.cumsum`` below 8
(``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p``). For rows of logits from flat to peaked, this
counts the rows whose kept set differs between the row filtered alone (as in a step with one request left) and
filtered among 64 rows, by vLLM's own filter and by the engine's replacement
(``replaynoise.engines.vllm.build.row_invariant_top_k_top_p``), and prints one JSON line:

    PYTHONPATH=. python benchmarks/vllm_top_p_probe.py [--rows 512] [--vocab 49152] [--top-p 0.95]

Results of the H200: benchmarks/results/h200-vllm-top-p/.
"""

from __future__ import annotations

import argparse
import json

import torch
from vllm.v1.sample.ops import topk_topp_sampler

from replaynoise.engines.vllm.build import row_invariant_top_k_top_p

BATCH = 64


def differing_rows(filt, logits: torch.Tensor, p: torch.Tensor) -> tuple[int, int]:
    """(rows whose kept set differs alone vs among BATCH rows, rows whose masked logits differ at all)."""
    kept, bits = 0, 0
    for start in range(0, logits.shape[0], BATCH):
        block, pb = logits[start : start + BATCH], p[start : start + BATCH]
        together = filt(block.clone(), None, pb)
        for row in range(block.shape[0]):
            alone = filt(block[row : row + 1].clone(), None, pb[row : row + 1])[0]
            kept += not torch.equal(torch.isfinite(alone), torch.isfinite(together[row]))
            bits += not torch.equal(alone, together[row])
    return kept, bits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--top-p", type=float, default=0.95)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = torch.linspace(0.5, 12, args.rows, device="cuda")[:, None]
    logits = torch.randn(args.rows, args.vocab, device="cuda", generator=gen) * scale
    p = torch.full((args.rows,), args.top_p, device="cuda")
    stock = differing_rows(topk_topp_sampler.apply_top_k_top_p, logits, p)
    ours = differing_rows(row_invariant_top_k_top_p(topk_topp_sampler.apply_top_k_top_p_triton), logits, p)
    print(
        json.dumps(
            {
                "rows": args.rows,
                "vocab": args.vocab,
                "top_p": args.top_p,
                "batch": BATCH,
                "vllm_filter": {"kept_set_differs": stock[0], "logits_differ": stock[1]},
                "row_invariant_filter": {"kept_set_differs": ours[0], "logits_differ": ours[1]},
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
