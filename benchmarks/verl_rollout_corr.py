"""verl's own rollout-correction metrics on fixed log-probs, the fixture ``tests/test_rl_metrics.py`` checks
``replaynoise.analysis.rl_metrics`` against.

Run in a throwaway environment where verl installs (it imports on CPU; it is not a dependency of this project):

    python3 -m venv /tmp/fw-venv
    .venv/bin/python -c "import site; print(site.getsitepackages()[0])" \
        > /tmp/fw-venv/lib/python3.11/site-packages/main.pth
    /tmp/fw-venv/bin/pip install verl==0.9.1
    PYTHONPATH=. /tmp/fw-venv/bin/python benchmarks/verl_rollout_corr.py tests/data/verl_rollout_corr.json

(the .pth line lends verl this project's torch and polars). Each case is a batch of sequences of different lengths,
padded and masked as verl's trainer hands them over: seeded synthetic gaps, small and large (weights past verl's
threshold of 2, a sequence past its clamp of 20), and the first re-fed prefixes of two committed references.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import polars as pl
import torch
import verl
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

#: committed mismatch tables whose first re-fed prefixes become cases, with how many pivots each gives
REFERENCES = {
    "vllm-1.5b": "reference/gpu-vllm/ladder/qwen-1.5b/analysis/qwen2.5-coder-1.5b-vllm/mismatch.parquet",
    "sglang-1.5b": "reference/gpu-sglang/qwen-1.5b-vllm-problems/analysis/qwen2.5-coder-1.5b-sglang/mismatch.parquet",
}
PIVOTS = 4


def synthetic(seed: int, scale: float, lengths: list[int]) -> tuple[list[list[float]], list[list[float]]]:
    """Rollout log-probs drawn below zero, training ones the rollout's moved by normal gaps of ``scale``."""
    rng = np.random.default_rng(seed)
    rollout = [-rng.exponential(1.0, n) for n in lengths]
    train = [a + rng.normal(0.0, scale, a.size) for a in rollout]
    return [a.tolist() for a in rollout], [b.tolist() for b in train]


def committed(path: str) -> tuple[list[list[float]], list[list[float]]]:
    rows = pl.read_parquet(path).filter(pl.col("pass") == "refeed", pl.col("n_tokens") > 0).sort("pivot_id")
    rows = rows.head(PIVOTS)
    return rows["decode_logprobs"].to_list(), rows["refeed_logprobs"].to_list()


def verl_metrics(rollout: list[list[float]], train: list[list[float]]) -> dict[str, float]:
    """verl's metrics of one batch: token-level IS at its default threshold of 2, no rejection."""
    width = max(len(a) for a in rollout)
    old, roll = (
        torch.zeros(len(rollout), width, dtype=torch.float64),
        torch.zeros(len(rollout), width, dtype=torch.float64),
    )
    mask = torch.zeros(len(rollout), width, dtype=torch.float64)
    for i, (a, b) in enumerate(zip(rollout, train)):
        roll[i, : len(a)] = torch.tensor(a, dtype=torch.float64)
        old[i, : len(b)] = torch.tensor(b, dtype=torch.float64)
        mask[i, : len(a)] = 1.0
    _, _, metrics = compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=roll, response_mask=mask, rollout_is="token", rollout_is_threshold=2.0
    )
    return {key: float(value) for key, value in sorted(metrics.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    cases = {
        "small-gaps": synthetic(1, 0.01, [5, 17, 3, 40, 11]),
        "large-gaps": synthetic(2, 0.8, [9, 2, 25, 14, 6, 30]),
        "past-clamp": synthetic(3, 3.0, [12, 4, 20]),
        **{name: committed(path) for name, path in REFERENCES.items()},
    }
    record = {
        "verl_version": verl.__version__,
        "torch_version": torch.__version__,
        "function": "verl.trainer.ppo.rollout_corr_helper.compute_rollout_correction_and_rejection_mask"
        "(rollout_is='token', rollout_is_threshold=2.0), float64 tensors",
        "command": "PYTHONPATH=. python benchmarks/verl_rollout_corr.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "cases": {
            name: {"rollout": rollout, "train": train, "verl": verl_metrics(rollout, train)}
            for name, (rollout, train) in cases.items()
        },
    }
    args.out.write_text(json.dumps(record, separators=(",", ":")) + "\n")
    print(f"{args.out}: {len(cases)} cases, verl {verl.__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
