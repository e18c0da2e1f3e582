"""The final answer's token span of a response (the answer the grader reads), which pivots may be kept out of.

The span is found in the decoded text and mapped back to tokens through each token's start character. Decoding every
prefix gives those offsets for any tokenizer (``char_offsets``), at a cost quadratic in the response's length: 1.55-1.59
s a 64-row batch of 512-token responses on a GPU machine's CPU, about a sixth of a 7B-shape rollout batch's loop
(benchmarks/results/rollouts-compiled-2026-12-07/). Byte-level (GPT-2 style) tokenizers such as Qwen2.5's and SmolLM2's
decode a prefix as its tokens' bytes read as UTF-8, so their offsets come from one incremental pass
(``token_offsets``), checked against the whole text and the prefix decoding taken wherever they could differ.
"""

from __future__ import annotations

import codecs
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import ByteLevel

from replaynoise.data.grading import graded_answer


def char_offsets(tokenizer: Any, ids: list[int]) -> list[int]:
    """Start character of each token in the decoded text (incremental decoding, so byte merges are honoured)."""
    return [len(tokenizer.decode(ids[:i], skip_special_tokens=False)) for i in range(len(ids) + 1)]


#: GPT-2's byte-level alphabet (tokenizers' ByteLevel): the character that stands for each byte -> the byte.
_SELF = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_BYTE_OF = {chr(b): b for b in _SELF} | {chr(256 + n): b for n, b in enumerate(sorted({*range(256)} - {*_SELF}))}
#: id(backend) -> (backend, {id: bytes}): saves time only. Keyed by id, the backend held so that its id stays its own:
#: some ``tokenizers`` releases' Tokenizer takes no weak reference.
_TOKEN_BYTES: dict[int, tuple[BackendTokenizer, dict[int, bytes]]] = {}
#: transformers' decode and _decode (5.x), which do nothing but the backend's decode and, when it is on, the clean-up.
_PLAIN = ["transformers:PreTrainedTokenizerBase.decode", "transformers:TokenizersBackend._decode"]


def byte_level_backend(tokenizer: Any) -> BackendTokenizer | None:
    """The ``tokenizers`` backend where ``tokenizer.decode`` is its byte-level (GPT-2's) decode alone; else None."""
    fs = [getattr(type(tokenizer), name, None) for name in ("decode", "_decode")]
    if [f"{getattr(f, '__module__', '').split('.')[0]}:{getattr(f, '__qualname__', '')}" for f in fs] != _PLAIN:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    plain = not {"decode", "_decode"} & vars(tokenizer).keys() and not tokenizer.clean_up_tokenization_spaces
    return backend if plain and isinstance(backend, BackendTokenizer) and type(backend.decoder) is ByteLevel else None


def token_offsets(tokenizer: Any, ids: list[int], text: str) -> list[int]:
    """``char_offsets`` in linear time where ``byte_level_backend`` makes a prefix's text its tokens' bytes
    (ByteLevel.decode_chain) read as UTF-8, lossy as Rust reads them: what the incremental decoder gave plus the bytes
    it holds back read alone. ``char_offsets`` itself where not, or where ``text`` (``decode(ids)``) disagrees."""
    if (backend := byte_level_backend(tokenizer)) is None:
        return char_offsets(tokenizer, ids)
    known = _TOKEN_BYTES.setdefault(id(backend), (backend, {}))[1]
    decoder, given, parts, offsets = codecs.getincrementaldecoder("utf-8")("replace"), 0, [], [0]
    for i in ids:
        if i not in known and (token := backend.id_to_token(i)) is not None:  # no token: decode skips the id
            known[i] = bytes(_BYTE_OF[c] for c in token) if set(token) <= _BYTE_OF.keys() else token.encode()
        parts.append(decoder.decode(known.get(i, b"")))
        given += len(parts[-1])
        offsets.append(given + len(decoder.getstate()[0].decode("utf-8", "replace")))
    return offsets if "".join(parts) + decoder.decode(b"", final=True) == text else char_offsets(tokenizer, ids)


def answer_token_span(tokenizer: Any, response_ids: list[int]) -> tuple[int, int] | None:
    """Token indices [start, end) covering the answer the grader reads (``grading.graded_answer``): the
    final-answer span."""
    text = tokenizer.decode(response_ids, skip_special_tokens=False)
    found = graded_answer(text)
    if found is None:
        return None
    _, lo, hi = found
    offsets = token_offsets(tokenizer, response_ids, text)
    tokens = [i for i in range(len(response_ids)) if offsets[i] < hi and offsets[i + 1] > lo]
    return (tokens[0], tokens[-1] + 1) if tokens else None
