"""Which continuation each row of a refilled static decoder holds (``static.RefillDecoder``): a batch of more
continuations than rows, each row taking the next waiting continuation, in batch order, when its own has ended.

Rows are looked at every ``CHECK_EVERY`` steps (each look syncs with the device), so a row runs at most that many
steps past its end. Which continuation a row holds at each step is then a function of the batch alone (of its
continuations' tokens), so a resumed pass computes what an uninterrupted one did.
"""

from __future__ import annotations

from collections import deque

import torch

from replaynoise.engines.base import ContinuationRequest
from replaynoise.engines.hf.states import PrefixState
from replaynoise.engines.hf.static import RefillDecoder
from replaynoise.engines.sampling import digest_rows, digest_strings, topk_rows

#: steps between two looks at a static batch's tokens: a batch that may end early is checked this often, and a
#: refilled row decodes at most this many steps past its end
CHECK_EVERY = 16


class Refill:
    """The bookkeeping of one refilled batch: the waiting continuations, the one each row holds, their tokens and
    how they ended, and the first step's top-k and digest of each (taken when it starts, whatever the step)."""

    def __init__(
        self,
        decoder: RefillDecoder,
        requests: list[ContinuationRequest],
        states: list[PrefixState],
        steps: int,
        eos_ids: set[int],
        topk: int,
    ) -> None:
        self.decoder, self.requests, self.states, self.steps, self.eos_ids = decoder, requests, states, steps, eos_ids
        self.topk = topk
        #: steps between two looks: CHECK_EVERY, or the budget where it is shorter (a one-token continuation ends
        #: after one step, and its row is free for the next)
        self.every = min(CHECK_EVERY, steps)
        #: the rows' tokens since the last look
        self.tokens = torch.empty(decoder.rows, self.every, dtype=torch.int64, device=decoder.device)
        self.waiting = deque(range(len(requests)))
        self.holder: list[int | None] = [None] * decoder.rows
        self.generated: list[list[int]] = [[] for _ in requests]
        self.finish = ["length"] * len(requests)
        #: rows whose next step is their continuation's first
        self.fresh: list[int] = []
        self._firsts: list[tuple] = []

    def admit(self, free: list[int]) -> None:
        """Give the free rows the next waiting continuations; rows left without one are parked."""
        taken = [self.waiting.popleft() for _ in range(min(len(free), len(self.waiting)))]
        used, idle = free[: len(taken)], free[len(taken) :]
        if taken:
            states = [self.states[i] for i in taken]
            stacked = all(s.kv is not None for s in states)
            self.decoder.admit(
                used,
                [s.kv if stacked else s.per_layer() for s in states],
                [s.length for s in states],
                [self.requests[i].seed for i in taken],
                [self.requests[i].branch_token for i in taken],
            )
        if idle:
            self.decoder.park(idle)
        for row, i in zip(free, taken + [None] * len(idle)):
            self.holder[row] = i
        self.fresh = used

    def record(self, step: int) -> bool:
        """One decode step: the first step's top-k and digest of the rows that start a continuation (kept on the
        device until the batch ends), every row's token, and every ``every`` steps a look at them (``window``).
        True once every continuation has ended."""
        logits, tokens = self.decoder.step()
        if self.fresh:
            chosen = logits.index_select(0, torch.tensor(self.fresh, device=logits.device))
            taken = [self.holder[row] for row in self.fresh]
            self._firsts.append((taken, *topk_rows(chosen, self.topk), digest_rows(chosen)))
            self.fresh = []
        self.tokens[:, step % self.every] = tokens
        return step % self.every == self.every - 1 and self.window(self.tokens.tolist())

    def window(self, tokens: list[list[int]]) -> bool:
        """Each row's tokens of the last ``every`` steps: a continuation that has ended leaves its row, which
        the next waiting one takes. True once every continuation has ended."""
        ended = []
        for row, new in enumerate(tokens):
            i = self.holder[row]
            if i is not None and self._extend(i, new):
                ended.append(row)
        if ended:
            self.admit(ended)
        return all(i is None for i in self.holder)

    def _extend(self, i: int, new: list[int]) -> bool:
        """Append a continuation's new tokens, cut after its end-of-sequence token or at its budget; True if it
        has ended."""
        tokens = self.generated[i]
        start = len(tokens)
        tokens.extend(new)
        end = next((j for j in range(start, min(len(tokens), self.steps)) if tokens[j] in self.eos_ids), None)
        if end is not None:
            del tokens[end + 1 :]
            self.finish[i] = "eos"
            return True
        if len(tokens) >= self.steps:
            del tokens[self.steps :]
            return True
        return False

    def firsts(self) -> list[tuple]:
        """Every continuation's first-step (top-k ids, top-k log-probs, digest), on the host."""
        if self.waiting or any(i is not None for i in self.holder):
            raise RuntimeError(
                f"refilled decode of {len(self.requests)} continuations in {self.decoder.rows} rows stopped before "
                "they all ended"
            )
        first: list = [None] * len(self.requests)
        for taken, ids, values, digests in self._firsts:
            for i, row_ids, row_values, digest in zip(taken, ids.tolist(), values.tolist(), digest_strings(digests)):
                first[i] = (row_ids, row_values, digest)
        return first
