"""The functions a static decode step is made of (``engines.hf.static``), and the choice of its attention.

One decode step of a Llama/Qwen2-family layer for one new token per row: input norm, projections and RoPE
(``layer_in``), grouped-query attention over the cache (``attend``), output projection and MLP (``layer_out``), and
the Gumbel-max samplers. On CUDA the passes' layer body is compiled by inductor into a few fused kernels
(``compile_fixed``): unfused, a step's many small kernels (about 600 at 512 rows of a Qwen2.5-0.5B shape) are its
second-largest cost. Eager and graph-replayed steps use the same compiled kernels, so they agree bitwise; on CPU the
same functions run eagerly. ``linear`` with ``fp32`` is the float32 GEMM of ``cpu_matmul.Fp32Linear``.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from replaynoise.engines.hf.settings import INVARIANT_ATTENTION, STATIC_ATTENTION, STATIC_ATTENTION_VARIABLE
from replaynoise.engines.sampling import nucleus_by_search, sample_rows

log = logging.getLogger(__name__)

#: Attention backends of the HF forwards (prefills, re-steps, dynamic decode). cuDNN's is left out: it builds an
#: execution plan for every new shape, 1.8 ms of host time per layer and forward on an H200 (measured,
#: benchmarks/profile_pass.py), and nearly every batch of a pass has shapes of its own. CPUs never use it.
EAGER_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

#: The static decoder's attention: ``sdpa`` (PyTorch picks the kernel: cuDNN's on an H200), ``efficient`` (its
#: memory-efficient kernel) or ``gemm`` (two batched GEMMs and a float32 softmax over the cache, compiled with the
#: layer body on CUDA). ``gemm`` is the stock decoders' default: a decode step's attention reads each row's cache
#: once, and cuDNN's kernel took longer for it at every shape measured on an H200, 0-25% of the whole step
#: (benchmarks/static_attention.py, benchmarks/results/h200-static-attention.json). The invariant decoder keeps
#: ``sdpa``, with which its bitwise identity across passes was verified on the H200 (reference/gpu).
#: ``fa3``: FlashAttention 3 from vLLM's wheel (``engines.hf.flash``), which reads each row's live slots only; its
#: numbers are its own, so it is a choice a run makes, never a default, and the invariant decoder refuses it (its
#: batch invariance was verified with ``sdpa``).
#: ``REPLAYNOISE_STATIC_ATTENTION`` overrides both for a run (a tuning knob; provenance.json records it).
STATIC_ATTENTIONS = ("sdpa", "efficient", "gemm", "fa3")


def static_attention(invariant: bool = False, given: str | None = None) -> str:
    """The attention an engine's static decoders use (the invariant decoder's, with ``invariant``): ``given`` (a
    configuration's ``static_attention``), else the variable's value, else the default. A variable that says
    otherwise than the configuration is refused: which of them a run's numbers came from must not be a guess."""
    variable = os.environ.get(STATIC_ATTENTION_VARIABLE)
    if given is not None and variable is not None and variable != given:
        raise ValueError(
            f"{STATIC_ATTENTION_VARIABLE}={variable!r} and the configuration's static_attention {given!r} disagree; "
            "unset the variable or change the configuration"
        )
    value = given or variable or (INVARIANT_ATTENTION if invariant else STATIC_ATTENTION)
    if value not in STATIC_ATTENTIONS:
        raise ValueError(f"{STATIC_ATTENTION_VARIABLE}={value!r}: expected one of {STATIC_ATTENTIONS}")
    if invariant and value == "fa3":
        raise ValueError(
            f"{STATIC_ATTENTION_VARIABLE}={value!r}: FlashAttention 3 is not verified batch-invariant, and the "
            "invariant decoder (kernels: invariant) must be; unset the variable or choose sdpa for such a run"
        )
    return value


def static_decode_supported(model) -> bool:
    """Llama/Qwen2/Mistral-shaped decoders: full attention everywhere, no q/k norms, standard RoPE module."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")):
        return False
    if getattr(model.config, "model_type", None) not in ("llama", "qwen2", "mistral"):
        return False
    if any(t != "full_attention" for t in (getattr(model.config, "layer_types", None) or [])):
        return False
    if getattr(model.config, "hidden_act", None) != "silu":
        return False
    layer = inner.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    return (
        all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling"))
        and all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj"))
        and hasattr(layer.input_layernorm, "variance_epsilon")
    )


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Llama/Qwen2 RMSNorm: normalise in float32, round to the input dtype, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32: bool) -> torch.Tensor:
    """A linear layer; ``fp32``: the float32 GEMM of ``Fp32Linear`` (weights already float32)."""
    return F.linear(x.float(), weight, bias).to(x.dtype) if fp32 else F.linear(x, weight, bias)


def layer_in(
    h, cos, sin, ln, qw, qb, kw, kb, vw, vb, eps: float, fp32: bool, rows: int, heads: int, kv_heads: int, dim: int
):
    """Input norm, q/k/v projections and RoPE of one decoder layer for one new token per row."""
    x = rms(h, ln, eps)
    q = linear(x, qw, qb, fp32).view(rows, 1, heads, dim).transpose(1, 2)
    k = linear(x, kw, kb, fp32).view(rows, 1, kv_heads, dim).transpose(1, 2)
    v = linear(x, vw, vb, fp32).view(rows, 1, kv_heads, dim).transpose(1, 2)
    return rotate(q, cos, sin).to(v.dtype), rotate(k, cos, sin).to(v.dtype), v


def attend(q, keys, values, mask, scaling: float, rows: int, kv_heads: int, group: int, dim: int):
    """Grouped-query attention of one new token: the query heads of a KV head are its "query positions"; two
    batched GEMMs and a float32 softmax, memory-bound reads of K and V, no mask expansion."""
    q = q.reshape(rows, kv_heads, group, dim)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


def layer_out(h, o, ow, ob, ln, gw, gb, uw, ub, dw, db, eps: float, fp32: bool, rows: int, width: int):
    """Output projection, residual, post-attention norm, SiLU-gated MLP and residual of one decoder layer."""
    h = h + linear(o.reshape(rows, 1, width), ow, ob, fp32)
    x = rms(h, ln, eps)
    return h + linear(F.silu(linear(x, gw, gb, fp32)) * linear(x, uw, ub, fp32), dw, db, fp32)


def compile_fixed(fn, options: dict | None = None):
    """``fn`` compiled by inductor for fixed shapes (``options``: inductor's settings); where compilation fails,
    the eager ``fn`` (same math) from then on, for those non-tensor arguments (a sampler's temperature and top_p)
    only: which kernels a call uses then depends on its own arguments, never on which calls this process happened
    to make before. ``.eager`` holds the argument sets that fell back."""
    compiled = torch.compile(fn, dynamic=False, fullgraph=True, options=options)

    def run(*args):
        key = tuple(a for a in args if not isinstance(a, torch.Tensor))
        if key in run.eager:
            return fn(*args)
        # only eager steps call this (a captured graph replays without Python): the first call of a shape,
        # which compiles or loads from inductor's cache, is timed for the job's log
        shapes = (key, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
        start = time.perf_counter()
        try:
            out = compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: same result, slower
            log.warning("compiled %s unavailable for %s (%r); running it eagerly", fn.__name__, key, exc)
            run.eager.add(key)
            return fn(*args)
        if shapes not in run.timed:
            run.timed.add(shapes)
            log.info(
                "compiled %s for %s in %.2f s",
                fn.__name__,
                "x".join(map(str, shapes[1][0])),
                time.perf_counter() - start,
            )
        return out

    run.eager, run.timed = set(), set()
    return run


@functools.cache
def layer_functions(compiled: bool) -> tuple:
    """(layer input, attention, layer output): compiled once per process, or the eager functions."""
    plain = (layer_in, attend, layer_out)
    return tuple(map(compile_fixed, plain)) if compiled else plain


def eager_sampler(logits, seeds, steps, temperature, top_p):
    return sample_rows(logits, seeds, steps, temperature, top_p, exhaustive=True)


#: Ways of the compiled sampler's threshold search (``sampling.nucleus_by_search``): each pass reads the row once
#: for its ways - 1 integer sums, so more ways read less and compute more. On one H100 at 512 rows x 151,936 tokens
#: the sampler took 3.27 ms at 2 ways (the bisection), 2.78 at 4, 3.53 at 8 and 5.49 at 16, and the 1.5B's step
#: 13.54 ms at 4 ways against 14.16 at 2 (benchmarks/results/sampler-search-2026-12-07/). Any number keeps the same
#: tokens.
SAMPLER_WAYS = 4


def searching_nucleus(scores, top_p):
    return nucleus_by_search(scores, top_p, SAMPLER_WAYS)


def searching_sampler(logits, seeds, steps, temperature, top_p):
    return sample_rows(logits, seeds, steps, temperature, top_p, exhaustive=True, nucleus=searching_nucleus)


#: inductor's settings for the compiled sampler: its reductions over the vocabulary (the row's best score, the
#: nucleus's integer sums, the argmax) left whole. Inductor splits them where rows are few, and at the 1.5B's shape
#: that made a 256-row step cost about what a 512-row one does: on one H100, 12.31 ms against 8.06 unsplit, while
#: 512 and 1,024 rows were unchanged (benchmarks/results/profile-step-1.5b-2026-12-07/). Max, integer sums and
#: argmax are exact in any order, so no token depends on it.
SAMPLER_INDUCTOR = {"split_reductions": False}


@functools.cache
def compiled_sampler():
    """The exhaustive sampler fused by inductor, once per process: the noise in one pass over the logits (no
    [rows, vocab] int64 temporaries: at 512 rows x 151936 tokens each would be 620 MB of memory traffic per step),
    the top-p filter by a search (a few fused passes instead of a sort of the vocabulary; the same tokens)."""
    return compile_fixed(searching_sampler, SAMPLER_INDUCTOR)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
