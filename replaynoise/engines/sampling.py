"""Sampling with common random numbers.

Continuation k of branch b at pivot t draws its noise from its own seed, derived only from (config, problem,
pivot, branch, k): one Gumbel vector per step. The same row therefore meets the same noise in every pass, whatever
batch it lands in, and differences between passes come from the numerics alone.

The noise is counter-based: the uniform for (row seed, step, vocabulary index) is a 32-bit integer hash of the
three, computed with int64 torch ops whose results are identical on CPU and GPU. No generator state has to be
carried along, so a whole batch is sampled with a few tensor operations on the device that holds the logits (a
GPU never sends its logits to the CPU to sample), and a row's noise cannot depend on its batch.
"""

from __future__ import annotations

import functools
import math

import torch

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (lowbias32 family) on int64 tensors holding values in [0, 2**32).

    Both multipliers are below 2**31, so no int64 product overflows and CPU and GPU agree bit for bit."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    return x ^ (x >> 15)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row from its 63-bit seed and its step number (int64 tensors of shape [rows])."""
    h = _mix32((seeds & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seeds >> 32) & _M32))
    return _mix32(h ^ (steps & _M32))


def _noise(keys: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Float32 Gumbel noise -log(-log(u)) for (row key, vocabulary index) pairs (broadcasting int64 tensors);
    u takes the 23 high bits of their hash, centred: exact in float32 and inside [2**-24, 1 - 2**-24]."""
    bits = _mix32(keys ^ _mix32(index + 0x7F4A7C15)) >> 9
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(uniform))


def gumbel(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The noise of every row over the whole vocabulary: [rows, vocab]."""
    return _noise(keys[:, None], torch.arange(vocab, device=keys.device, dtype=torch.int64)[None, :])


#: Fixed-point scale of the nucleus weights: a row of up to 2**21 tokens sums below 2**63 in int64.
_WEIGHT_BITS = 42


def _nucleus_terms(scores: torch.Tensor, top_p: float) -> tuple[torch.Tensor, ...]:
    """Per row: the weights w = exp(score - best) in [0, 1] (their order is the scores'), the same as fixed-point
    integers floor(w * 2**42), and the mass a nucleus must stay below, top_p of the row's integer total.

    Integer sums are exact in any order, so both nucleus forms below keep exactly the same tokens, and which
    tokens a row keeps depends on that row alone, never on its batch, kernel or device."""
    weight = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
    fixed = (weight * float(1 << _WEIGHT_BITS)).to(torch.int64)
    return weight, fixed, fixed.sum(dim=-1, keepdim=True).to(torch.float64) * top_p


def nucleus_by_sorting(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep, per row, every token whose strictly better tokens hold less than top_p of the mass; the rest -inf.
    Tokens of equal weight stand or fall together.

    The form for eager code: one sort of the weights (no indices) and a cumulative sum of their integers."""
    weight, fixed, limit = _nucleus_terms(scores, top_p)
    ordered = torch.sort(weight, dim=-1, descending=True).values
    ordered_fixed = (ordered * float(1 << _WEIGHT_BITS)).to(torch.int64)
    mass_before = torch.cumsum(ordered_fixed, dim=-1) - ordered_fixed
    last = (mass_before < limit).sum(dim=-1, keepdim=True) - 1  # the best token always has none before it
    return scores.masked_fill(weight < ordered.gather(-1, last), float("-inf"))


#: The bit patterns of weights in [0, 1] span [0, 0x3F800000], under 2**30 values: the nucleus's threshold is one
#: of them, and every search for it starts from these bounds.
_LOW, _HIGH = -1, 0x3F800000


def search_passes(ways: int) -> int:
    """The passes a ``ways``-ary search needs to pin the threshold to one float32 value: each pass keeps one of
    ``ways`` intervals of at most ceil(width / ways) (30 at 2 ways, 8 at 16)."""
    if ways < 2:  # one way never narrows the interval
        raise ValueError(f"a threshold search needs at least 2 ways, not {ways}")
    width, passes = _HIGH - _LOW, 0
    while width > 1:
        width, passes = -(-width // ways), passes + 1
    return passes


def nucleus_by_search(scores: torch.Tensor, top_p: float, ways: int) -> torch.Tensor:
    """``nucleus_by_sorting``'s tokens without a sort: the threshold is found by a ``ways``-ary search over the
    float32 bit patterns of the weights, each pass ways - 1 masked integer sums per row. For compiled code, where
    inductor fuses a pass's sums into one read of the row (on a GPU several times faster than a sort of the
    vocabulary), so more ways mean fewer reads of a row too long to stay on chip; eager, each sum makes
    [rows, vocab] temporaries and is slower than the sort. Every sum is exact, so any number of ways keeps the
    same tokens."""
    weight, fixed, limit = _nucleus_terms(scores, top_p)
    level = weight.view(torch.int32).to(torch.int64)  # monotone in the weight, for weights >= 0
    # invariant: the mass strictly above level `low` reaches the limit, above `high` it does not (none is above 1.0)
    low = torch.full_like(limit, _LOW, dtype=torch.int64)
    high = torch.full_like(limit, _HIGH, dtype=torch.int64)
    for _ in range(search_passes(ways)):
        width, new_low, new_high = high - low, low, high
        for j in range(1, ways):
            mid = low + width * j // ways
            short = torch.where(level > mid, fixed, 0).sum(dim=-1, keepdim=True) < limit
            new_high = torch.minimum(new_high, torch.where(short, mid, high))
            new_low = torch.maximum(new_low, torch.where(short, low, mid))
        low, high = new_low, new_high
    return scores.masked_fill(level < high, float("-inf"))


def nucleus_by_bisection(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """``nucleus_by_search`` at two ways: 30 passes of one sum."""
    return nucleus_by_search(scores, top_p, 2)


#: The noise is bounded (u in [2**-24, 1 - 2**-24]): a token whose score is this far below the row's best score
#: can never win the argmax, so only the tokens above it need noise (1.0 of margin covers float32 rounding).
_NOISE_SPAN = -math.log(-math.log(1 - 2.0**-24)) + math.log(-math.log(2.0**-24)) + 1.0


def sample_rows(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    temperature: float,
    top_p: float,
    exhaustive: bool = False,
    nucleus=nucleus_by_sorting,
) -> torch.Tensor:
    """Gumbel-max sampling of every row: argmax(logits / T + g), g the row's noise at its step.

    ``logits`` [rows, vocab] (any float dtype, computed in float32), ``seeds`` and ``steps`` int64 [rows] on the
    same device; returns int64 token ids [rows] there. Greedy (T <= 0) takes the argmax; the noise of a step
    does not depend on whether earlier steps drew any, so streams stay aligned.

    By default the noise is computed only for the tokens that can still win (scores within the noise's span of
    the row's best), which gives the same token as the exhaustive form at a fraction of the memory traffic;
    ``exhaustive=True`` computes it over the whole vocabulary, with static shapes (for CUDA graphs).
    ``nucleus`` is any form of the top-p filter: the same tokens, by a sort or (compiled code) by a search."""
    if temperature <= 0:
        return torch.argmax(logits, dim=-1)
    scores = logits.to(torch.float32) / temperature
    if top_p < 1.0:
        scores = nucleus(scores, top_p)
    keys = row_keys(seeds, steps)
    if exhaustive:
        return torch.argmax(scores + gumbel(keys, scores.shape[-1]), dim=-1)
    best = scores.max(dim=-1, keepdim=True).values
    rows, cols = torch.nonzero(scores >= best - _NOISE_SPAN, as_tuple=True)
    total = scores[rows, cols] + _noise(keys[rows], cols)
    row_best = torch.full((scores.shape[0],), float("-inf"), device=scores.device).scatter_reduce(
        0, rows, total, "amax"
    )
    winner = torch.where(total == row_best[rows], cols, scores.shape[-1])  # ties: the lowest index, as argmax
    return torch.full_like(row_best, scores.shape[-1], dtype=torch.int64).scatter_reduce(0, rows, winner, "amin")


class RowSampler:
    """One row's sampler (rollouts): the same noise as ``sample_rows`` gives that row in any batch."""

    def __init__(self, seed: int, temperature: float, top_p: float) -> None:
        self.seed = torch.tensor([seed], dtype=torch.int64)
        self.temperature = temperature
        self.top_p = top_p
        self.step = 0

    def sample(self, logits: torch.Tensor) -> int:
        """Sample from float32 ``logits`` of shape [vocab] at this row's next step."""
        steps = torch.tensor([self.step], dtype=torch.int64)
        self.step += 1
        return int(
            sample_rows(
                logits[None, :], self.seed.to(logits.device), steps.to(logits.device), self.temperature, self.top_p
            )[0]
        )


@functools.cache
def _digest_weights(vocab: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Two odd 31-bit weights per vocabulary index (fixed, device-independent values)."""
    index = torch.arange(vocab, dtype=torch.int64, device=device)
    return ((_mix32(index + 0x51ED27) >> 1) | 1), ((_mix32(index + 0x2545F491) >> 1) | 1)


def digest_rows(logits: torch.Tensor) -> torch.Tensor:
    """Two 50-bit hashes per row of the exact float32 bits of ``logits`` [rows, vocab], computed where the
    logits are (no host copy of the vocabulary per step): int64 [rows, 2].

    Each term is (bits * odd weight) mod 2**32, a bijection of a 32-bit value, so changing any one logit always
    changes the sum; integer sums do not depend on reduction order, so the result is the same on any device."""
    bits = logits.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & _M32
    w1, w2 = _digest_weights(bits.shape[-1], str(bits.device))
    h1 = ((bits * w1) & _M32).sum(-1)
    h2 = (((bits ^ (bits >> 16)) * w2) & _M32).sum(-1)
    return torch.stack((h1, h2), dim=-1)


def digest_strings(digests) -> list[str]:
    """``digest_rows`` output (a tensor or nested lists) as one hex string per row."""
    rows = digests.tolist() if isinstance(digests, torch.Tensor) else digests
    return [f"{a:013x}{b:013x}" for a, b in rows]


def logits_digest(logits: torch.Tensor) -> str:
    """The digest of one float32 logits vector [vocab]: equal digests mean bitwise-equal logits."""
    return digest_strings(digest_rows(logits[None, :]))[0]


def logprob_rows(logits: torch.Tensor) -> torch.Tensor:
    """The untempered log-probs of every row, computed in float32: the one form every recorded log-prob takes, so
    a top-k entry and a sampled token's own log-prob of one step are the same number."""
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def topk_of(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and values of log-probs [rows, vocab] (``logprob_rows``)."""
    values, ids = torch.topk(logprobs, k, dim=-1)
    return ids, values


def token_logprob_of(logprobs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Each row's log-prob of its own token: ``logprobs`` [rows, vocab], ``tokens`` int64 [rows]."""
    return logprobs.gather(-1, tokens[:, None].to(logprobs.device))[:, 0]


def topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids and log-probs of the untempered distribution of every row, on the logits' device."""
    return topk_of(logprob_rows(logits), k)


#: prefix positions whose next-token log-probs one head GEMM computes at a time (``prefix_scores``): a batch's
#: prefixes never hold [rows, length, vocab] logits at once (Qwen's 151,936-token vocabulary: 0.6 MB a position)
SCORE_CHUNK = 256


def prefix_scores(
    model: torch.nn.Module, hidden: torch.Tensor, seqs: list[list[int]], starts: list[int | None], pads: list[int]
) -> list[list[float] | None]:
    """Each scored row's tokens' log-probs from the hidden states of its prefill: the head applied to
    ``SCORE_CHUNK`` positions at a time, only the target token's log-prob kept, one host copy at the end."""
    rows, cols, targets = [], [], []
    for row, (seq, start) in enumerate(zip(seqs, starts)):
        if start is not None:
            for j in range(max(start, 1), len(seq)):
                rows.append(row), cols.append(pads[row] + j - 1), targets.append(seq[j])
    if not rows:
        return [None if start is None else [] for start in starts]
    softcap = getattr(model.config, "final_logit_softcapping", None)
    index = (torch.tensor(rows, device=hidden.device), torch.tensor(cols, device=hidden.device))
    target = torch.tensor(targets, device=hidden.device)
    out = torch.empty(len(rows), dtype=torch.float32, device=hidden.device)
    for lo in range(0, len(rows), SCORE_CHUNK):
        part = slice(lo, lo + SCORE_CHUNK)
        logits = model.lm_head(hidden[index[0][part], index[1][part]]).to(torch.float32)
        if softcap is not None:  # Gemma's final soft cap, as its forward applies it
            logits = torch.tanh(logits / softcap) * softcap
        out[part] = token_logprob_of(logprob_rows(logits), target[part])
    values, scores, at = out.tolist(), [], 0
    for seq, start in zip(seqs, starts):
        n = 0 if start is None else len(seq) - max(start, 1)
        scores.append(None if start is None else values[at : at + n])
        at += n
    return scores
