"""The rollout step's per-row host work, timed on the lent machine's CPU over a finished job's rollouts (the 7B
shape's q7b-hf, 64 rows of 512 tokens): the answer span (``answer_token_span``, whose ``char_offsets`` decodes every
prefix of the response), the pivot choice (``rollout_pivots``) and one decode a row, each over all rows, twice.
Run from the project's root as it ran in the lease (keeplen.txt):
    python keeplen.py /root/work/rollouts-7b benchmarks/configs/rollouts-7b.yaml q7b-hf
"""

import sys
import time
from pathlib import Path

import polars as pl
import yaml
from transformers import AutoTokenizer

from replaynoise.generation.pivots import PivotRules, rollout_pivots
from replaynoise.generation.rollouts import answer_token_span, char_offsets

work, cfgfile, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
cfg = yaml.safe_load(Path(cfgfile).read_text())
frame = pl.read_parquet(work / f"results/rollouts/{name}/shards/000.parquet")
tok = AutoTokenizer.from_pretrained(work / "shapes/qwen2.5-7b")
rules = PivotRules.from_config(cfg["pivots"], cfg["configs"][name]["block_size"])
rows = frame.to_dicts()
print("rows", len(rows), "mean response", sum(len(r["response_ids"]) for r in rows) / len(rows))
for rep in range(2):
    t = time.perf_counter()
    spans = [answer_token_span(tok, r["response_ids"]) for r in rows]
    a = time.perf_counter() - t
    t = time.perf_counter()
    offs = [char_offsets(tok, r["response_ids"]) for r in rows]
    o = time.perf_counter() - t
    t = time.perf_counter()
    texts = [tok.decode(r["response_ids"], skip_special_tokens=True) for r in rows]
    d = time.perf_counter() - t
    print(f"rep {rep}: answer_token_span {a:.3f} s, of which char_offsets {o:.3f} s, one decode a row {d:.3f} s")
    t = time.perf_counter()
    for r, s in zip(rows, spans):
        rollout_pivots({**r, "answer_span": s, "special_ids": set(r["special_ids"])}, rules, cfg["seed"], name)
    p = time.perf_counter() - t
    print(f"rep {rep}: rollout_pivots {p:.3f} s")
    print(
        "spans equal recorded:",
        sum((list(s) if s else None) == r["answer_span"] for s, r in zip(spans, rows)),
        "of",
        len(rows),
    )
