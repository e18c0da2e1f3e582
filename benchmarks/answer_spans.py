"""The rollout step's answer spans (``generation.answer_spans``), every prefix decoded (``char_offsets``, before
74c8e67) against the one-pass byte-level offsets (``token_offsets``), on 64 responses of 512 tokens a batch (the
7B-shape benchmark's rollout batch), with a packaged model's tokenizer; one process, one thread.

    PYTHONPATH=. python benchmarks/answer_spans.py [--model qwen2.5-coder-0.5b] [--repeats 3]

Responses are Qwen-style worked answers (text with digits, signs and a few non-ASCII symbols) tokenized and cut to
512 tokens, so that each has a last number to find; both paths must give the same spans, which is checked.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replaynoise.data.models import PACKAGED_MODELS  # noqa: E402
from replaynoise.data.preparation import assemble_gguf, gguf_tokenizer  # noqa: E402
from replaynoise.generation import answer_spans  # noqa: E402

PACKAGES = Path(__file__).resolve().parents[1] / "resources" / "packages"
STEP = "Step {i}: she had {a} marbles, gave away {b} → {c} × 2 = {d}; check ✓ 3·{b} ≥ {a}. "


def responses(tokenizer, n: int = 64, length: int = 512) -> list[list[int]]:
    out = []
    for r in range(n):
        text = "".join(STEP.format(i=i, a=r + i, b=i % 7, c=r + 2 * i, d=2 * (r + 2 * i)) for i in range(60))
        tail = tokenizer.encode(f" Answer: {r + 17}", add_special_tokens=False)
        out.append(tokenizer.encode(text, add_special_tokens=False)[: length - len(tail)] + tail)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", choices=sorted(PACKAGED_MODELS))
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer = gguf_tokenizer(assemble_gguf(PACKAGED_MODELS[args.model], PACKAGES))
    rows = responses(tokenizer)
    print(
        f"{args.model}: {len(rows)} responses of {sorted({len(r) for r in rows})} tokens; byte-level path: "
        f"{answer_spans.byte_level_backend(tokenizer) is not None}"
    )
    fast = answer_spans.token_offsets
    for rep in range(args.repeats):
        answer_spans.token_offsets = lambda tok, ids, text: answer_spans.char_offsets(tok, ids)
        start = time.perf_counter()
        before = [answer_spans.answer_token_span(tokenizer, r) for r in rows]
        slow_s = time.perf_counter() - start
        answer_spans.token_offsets = fast
        start = time.perf_counter()
        after = [answer_spans.answer_token_span(tokenizer, r) for r in rows]
        fast_s = time.perf_counter() - start
        assert before == after and all(s is not None for s in after)
        print(f"repeat {rep}: every prefix decoded {slow_s:.3f} s, one pass {fast_s:.4f} s, same spans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
