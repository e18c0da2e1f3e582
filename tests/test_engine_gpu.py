"""The HF engine on a CUDA device: exact resume, the re-feed effect and invariant mode on GPU kernels.

No weights can be downloaded onto a GPU machine here, so the model is a Llama of a real shape with random
weights built on the device; the claims tested are about numerics, which random weights exercise as well.
Skipped where no CUDA device is present (CI never has one).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import branch_requests, hf_engine

from replaynoise.engines.base import RolloutRequest, SamplingSettings

# `-m gpu` selects these on a GPU machine; without a CUDA device they skip, saying why
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SAMPLING = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=24)
VOCAB = 8192


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        eos_token_id=VOCAB - 1,
        bos_token_id=0,
    )
    return LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()


def engine(model, kernels, decode="auto", **shape):
    tokenizer = SimpleNamespace(eos_token_id=VOCAB - 1)  # the engine reads only the end-of-sequence id
    return hf_engine(model, tokenizer, kernels=kernels, decode=decode, **shape)


def rollout_and_requests(eng, tmp_path, k=3):
    prompt = tuple(int(i) for i in torch.randint(1, VOCAB - 1, (64,), generator=torch.Generator().manual_seed(1)))
    (r,) = eng.generate_rollouts(
        [RolloutRequest("p", prompt, 5)], SAMPLING, tmp_path, lambda ro: len(ro.prompt_ids) + len(ro.response_ids) - 1
    )
    requests = branch_requests(r, range(2, len(r.response_ids) - 1, 5), k)
    return r, requests


def test_exact_resume_is_bitwise_on_gpu_and_refeed_is_not(model, tmp_path):
    eng = engine(model, "stock")
    _, requests = rollout_and_requests(eng, tmp_path)
    exact = [eng.prefix_state(r, "decode_kv") for r in requests]
    assert all(s.verified for s in exact)
    refeed = [eng.prefix_state(r, "refeed_ids") for r in requests]
    assert any(max(s.kv_maxdiff) > 0 for s in refeed)
    a = eng.run_batch(requests, "decode_kv", SAMPLING)
    b = eng.run_batch(requests, "refeed_ids", SAMPLING)
    assert any(x.next_digest != y.next_digest for x, y in zip(a, b))


def test_compiled_rollouts_store_the_kv_they_decoded_and_exact_resumes_it_bitwise(model, tmp_path):
    """compile_rollouts: the rollout decoder's layers and sampler compiled inside its captured step. The prompt's KV
    and the first token come from the batched prefill, as with eager layers (bitwise); the stored KV is the one the
    compiled step decoded, so exact resumes it verified and twice alike (replica equals exact)."""
    compiled = engine(model, "stock", compile_rollouts=True)
    r, requests = rollout_and_requests(compiled, tmp_path / "c")
    ((key, decoder),) = compiled.forwards.decoders.items()
    assert key[3] and decoder.compiled
    eager, _ = rollout_and_requests(engine(model, "stock"), tmp_path / "e")
    assert r.response_ids[0] == eager.response_ids[0] and r.logits_digests[0] == eager.logits_digests[0]
    from replaynoise.engines.hf.kvfiles import load_kv_file

    p = len(r.prompt_ids)
    kc, ke = (load_kv_file(x.kv_file, device="cpu")[0][0][0] for x in (r, eager))
    assert torch.equal(kc[..., :p, :], ke[..., :p, :])
    exact = [compiled.prefix_state(q, "decode_kv") for q in requests]
    assert all(s.verified for s in exact)
    a = compiled.run_batch(requests, "decode_kv", SAMPLING)
    b = compiled.run_batch(requests, "decode_kv", SAMPLING)
    assert [(x.token_ids, x.next_digest) for x in a] == [(y.token_ids, y.next_digest) for y in b]
    assert all(x.verified for x in a)


@pytest.mark.parametrize("decode", ["auto", "dynamic"])  # auto: the batched invariant decoder (CUDA graphs)
def test_invariant_mode_is_bitwise_identical_across_passes_on_gpu(model, tmp_path, decode):
    eng = engine(model, "invariant", decode, invariant_rows=8, invariant_context=256)
    assert (eng.mode.name == "aligned") == (decode == "auto")
    _, requests = rollout_and_requests(eng, tmp_path, k=2)
    exact = eng.run_batch(requests, "decode_kv", SAMPLING)
    # the replica in other batches: other batch-mates, row slots and batch sizes
    flipped = list(reversed(requests))
    replica = [
        r
        for start in range(0, len(flipped), 5)
        for r in eng.run_batch(flipped[start : start + 5], "decode_kv", SAMPLING)
    ][::-1]
    refeed = eng.run_batch(requests, "refeed_ids", SAMPLING)
    for x, y, z in zip(exact, replica, refeed):
        assert x.verified
        assert x.token_ids == y.token_ids == z.token_ids
        assert x.next_digest == y.next_digest == z.next_digest
        assert x.next_topk_logprobs == y.next_topk_logprobs == z.next_topk_logprobs
    assert all(max(r.kv_maxdiff) == 0.0 for r in refeed)
    if decode == "auto":  # the rollout ran in the decoder's shape: the re-step probe reproduces it
        probed = [r.restep_match for r in exact if r.restep_match is not None]
        assert probed and all(probed)


def test_static_decode_replays_its_graph_bitwise_and_matches_the_eager_step(model, tmp_path):
    eng = engine(model, "stock")
    assert eng.mode.name == "static"  # the GPU default: static cache, CUDA graph, on-device sampling
    _, requests = rollout_and_requests(eng, tmp_path)
    first = eng.run_batch(requests, "decode_kv", SAMPLING)
    assert [d.compiled for d in eng.forwards.decoders.values()] == [False, True]  # the rollout's, the pass's
    again = eng.run_batch(requests, "decode_kv", SAMPLING)  # the captured graph, replayed on a new batch
    eager = engine(model, "stock", graphs=False)
    plain = eager.run_batch(requests, "decode_kv", SAMPLING)
    for x, y, z in zip(first, again, plain):
        assert x.verified
        assert x.token_ids == y.token_ids == z.token_ids
        assert x.next_digest == y.next_digest == z.next_digest


def test_noise_is_the_same_on_gpu_and_cpu_and_compiled():
    from replaynoise.engines.hf.kernels import compiled_sampler
    from replaynoise.engines.sampling import gumbel, row_keys, sample_rows

    seeds = torch.tensor([1, 2**62 + 5, 12345, 0], dtype=torch.int64)
    steps = torch.tensor([0, 7, 100, 3], dtype=torch.int64)
    keys = row_keys(seeds, steps)
    assert torch.equal(keys, row_keys(seeds.cuda(), steps.cuda()).cpu())
    assert torch.allclose(gumbel(keys, 5000), gumbel(keys.cuda(), 5000).cpu(), atol=1e-5, rtol=0)
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(3)) * 4
    for top_p in (1.0, 0.9):
        on_cpu = sample_rows(logits, seeds, steps, 0.7, top_p)
        on_gpu = sample_rows(logits.cuda(), seeds.cuda(), steps.cuda(), 0.7, top_p, exhaustive=True).cpu()
        compiled = compiled_sampler()(logits.cuda(), seeds.cuda(), steps.cuda(), 0.7, top_p).cpu()
        assert torch.equal(on_cpu, on_gpu) and torch.equal(on_gpu, compiled)


def test_batched_static_rollouts_keep_each_rows_own_kv_on_gpu(model, tmp_path):
    """The GPU rollout path (batched prefill, then one graph replay per step for all rows): each row's stored KV
    is its own. The prompt part comes from the same batched prefill in both decode modes (bitwise equal); the
    response part from other kernels (close, not equal); a wrong slice or offset would differ by O(1)."""
    gen = torch.Generator().manual_seed(2)
    reqs = [
        RolloutRequest(
            f"p{i}", tuple(int(t) for t in torch.randint(1, VOCAB - 1, (20 + 7 * i,), generator=gen)), 50 + i
        )
        for i in range(6)
    ]
    keep = lambda ro: len(ro.prompt_ids) + len(ro.response_ids) - 1  # noqa: E731
    static = engine(model, "stock")
    assert static.mode.name == "static"
    dynamic = hf_engine(model, SimpleNamespace(eos_token_id=VOCAB - 1), decode="dynamic")
    a = static.generate_rollouts(reqs, SAMPLING, tmp_path / "static", keep)
    assert [d.compiled for d in static.forwards.decoders.values()] == [False]  # rollouts: eager layers in the graph
    b = dynamic.generate_rollouts(reqs, SAMPLING, tmp_path / "dynamic", keep)
    from replaynoise.engines.hf.kvfiles import load_kv_file

    for x, y in zip(a, b):
        assert x.response_ids[0] == y.response_ids[0] and x.logits_digests[0] == y.logits_digests[0]
        layers_x, ids_x = load_kv_file(x.kv_file, device="cpu")
        kx, ky = layers_x[0][0], load_kv_file(y.kv_file, device="cpu")[0][0][0]
        assert ids_x == (x.prompt_ids + x.response_ids)[: x.kv_len]
        p = len(x.prompt_ids)
        assert torch.equal(kx[..., :p, :], ky[..., :p, :])
        n = min(kx.shape[-2], ky.shape[-2])
        scale = float(ky[..., :n, :].abs().max())
        assert float((kx[..., p : p + 1, :] - ky[..., p : p + 1, :]).abs().max()) < 0.05 * scale
    exact = [static.prefix_state(r, "decode_kv") for r in rollout_and_requests(static, tmp_path / "r")[1]]
    assert all(s.verified and s.restep_match is not None for s in exact)


def test_invariant_decoder_keeps_its_numbers_across_sampling_changes_with_graphs(model, tmp_path):
    """A pass alternates sampling settings on one invariant decoder (its rows, then the greedy probe's): each
    change recaptures the graph after an eager step, and the numbers of a batch do not depend on what ran
    between (a fresh engine gives the same)."""
    eng = engine(model, "invariant", invariant_rows=8, invariant_context=256)
    _, requests = rollout_and_requests(eng, tmp_path, k=2)
    greedy = SamplingSettings(temperature=0.0, top_p=1.0, max_new_tokens=8)
    first = eng.run_batch(requests, "decode_kv", SAMPLING)
    eng.run_batch(requests[:3], "decode_kv", greedy)
    again = eng.run_batch(requests, "decode_kv", SAMPLING)
    fresh = engine(model, "invariant", invariant_rows=8, invariant_context=256).run_batch(
        requests, "decode_kv", SAMPLING
    )
    for a, b, c in zip(first, again, fresh):
        assert a.token_ids == b.token_ids == c.token_ids and a.next_digest == b.next_digest == c.next_digest


def test_refilled_decode_replays_its_graph_bitwise_and_matches_the_eager_step(model, tmp_path):
    """static_rows: rows refilled between graph replays (eager writes into the captured step's buffers) decode
    what the same decoder run eagerly decodes, and a second batch on the captured graph the same again."""
    from replaynoise.engines.hf.static import RefillDecoder

    stops = frozenset(range(100, 500))  # one token in twenty ends a continuation: rows end at many steps
    eng = engine(model, "stock", static_rows=4, stop_ids=stops)
    _, requests = rollout_and_requests(engine(model, "stock"), tmp_path)
    first = eng.run_batch(requests, "decode_kv", SAMPLING)
    assert any(isinstance(d, RefillDecoder) and d.rows == 4 < len(requests) for d in eng.forwards.decoders.values())
    assert {x.finish_reason for x in first} == {"eos", "length"}
    again = eng.run_batch(requests, "decode_kv", SAMPLING)
    plain = engine(model, "stock", graphs=False, static_rows=4, stop_ids=stops).run_batch(
        requests, "decode_kv", SAMPLING
    )
    for x, y, z in zip(first, again, plain):
        assert x.verified
        assert x.token_ids == y.token_ids == z.token_ids
        assert x.next_digest == y.next_digest == z.next_digest


def fa3_missing() -> str | None:
    """Why FlashAttention 3 cannot run here (None where it can: a Hopper GPU and vLLM's wheel)."""
    from replaynoise.engines.hf.flash import fa3_forward

    try:
        fa3_forward()
    except RuntimeError as exc:
        return str(exc)
    return None


def test_fa3_attends_over_each_rows_live_slots_whatever_its_batch_mates():
    """``attend_flash`` reads the decoders' [rows, kv_heads, slots, dim] buffers as they are: its output is the
    ``gemm`` attention's over [first, end) to bf16 rounding, with loud values in the dead slots (a misread slot
    would show: reading [0, end) instead was off by about 1.5 where the rounding is 0.008, on an H100), and a row's
    output is bitwise the same beside other rows (one split a row)."""
    if why := fa3_missing():
        pytest.skip(why)
    from replaynoise.engines.hf.flash import attend_flash
    from replaynoise.engines.hf.kernels import attend

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, heads, kv_heads, slots, dim = 64, 16, 4, 1088, 128

    def batch():
        q = torch.randn(rows, heads, 1, dim, generator=gen, device="cuda").to(torch.bfloat16)
        keys, values = (torch.randn(rows, kv_heads, slots, dim, generator=gen, device="cuda") for _ in range(2))
        first = torch.randint(0, 300, (rows,), generator=gen, device="cuda", dtype=torch.int32)
        end = first + torch.randint(1, 700, (rows,), generator=gen, device="cuda", dtype=torch.int32)
        live = torch.arange(slots, device="cuda")
        dead = ((live[None, :] < first[:, None]) | (live[None, :] >= end[:, None]))[:, None, :, None]
        keys, values = (x.masked_fill(dead, 40.0).to(torch.bfloat16) for x in (keys, values))
        return q, keys, values, first, end

    q, keys, values, first, end = batch()
    live = torch.arange(slots, device="cuda")
    mask = ((live[None, :] >= first[:, None]) & (live[None, :] < end[:, None]))[:, None, None, :]
    out = attend_flash(q, keys, values, first, end, dim**-0.5)
    ref = attend(q, keys, values, mask, dim**-0.5, rows, kv_heads, heads // kv_heads, dim)
    assert out.shape == (rows, 1, heads, dim)
    assert float((out.reshape(ref.shape).float() - ref.float()).abs().max()) < 0.02 * float(ref.abs().max())
    assert torch.equal(out, attend_flash(q, keys, values, first, end, dim**-0.5))
    other = list(batch())
    for i, mine in enumerate((q, keys, values, first, end)):  # row 5 moved into another batch, at row 0
        other[i][0] = mine[5]
    assert torch.equal(attend_flash(*other, dim**-0.5)[0], out[5])


@pytest.mark.parametrize("given", [{}, {"static_rows": 4}], ids=["left-padded", "refilled"])
def test_fa3_decode_replays_its_graph_bitwise_and_exact_resumes_verified(model, tmp_path, monkeypatch, given):
    """With FA3 in the static decoders' step: the captured graph replays what the eager step computes, a second
    pass gives the same bits (exact = replica), and exact resumes the decode-time state verified."""
    if why := fa3_missing():
        pytest.skip(why)
    monkeypatch.setenv("REPLAYNOISE_STATIC_ATTENTION", "fa3")
    stops = frozenset(range(100, 500)) if given else frozenset()
    eng = engine(model, "stock", stop_ids=stops, **given)
    _, requests = rollout_and_requests(eng, tmp_path)
    first = eng.run_batch(requests, "decode_kv", SAMPLING)
    assert {d.attention for d in eng.forwards.decoders.values()} == {"fa3"}
    again = eng.run_batch(requests, "decode_kv", SAMPLING)
    plain = engine(model, "stock", graphs=False, stop_ids=stops, **given).run_batch(requests, "decode_kv", SAMPLING)
    for x, y, z in zip(first, again, plain):
        assert x.verified
        assert x.token_ids == y.token_ids == z.token_ids
        assert x.next_digest == y.next_digest == z.next_digest
