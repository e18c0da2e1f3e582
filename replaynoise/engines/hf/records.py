"""A rollout batch's per-step records: the device buffers a static decode fills step by step
(``step_records``, filled by ``Forwards.record_steps``), and a row's rollout from its records once on the host
(``rollout_of``)."""

from __future__ import annotations

import torch

from replaynoise.engines.base import Rollout, RolloutRequest
from replaynoise.engines.sampling import digest_strings


def step_records(rows: int, steps: int, topk: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Device buffers of a rollout batch's per-step records: top-k ids, top-k log-probs, digests, tokens, the
    tokens' own log-probs."""
    return (
        torch.zeros(rows, steps, topk, dtype=torch.int64, device=device),
        torch.zeros(rows, steps, topk, dtype=torch.float32, device=device),
        torch.zeros(rows, steps, 2, dtype=torch.int64, device=device),
        torch.zeros(rows, steps, dtype=torch.int64, device=device),
        torch.zeros(rows, steps, dtype=torch.float32, device=device),
    )


def rollout_of(
    req: RolloutRequest,
    eos_ids: set[int],
    tokens: list[int],
    top_ids: list[list[int]],
    top_lps: list[list[float]],
    digests: list[list[int]],
    token_lps: list[float],
) -> Rollout:
    """A row's rollout from its sampled tokens (cut after the first of ``eos_ids``) and per-step records (host
    lists, one entry per step)."""
    end = next((j for j, t in enumerate(tokens) if t in eos_ids), None)
    n = len(tokens) if end is None else end + 1
    return Rollout(
        req.problem_id,
        list(req.prompt_ids),
        tokens[:n],
        top_ids[:n],
        top_lps[:n],
        digest_strings(digests[:n]),
        "length" if end is None else "eos",
        rollout=req.rollout,
        token_logprobs=token_lps[:n],
    )
