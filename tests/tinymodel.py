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
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=EOS,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).to(dtype).eval()


#: Words a tiny tokenizer is trained on: the prompts' frame, the grader's marker, and the probe words
#: replaynoise.data.preparation.check_tokenizer looks up.
TINY_CORPUS = (
    "Solve the problem step by step and answer. Answer: 12. The answer is 7 apples. How many "
    "marbles does Anna have now? She gives away 3 and gets 4 more. 0 1 2 3 4 5 6 7 8 9 10 "
)
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


#: How far apart the ``close`` model's answer logits are (the scale of their context-dependent part).
CLOSE_SPREAD = 2.0


def save_tiny_chat_model(path, seed: int = 0, close: bool = False, hidden: int = 32, intermediate: int = 64):
    """A local HF model directory as a user would give one: a random two-layer Llama in safetensors with a
    byte-level BPE tokenizer that has a chat template. Seconds to make; no GGUF, no download.

    With ``close``, its answer tokens stay near-tied, their order set by the context: one hidden dimension of
    every embedding is large, so the final norm keeps it large, and the output layer lifts all answers by it
    alike. Then most positions are low-margin (pivots) and sampled continuations differ, as a workflow run's
    mechanics need. ``hidden`` and ``intermediate``: wider layers, whose CPU GEMMs sum by thread count."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    specials = ["<|end|>", "<|pad|>", "<|user|>", "<|assistant|>"]
    raw.train_from_iterator(
        [TINY_CORPUS] * 4,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|end|>", pad_token="<|pad|>", chat_template=TINY_CHAT_TEMPLATE
    )
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    # It answers with digits (and stops): the output layer reaches no other token, so a few of its short answers
    # are right by chance, and a GRPO step has rewards that differ within a group, hence a gradient.
    answers = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)] + [tokenizer.eos_token_id]
    with torch.no_grad():
        head = torch.zeros_like(model.lm_head.weight)
        head[answers] = torch.randn(len(answers), cfg.hidden_size)
        if close:
            model.model.embed_tokens.weight[:, 0] = 1.0
            head[answers, 0] = 1.3
            head[answers, 1:] *= CLOSE_SPREAD
        model.lm_head.weight.copy_(head)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
