"""Sampling with common random numbers.

Continuation k of branch b at pivot t draws its noise from a generator seeded only by (config, problem, pivot,
branch, k), one Gumbel vector per step. The same row therefore meets the same noise in every pass, whatever batch
it lands in, and differences between passes come from the numerics alone.
"""

from __future__ import annotations

import hashlib

import torch

class RowSampler:
    """Gumbel-max sampling for one row: token = argmax(logits / T + g), g drawn from the row's own generator."""

    def __init__(self, seed: int, temperature: float, top_p: float) -> None:
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)
        self.temperature = temperature
        self.top_p = top_p

    def sample(self, logits: torch.Tensor) -> int:
        """Sample from float32 ``logits`` of shape [vocab]; the noise is drawn even when greedy, to keep streams aligned."""
        uniform = torch.rand(logits.shape[-1], generator=self.generator, dtype=torch.float64)
        if self.temperature <= 0:
            return int(torch.argmax(logits))
        scores = logits.double() / self.temperature
        if self.top_p < 1.0:
            scores = _mask_outside_nucleus(scores, self.top_p)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
        return int(torch.argmax(scores + gumbel))


def _mask_outside_nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_scores, order = torch.sort(scores, descending=True)
    probs = torch.softmax(sorted_scores, dim=-1)
    cumulative = torch.cumsum(probs, dim=-1)
    drop = cumulative - probs >= top_p  # keep the smallest prefix whose mass reaches top_p
    masked = sorted_scores.masked_fill(drop, float("-inf"))
    return torch.empty_like(scores).scatter_(0, order, masked)


def logits_digest(logits: torch.Tensor) -> str:
    """A digest of the exact bits of a float32 logits vector: equal digests mean bitwise-equal logits."""
    data = logits.detach().to(torch.float32).contiguous().cpu().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """Top-k ids and log-probs of the untempered distribution, ordered by probability."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    values, ids = torch.topk(logprobs, k)
    return [int(i) for i in ids], [float(v) for v in values]
