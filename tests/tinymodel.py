"""A tiny random Llama and the three tokenizer attributes the engine reads: numerics tests on the CPU that need
no weights (the packaged models are in conftest.py)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, EOS = 300, 299


class Tokenizer:
    all_special_ids = [EOS]
    eos_token_id = EOS

    def decode(self, ids, **_):
        return " ".join(map(str, ids))


def tiny_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype).eval()
