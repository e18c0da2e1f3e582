"""The static-cache decode for GPUs: continuation rows of a Llama/Qwen2-family model with the KV of all rows in
preallocated per-layer buffers [rows, kv_heads, length, head_dim] (rows left-padded to a common write position),
the step (embedding, layers, head and Gumbel-max sampling) captured once as a CUDA graph and replayed, tokens
kept on the GPU: no Python per layer, no logits transfer, no per-step synchronisation. The prefix KV is copied in
once per batch, unmodified, so an exact pass still resumes from the verified decode-time state. Its step is made
of ``engines.kernels``; ``AlignedDecoder`` is its batch-invariant form.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from replaynoise.engines.hf.cpu_matmul import Fp32Linear
from replaynoise.engines.hf.flash import attend_flash, fa3_forward
from replaynoise.engines.hf.kernels import compiled_sampler, eager_sampler, layer_functions
from replaynoise.engines.hf.settings import INVARIANT_ATTENTION, STATIC_ATTENTION
from replaynoise.engines.sampling import logprob_rows, token_logprob_of

log = logging.getLogger(__name__)


class StaticDecoder:
    """Decode ``rows`` continuation rows for up to ``steps`` tokens after left-padded prefixes of ``prefix`` positions.

    Buffers are allocated once per (rows, length) and reused by later batches of the same shape, with the graph
    captured on them; ``graphs=False`` runs the same step eagerly (CPU tests, debugging). ``compiled=False``
    keeps the layer body and sampler eager on CUDA too (captured in the graph all the same): compiling them costs
    seconds per process and shape, which only a long decode earns back."""

    def __init__(
        self, model, rows: int, length: int, *, graphs: bool, attention: str = STATIC_ATTENTION, compiled: bool = True
    ) -> None:
        cfg, inner = model.config, model.model
        attn = inner.layers[0].self_attn
        self.model, self.inner, self.rows, self.length = model, inner, rows, length
        self.attention = attention
        if attention == "fa3":
            fa3_forward()  # its library loaded, or refused by name, before any buffer is allocated
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        self.device = device
        # one buffer [layers, 2, rows, kv_heads, length, head_dim]: a batch's prefix KV goes in with one copy per
        # row (``load`` with stacked states), the layers read and write their views of it
        self.kv = torch.zeros(len(inner.layers), 2, rows, self.n_kv, length, self.head_dim, device=device, dtype=dtype)
        self.keys = [self.kv[i, 0] for i in range(len(inner.layers))]
        self.values = [self.kv[i, 1] for i in range(len(inner.layers))]
        self.mask = torch.zeros(rows, 1, 1, length, device=device, dtype=torch.bool)
        # the first live slot of each row (its left padding): the mask's lower edge, for ``fa3``'s ``leftpad_k``
        self.first = torch.zeros(rows, device=device, dtype=torch.int32)
        self.ids = torch.zeros(rows, device=device, dtype=torch.int64)
        self.positions = torch.zeros(rows, device=device, dtype=torch.int64)
        self.write = torch.zeros(1, device=device, dtype=torch.int64)
        self.seeds = torch.zeros(rows, device=device, dtype=torch.int64)
        self.step_no = torch.zeros(rows, device=device, dtype=torch.int64)
        self.graphs = graphs and device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.sampling: tuple[float, float] | None = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.compiled = compiled and device.type == "cuda"
        self.sample = compiled_sampler() if self.graphs and self.compiled else eager_sampler
        self.layer_in, self.attend, self.layer_out = layer_functions(self.compiled)
        self.weights = [self._layer_weights(layer) for layer in inner.layers]

    @staticmethod
    def _layer_weights(layer) -> tuple:
        """The tensors of one layer, in the argument order of ``layer_in`` and ``layer_out`` (biases may be
        None), its norm epsilon, and whether its linear layers run as float32 GEMMs (``use_fp32_matmul``)."""
        a, m = layer.self_attn, layer.mlp
        fp32 = isinstance(a.q_proj, Fp32Linear)

        def wb(linear):
            return (linear.weight32, linear.bias32) if fp32 else (linear.weight, linear.bias)

        return (
            (layer.input_layernorm.weight, *wb(a.q_proj), *wb(a.k_proj), *wb(a.v_proj)),
            (*wb(a.o_proj), layer.post_attention_layernorm.weight, *wb(m.gate_proj), *wb(m.up_proj), *wb(m.down_proj)),
            (layer.input_layernorm.variance_epsilon, fp32),
        )

    # one step: reads ids/positions/write/seeds/step_no, writes the KV at ``write``, returns (logits, tokens)
    @torch.inference_mode()
    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model.lm_head(self.inner.norm(self._layers()))[:, 0, :]
        temperature, top_p = self.sampling
        tokens = self.sample(logits, self.seeds, self.step_no, temperature, top_p)
        # advance inside the step (inside the graph): the next step's inputs, with no launches from Python
        self.ids.copy_(tokens)
        self.positions.add_(1)
        self.write.add_(1)
        self.step_no.add_(1)
        return logits, tokens

    def _layers(self) -> torch.Tensor:
        """Embedding and decoder layers for one new token per row (its KV written at ``write``): hidden states."""
        rows, group = self.rows, self.n_heads // self.n_kv
        h = self.inner.embed_tokens(self.ids[:, None])
        cos, sin = self.inner.rotary_emb(h, self.positions[:, None])
        cos, sin = cos[:, None], sin[:, None]  # [rows, 1, 1, head_dim]
        self._mark()
        # fa3: every row's live slots end at its write position (inclusive), its ``seqused_k``
        end = (self.write + 1).to(torch.int32).expand(rows).contiguous() if self.attention == "fa3" else None
        heads, kv_heads, dim = self.n_heads, self.n_kv, self.head_dim
        scaling = self.inner.layers[0].self_attn.scaling
        for (w_in, w_out, (eps, fp32)), keys, values in zip(self.weights, self.keys, self.values):
            q, k, v = self.layer_in(h, cos, sin, *w_in, eps, fp32, rows, heads, kv_heads, dim)
            self._store(keys, k)
            self._store(values, v)
            if self.attention == "gemm":
                o = self.attend(q, keys, values, self.mask, scaling, rows, kv_heads, group, dim)
            elif end is not None:  # fa3: the live slots [first, end) alone, the mask's range
                o = attend_flash(q, keys, values, self.first, end, scaling)
            else:  # "sdpa": PyTorch picks the backend; "efficient": its memory-efficient kernel
                backend = (
                    sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION)
                    if self.attention == "efficient"
                    else contextlib.nullcontext()
                )
                with backend:
                    o = F.scaled_dot_product_attention(
                        q.reshape(rows, kv_heads, group, dim), keys, values, attn_mask=self.mask, scale=scaling
                    )
            h = self.layer_out(h, o, *w_out, eps, fp32, rows, heads * dim)
        return h

    def _mark(self) -> None:
        """Unmask the slot the step writes (one write position for all rows: left-padded prefixes)."""
        self.mask.index_fill_(3, self.write, True)

    def _store(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        buffer.index_copy_(2, self.write, new)

    def load(
        self,
        layers: list[list[tuple[torch.Tensor, torch.Tensor]]],
        lengths: list[int],
        row_state: list[int],
        seeds: list[int],
        tokens: list[int],
        sampling: tuple[float, float],
    ) -> int:
        """Fill the buffers for a batch: ``layers[s]`` the KV of unique prefix state s (per-layer (k, v) pairs, or
        one stacked tensor), ``row_state[r]`` the state of row r. Returns the common write position (the longest
        prefix). Positions before a row's prefix keep stale values: the mask hides them."""
        prefix = max(lengths)
        if prefix >= self.length:
            raise ValueError(f"prefix of {prefix} positions does not fit a static cache of {self.length}")
        if all(isinstance(state, torch.Tensor) for state in layers):  # stacked [layers, 2, 1, kv, n, dim]
            for row, s in enumerate(row_state):
                self.kv[:, :, row, :, prefix - lengths[s] : prefix].copy_(layers[s][:, :, 0])
        else:
            index = torch.tensor(row_state, device=self.device)
            for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
                for buffer, kv in ((keys, 0), (values, 1)):
                    unique = torch.cat(
                        [F.pad(state[layer][kv], (0, 0, prefix - n, 0)) for state, n in zip(layers, lengths)]
                    )
                    buffer[:, :, :prefix].copy_(unique.index_select(0, index))
        pads = torch.tensor([prefix - lengths[s] for s in row_state], device=self.device)
        slots = torch.arange(self.length, device=self.device)
        self.mask.copy_(((slots[None, :] >= pads[:, None]) & (slots[None, :] < prefix))[:, None, None, :])
        self.first.copy_(pads)
        self.positions.copy_(torch.tensor([lengths[s] for s in row_state], device=self.device))
        self.write.fill_(prefix)
        self.ids.copy_(torch.tensor(tokens, device=self.device))
        self.seeds.copy_(torch.tensor(seeds, device=self.device))
        self.step_no.zero_()
        self._set_sampling(sampling)
        return prefix

    def _set_sampling(self, sampling: tuple[float, float]) -> None:
        """New sampling settings need a new graph, captured after one eager step of their own (the first call of
        a compiled sampler variant compiles, which must not happen inside a capture)."""
        if self.sampling != sampling:
            self.sampling, self.graph, self.out = sampling, None, None

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step, which also advances the inputs to the next one; the first call of a shape (or of new
        sampling settings) runs eagerly, the second captures the graph."""
        if not self.graphs:
            return self._step()
        if self.graph is None:
            start = time.perf_counter()
            if self.out is None:  # first use: warm up (cuBLAS handles, workspaces) on a real step
                self.out = self._step()
                log.info(
                    "first step of %d rows x %d slots (compiled: %s): %.2f s",
                    self.rows,
                    self.length,
                    self.compiled,
                    time.perf_counter() - start,
                )
                return self.out
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self._step()
            log.info(
                "captured the step of %d rows x %d slots: %.2f s", self.rows, self.length, time.perf_counter() - start
            )
        self.graph.replay()
        return self.out


class SlotDecoder(StaticDecoder):
    """A static decoder whose every row keeps its position p in cache slot p (no left padding; each row writes at
    its own position), so that one row can start over while the others decode on."""

    def __init__(self, model, rows: int, length: int, *, graphs: bool, attention: str, compiled: bool = True) -> None:
        super().__init__(model, rows, length, graphs=graphs, attention=attention, compiled=compiled)
        self.write = torch.zeros(rows, device=self.device, dtype=torch.int64)

    def _mark(self) -> None:
        self.mask.scatter_(3, self.write.view(-1, 1, 1, 1), True)

    def _store(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        index = self.write.view(-1, 1, 1, 1).expand(-1, buffer.shape[1], 1, buffer.shape[3])
        buffer.scatter_(2, index, new)

    def _start_rows(self, index: torch.Tensor, lengths: list[int], ids: list[int], seeds: list[int]) -> None:
        """Rows ``index`` begin at positions ``lengths`` with input tokens ``ids``: each attends to its slots
        [0, length) and writes the next, its noise drawn from ``seeds`` and its own step 0."""
        at = torch.tensor(lengths, device=self.device)
        slots = torch.arange(self.length, device=self.device)
        self.mask[index] = (slots[None, :] < at[:, None])[:, None, None, :]
        self.first[index] = 0
        self.positions[index] = at
        self.write[index] = at
        self.ids[index] = torch.tensor(ids, device=self.device)
        self.seeds[index] = torch.tensor(seeds, device=self.device)
        self.step_no[index] = 0


class RefillDecoder(SlotDecoder):
    """Stock static decode of a batch of more requests than rows (``static_rows``): a row whose request has ended
    takes the next waiting one, so that the step keeps decoding live rows where a static batch would decode until
    its longest row ends (on real weights most continuations end long before their budget). A request's numbers
    are computed as in any static row: its prefix KV copied in unmodified (an exact pass still resumes from the
    decode-time state), its noise drawn from (its seed, its own step), which restarts at 0 when it is admitted.
    Admission and parking are eager writes into the buffers the captured step reads."""

    def admit(self, slots: list[int], states: list, lengths: list[int], seeds: list[int], tokens: list[int]) -> None:
        """Start request i in row ``slots[i]``: ``states[i]`` its prefix KV (stacked [layers, 2, 1, kv_heads, n,
        head_dim], or per-layer (k, v) pairs) of ``lengths[i]`` positions, its first input token ``tokens[i]``."""
        for slot, state, n in zip(slots, states, lengths):
            if n >= self.length:
                raise ValueError(f"prefix of {n} positions does not fit a static cache of {self.length}")
            if isinstance(state, torch.Tensor):
                self.kv[:, :, slot, :, :n].copy_(state[:, :, 0, :, :n])
            else:
                for layer, (k, v) in enumerate(state):
                    self.keys[layer][slot, :, :n].copy_(k[0, :, :n])
                    self.values[layer][slot, :, :n].copy_(v[0, :, :n])
        self._start_rows(torch.tensor(slots, device=self.device), lengths, tokens, seeds)

    def park(self, slots: list[int]) -> None:
        """Rows with no request left decode from position 0 on what they write themselves (results dropped), so
        that they stay within the cache whatever steps remain."""
        index = torch.tensor(slots, device=self.device)
        for buffer in (self.positions, self.write, self.ids, self.step_no):
            buffer[index] = 0
        self.mask[index] = False
        self.first[index] = 0

    def start(self, sampling: tuple[float, float]) -> None:
        self._set_sampling(sampling)


class AlignedDecoder(SlotDecoder):
    """Batch-invariant decode (``kernels: invariant`` with static decode): every forward, prompts and prefixes
    included, computes one token per row in one fixed shape [rows, length], and a row's position p always lives
    in cache slot p (``SlotDecoder``).

    A row's numbers are then a function of its own tokens alone: the GEMMs see the same shapes whatever the
    batch-mates (rows are independent in a GEMM of fixed shape), attention reduces over the same slots in the
    same order wherever the row sits, and prefill is the decode step itself, so a re-fed prefix reproduces the
    decode-time KV bit for bit. The engine must use one decoder shape for a configuration's rollouts and all
    its passes (``invariant_rows``, ``invariant_context``)."""

    def __init__(self, model, rows: int, length: int, *, graphs: bool, attention: str = INVARIANT_ATTENTION) -> None:
        super().__init__(model, rows, length, graphs=graphs, attention=attention)
        self.forced = torch.zeros(rows, length, device=self.device, dtype=torch.int64)
        self.hold = torch.zeros(rows, device=self.device, dtype=torch.int64)
        self.prefill_graph: torch.cuda.CUDAGraph | None = None
        self.prefill_warm = False

    @torch.inference_mode()
    def _prefill_step(self) -> None:
        """Feed each row's next forced token (no head, no sampling); a row at its last forced position stays
        there, recomputing that position into the same slot (bit-identical: same inputs, same shapes)."""
        self._layers()
        self._advance_prefill()

    @torch.inference_mode()
    def _prefill_step_scored(self) -> torch.Tensor:
        """``_prefill_step`` with the head a decode step applies (the same expression, in the same shape), and
        each row's log-prob of its next forced token: a re-fed prefix's log-probs in the kernels that computed the
        decode-time ones. Run eagerly (the prefill graph has no head)."""
        logits = self.model.lm_head(self.inner.norm(self._layers()))[:, 0, :]
        ahead = torch.clamp(self.positions + 1, max=self.length - 1)
        scores = token_logprob_of(logprob_rows(logits), self.forced.gather(1, ahead[:, None])[:, 0])
        self._advance_prefill()
        return scores

    def _advance_prefill(self) -> None:
        self.positions.copy_(torch.minimum(self.positions + 1, self.hold))
        self.write.copy_(self.positions)
        self.ids.copy_(self.forced.gather(1, self.positions[:, None])[:, 0])

    @torch.inference_mode()
    def logits(self) -> torch.Tensor:
        """One eager forward of the current inputs (its KV written as a step writes it), the logits only: no
        sampling, nothing advanced. The re-step probe's step, with the kernels the decode steps use."""
        return self.model.lm_head(self.inner.norm(self._layers()))[:, 0, :]

    def check_fits(self, needed: int) -> None:
        if needed > self.length:
            raise ValueError(
                f"{needed} positions do not fit the invariant decode's {self.length}-slot cache; "
                "raise the configuration's invariant_context"
            )

    def prefill(self, seqs: list[list[int]], starts: list[int | None] | None = None) -> list[list[float] | None]:
        """Compute the KV of ``seqs`` (one per row, at most ``rows``) into slots [0, len) by decode steps; the rows
        left over run copies of the first. With ``starts``, returns the log-probs the steps give each row's tokens
        ``seq[start:]`` (None for a row without a start)."""
        if not 0 < len(seqs) <= self.rows or not all(seqs):
            raise ValueError(f"prefill takes 1 to {self.rows} non-empty sequences, got lengths {list(map(len, seqs))}")
        self.check_fits(max(map(len, seqs)))
        n, starts = len(seqs), list(starts or [])
        seqs = seqs + [seqs[0]] * (self.rows - len(seqs))
        self.kv.zero_()
        self.mask.zero_()
        self.forced.zero_()
        for row, seq in enumerate(seqs):
            self.forced[row, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
        self.hold.copy_(torch.tensor([len(seq) - 1 for seq in seqs], device=self.device))
        self.positions.zero_()
        self.write.zero_()
        self.ids.copy_(self.forced[:, 0])
        if not any(start is not None for start in starts):
            for _ in range(max(map(len, seqs))):
                self._replay_prefill()
            return [None] * n
        scores = torch.stack([self._prefill_step_scored() for _ in range(max(map(len, seqs)))], dim=1).tolist()
        # step s scores the token at position s + 1 of a row still feeding its prefix
        return [
            None if start is None else scores[row][max(start, 1) - 1 : len(seqs[row]) - 1]
            for row, start in enumerate(starts[:n])
        ]

    def _replay_prefill(self) -> None:
        if not self.graphs:
            return self._prefill_step()
        if self.prefill_graph is None:
            if not self.prefill_warm:
                self.prefill_warm = True
                return self._prefill_step()
            self.prefill_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.prefill_graph):
                self._prefill_step()
        self.prefill_graph.replay()

    def start(
        self,
        lengths: list[int],
        ids: list[int],
        seeds: list[int],
        sampling: tuple[float, float],
        states: list[torch.Tensor | None] | None = None,
    ) -> None:
        """Begin decoding row r at position ``lengths[r]`` with token ``ids[r]``, over the KV of slots
        [0, lengths[r]): ``states[r]`` (stacked [layers, 2, 1, kv_heads, n >= length, head_dim]) copied in, or,
        where ``states`` is None, what ``prefill`` left there."""
        rows = len(lengths)
        self.check_fits(max(lengths) + 1)
        if states is not None:
            self.kv.zero_()
            for row, (state, n) in enumerate(zip(states, lengths)):
                self.kv[:, :, row, :, :n].copy_(state[:, :, 0, :, :n])
        pad = self.rows - rows
        lengths, ids, seeds = lengths + [lengths[0]] * pad, ids + [ids[0]] * pad, seeds + [seeds[0]] * pad
        if states is not None and pad:
            self.kv[:, :, rows:].copy_(self.kv[:, :, :1].expand(-1, -1, pad, -1, -1, -1))
        self._start_rows(torch.arange(self.rows, device=self.device), lengths, ids, seeds)
        self._set_sampling(sampling)
