"""Stored KV files: plain safetensors that any reader loads, laid out so that ours reads a cache as one view;
and the comparison of re-fed KV with them."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save

from replaynoise.engines.base import ContinuationRequest, VerificationError
from replaynoise.engines.hf.kvfiles import load_kv_file, parse_kv, read_kv_bytes, save_kv, stack_layers
from replaynoise.engines.hf.states import PrefixState, StoredKV


def cache(layers=3, heads=2, positions=7, dim=4, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randn(1, heads, positions, dim, generator=gen).to(dtype),
            torch.randn(1, heads, positions, dim, generator=gen).to(dtype),
        )
        for _ in range(layers)
    ]


def test_a_stored_cache_is_plain_safetensors_with_a_tensor_per_layer_and_kind(tmp_path):
    layers, ids = cache(), [5, 6, 7, 8, 9]
    digest = save_kv(layers, 5, tmp_path / "a.safetensors", ids=ids)
    assert digest == hashlib.sha256((tmp_path / "a.safetensors").read_bytes()).hexdigest()
    plain = load_file(tmp_path / "a.safetensors")  # the reference reader, not ours
    assert sorted(plain) == sorted(["ids"] + [f"{kind}.{i}" for i in range(3) for kind in "kv"])
    for i, (k, v) in enumerate(layers):
        assert torch.equal(plain[f"k.{i}"], k[..., :5, :]) and torch.equal(plain[f"v.{i}"], v[..., :5, :])
    assert plain["ids"].tolist() == ids


def test_a_stacked_row_and_its_layers_give_the_same_bytes(tmp_path):
    layers = cache()
    batch = torch.cat([torch.zeros_like(stack_layers(layers)), stack_layers(layers)], dim=2)  # row 1 of two
    a = save_kv(layers, 6, tmp_path / "a.safetensors", ids=list(range(7)))
    b = save_kv(batch[:, :, 1:2], 6, tmp_path / "b.safetensors", ids=list(range(7)))
    assert a == b and (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_our_reader_views_the_cache_in_place_and_reads_other_layouts_too(tmp_path):
    layers = cache(dtype=torch.float16)
    save_kv(layers, 7, tmp_path / "a.safetensors", ids=list(range(7)))
    data = read_kv_bytes(tmp_path / "a.safetensors")
    read, ids, stacked = parse_kv(data, "a", device="cpu")
    assert stacked.shape == (3, 2, 1, 2, 7, 4) and ids == list(range(7))
    data[-8 * 7 - 2 : -8 * 7] = b"\x00\x00"  # the last value of the last layer's V, changed in the file's bytes
    assert float(stacked[2, 1, 0, 1, 6, 3]) == 0.0  # a view: no copy was made
    # a file in safetensors' own layout (earlier versions wrote it): parsed tensor by tensor, same cache
    tensors = {f"{kind}.{i}": t for i, (k, v) in enumerate(layers) for kind, t in (("k", k), ("v", v))}
    (tmp_path / "old.safetensors").write_bytes(save(tensors))
    old, old_ids = load_kv_file(tmp_path / "old.safetensors", device="cpu")
    assert old_ids is None
    assert all(torch.equal(a, b) for pair, other in zip(layers, old) for a, b in zip(pair, other))
    # layers of different lengths (sliding windows) are stored and read a tensor at a time
    mixed = [layers[0], (layers[1][0][..., :3, :], layers[1][1][..., :3, :])]
    save_kv(mixed, 7, tmp_path / "mixed.safetensors")
    back, _ = load_kv_file(tmp_path / "mixed.safetensors", device="cpu")
    assert [k.shape[-2] for k, _ in back] == [7, 3] and torch.equal(back[1][1], mixed[1][1])


def test_a_damaged_file_is_refused_with_its_name(tmp_path):
    save_kv(cache(), 7, tmp_path / "a.safetensors", ids=list(range(7)))
    whole = (tmp_path / "a.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(whole[:-20])
    with pytest.raises(VerificationError, match="cut.safetensors"):
        load_kv_file(tmp_path / "cut.safetensors", device="cpu")
    (tmp_path / "header.safetensors").write_bytes(whole[:8] + b"[" + whole[9:])
    with pytest.raises(VerificationError, match="header.safetensors"):
        load_kv_file(tmp_path / "header.safetensors", device="cpu")


def test_drift_of_a_padded_batch_equals_the_drift_measured_state_by_state(tmp_path, monkeypatch):
    """The re-feed pass compares a batched prefill's KV with the stored KV a chunk of rows at a time; the
    figures must be those of the comparison state by state, unmeasurable states (no stored file, another
    prefix length) left without one."""
    gen = torch.Generator().manual_seed(1)
    lengths, longest, files, requests = [5, 7, 3, 6], 7, [], []
    for i, n in enumerate(lengths):
        stored = torch.randn(4, 2, 1, 2, 9, 8, generator=gen).to(torch.bfloat16)  # 9 stored positions
        path = tmp_path / f"{i}.safetensors"
        files.append(save_kv(stored, 9, path, ids=list(range(9))))
        requests.append(
            ContinuationRequest(
                f"p{i}", "orig", 0, i, tuple(range(n if i != 3 else n + 1)), 1, None if i == 2 else str(path), files[-1]
            )
        )
    whole = torch.randn(4, 2, len(lengths), 2, longest, 8, generator=gen).to(torch.bfloat16)
    for row, n in enumerate(lengths):
        whole[:, :, row, :, : longest - n] = 0  # left padding, zero as the batched prefill leaves it

    def states():
        return [
            PrefixState(None, n, True, None, kv=whole[:, :, r : r + 1, :, longest - n :]) for r, n in enumerate(lengths)
        ]

    monkeypatch.setattr("replaynoise.engines.hf.states.DRIFT_ROWS", 3)  # two chunks, the second short
    one_by_one = StoredKV(torch.device("cpu"), 2**30).drift(requests, states())
    chunked = StoredKV(torch.device("cpu"), 2**30).drift(requests, states(), whole=whole)
    assert [s.kv_maxdiff for s in chunked] == [s.kv_maxdiff for s in one_by_one]
    assert [s.kv_maxdiff is None for s in chunked] == [False, False, True, True]
    assert all(len(s.kv_maxdiff) == 4 and max(s.kv_maxdiff) > 0 for s in chunked[:2])


def test_a_header_of_the_wrong_types_is_refused_not_crashed_on(tmp_path):
    save_kv(cache(), 7, tmp_path / "a.safetensors")
    whole = (tmp_path / "a.safetensors").read_bytes()
    (size,) = struct.unpack_from("<Q", whole)
    header = json.loads(whole[8 : 8 + size])
    for name in header:
        if name != "__metadata__":
            header[name]["shape"] = "1x2x7x4"  # all alike: the layout checks pass, the types do not
    text = json.dumps(header).encode()
    (tmp_path / "typed.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + whole[8 + size :])
    with pytest.raises(VerificationError, match="typed.safetensors"):
        load_kv_file(tmp_path / "typed.safetensors", device="cpu")
