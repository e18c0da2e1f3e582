"""A re-feed whose prompt hits a prefix cache: the prompt's KV comes from a prefill of the prompt alone, as a radix
or prefix cache holding it from an earlier request serves it, and only the response's tokens are computed on top
of it, in one batched forward over the batch's pivots. Beside the cold re-feed (all of the prefix in one forward)
it says what a cache hit alone moves.
"""

from __future__ import annotations

import torch
from torch.nn.attention import sdpa_kernel
from transformers import DynamicCache

from replaynoise.engines.hf.forwards import Forwards
from replaynoise.engines.hf.kernels import EAGER_ATTENTION
from replaynoise.engines.hf.kvfiles import stack_layers
from replaynoise.engines.hf.states import PrefixState, cache_layers, left_padded, left_padded_cache
from replaynoise.engines.sampling import prefix_scores


def stacked(f: Forwards, cache: DynamicCache) -> torch.Tensor:
    """The cache's layers as one tensor in the model's dtype; refused where the layers differ in shape."""
    whole = stack_layers(cache_layers(cache))
    if whole is None:
        raise ValueError("refeed_cached needs every layer's KV whole; this model's sliding-window layers keep a window")
    return whole.to(f.model.dtype)


def prompt_alone(f: Forwards, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One prompt prefilled by itself (batch of one, no padding): its stacked KV [layers, 2, 1, kv_heads, n,
    head_dim] and its hidden states [n, hidden], what a cache that computed it for another request holds."""
    cache = DynamicCache()
    with sdpa_kernel(EAGER_ATTENTION):
        hidden = f.model.base_model(
            input_ids=torch.tensor([prompt], device=f.device), past_key_values=cache, use_cache=True
        ).last_hidden_state
    return stacked(f, cache), hidden[0]


def tails_on_prompts(
    f: Forwards, prompts: list[torch.Tensor], tails: list[list[int]]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every row's tail computed in one batched forward over its prompt's KV (``prompts[i]``, stacked): the
    cached prompts left-padded, then the tails left-padded after them, the padding of both masked out. Returns
    each row's whole KV (prompt then tail, unpadded) and its tail's hidden states [len(tail), hidden]."""
    states = [PrefixState(None, kv.shape[-2], True, None, kv=kv) for kv in prompts]
    cache, held = left_padded_cache(states)
    ids, mask, positions = left_padded(tails)
    lengths = torch.tensor([state.length for state in states])
    with sdpa_kernel(EAGER_ATTENTION):
        hidden = f.model.base_model(
            input_ids=ids.to(f.device),
            attention_mask=torch.cat([held, mask], dim=1).to(f.device),
            position_ids=(positions + lengths[:, None]).to(f.device),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state
    whole = stacked(f, cache)
    first, longest = held.shape[1], ids.shape[1]
    kvs, hiddens = [], []
    for row, (state, tail) in enumerate(zip(states, tails)):
        kept = whole[:, :, row : row + 1]
        kvs.append(
            torch.cat([kept[..., first - state.length : first, :], kept[..., first + longest - len(tail) :, :]], -2)
        )
        hiddens.append(hidden[row, longest - len(tail) :])
    return kvs, hiddens


def cached_refeed(
    f: Forwards, seqs: list[list[int]], prompt_lens: list[int], starts: list[int | None]
) -> tuple[list[torch.Tensor], list]:
    """Each prefix's KV with its prompt (``seq[:prompt_lens[i]]``) served from a prompt-alone prefill (each
    distinct prompt once) and its tail computed over it; where a row has a start, the log-probs these forwards
    give its tokens from there on (a prefix of the prompt alone needs no second forward)."""
    held = {
        prompt: prompt_alone(f, list(prompt))
        for prompt in dict.fromkeys(tuple(s[:n]) for s, n in zip(seqs, prompt_lens))
    }
    rows = [i for i, (seq, n) in enumerate(zip(seqs, prompt_lens)) if len(seq) > n]
    kvs = [held[tuple(seq[:n])][0] for seq, n in zip(seqs, prompt_lens)]
    hiddens = [held[tuple(seq[:n])][1] for seq, n in zip(seqs, prompt_lens)]
    if rows:
        tail_kv, tail_hidden = tails_on_prompts(f, [kvs[i] for i in rows], [seqs[i][prompt_lens[i] :] for i in rows])
        for i, kv, hidden in zip(rows, tail_kv, tail_hidden):
            kvs[i], hiddens[i] = kv, torch.cat([hiddens[i], hidden])
    if all(start is None for start in starts):
        return kvs, [None] * len(seqs)
    longest = max(map(len, seqs))
    padded = hiddens[0].new_zeros(len(seqs), longest, hiddens[0].shape[-1])
    for row, hidden in enumerate(hiddens):
        padded[row, longest - hidden.shape[0] :] = hidden
    return kvs, prefix_scores(f.model, padded, seqs, starts, [longest - len(seq) for seq in seqs])
