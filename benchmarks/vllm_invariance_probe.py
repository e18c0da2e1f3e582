"""Where vLLM's batch-invariant mode stops being invariant on this GPU: one engine, the workflow's request
pattern, three passes, bitwise comparison.

Rollouts are generated as one batch with a cache salt each; continuations (prompt + response[:t] + [token],
K seeds) then run three times: ``exact`` (the rollouts' salts, so they read the decode-time blocks; in order, one
batch), ``replica`` (the same requests shuffled, in batches of other sizes) and ``refeed`` (another salt: the
prefix prefilled again). Under batch-invariant kernels all three must agree bit for bit. Variants, one process
each (the attention backend and kernels are fixed at engine start):

    python benchmarks/vllm_invariance_probe.py MODEL_DIR --attention FA2 --matmul cublaslt --rms-norm row --out p.json

``--matmul cublaslt`` is vLLM 0.26's own Hopper path (cuBLASLt without split-K); ``--matmul triton`` sends
mm/addmm/matmul/linear through vLLM's Triton persistent matmul as vLLM does on SM80 only. ``--rms-norm row``
is the engine's replacement of vLLM's add-RMSNorm (replaynoise.engines.vllm.build.row_invariant_add_rms_norm),
``--rms-norm vllm`` vLLM's own. ``--kernels stock`` runs without VLLM_BATCH_INVARIANT, for comparison.
Results of the H200: benchmarks/results/h200-vllm-probe/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from replaynoise.data.preparation import prepare_model
from replaynoise.engines.vllm import build as engine_vllm

NAMES = ["Tom", "Ana", "Lee", "Mia", "Raj", "Zoe", "Ben", "Ivy"]
THINGS = ["apples", "marbles", "books", "stamps", "coins", "shells"]
ATTENTION = {
    "FA2": {"backend": "FLASH_ATTN", "flash_attn_version": 2},
    "FA3": {"backend": "FLASH_ATTN", "flash_attn_version": 3},
    "TRITON_ATTN": {"backend": "TRITON_ATTN"},
    "FLEX_ATTENTION": {"backend": "FLEX_ATTENTION"},
}


_libraries = []  # kept alive: dropping a torch.library.Library removes its kernels


def triton_matmul_everywhere() -> None:
    """vLLM's fixed-tile Triton matmul for every GEMM, as vLLM installs it under VLLM_BATCH_INVARIANT on SM80."""
    from vllm.model_executor.layers import batch_invariant

    library = torch.library.Library("aten", "IMPL")
    for op in ("mm", "addmm", "matmul", "linear"):
        library.impl(f"aten::{op}", getattr(batch_invariant, f"{op}_batch_invariant"), "CUDA")
    _libraries.append(library)


def questions(n: int, rng: random.Random) -> list[str]:
    return [
        f"{rng.choice(NAMES)} has {rng.randint(2, 90)} {rng.choice(THINGS)}, gets {rng.randint(2, 90)} more "
        f"and gives away {rng.randint(1, 9)}. How many are left? Answer step by step."
        for _ in range(n)
    ]


def run(llm, requests, salts, sampling, order=None, sizes=None):
    """Generate ``requests`` (token lists) with their salts, in ``order`` and batches of ``sizes``; results by
    request index as (token ids, raw log-prob bytes, cached tokens)."""
    from vllm.inputs import TokensPrompt

    order = list(range(len(requests))) if order is None else order
    out, start, b = {}, 0, 0
    while start < len(order):
        size = len(order) if sizes is None else sizes[b % len(sizes)]
        chunk = order[start : start + size]
        inputs = [TokensPrompt(prompt_token_ids=requests[i], cache_salt=salts[i]) for i in chunk]
        for i, res in zip(chunk, llm.generate(inputs, [sampling[i] for i in chunk], use_tqdm=False)):
            comp = res.outputs[0]
            raw = json.dumps([sorted((t, lp.logprob) for t, lp in pos.items()) for pos in comp.logprobs])
            out[i] = (list(comp.token_ids), raw, int(res.num_cached_tokens or 0))
        start += size
        b += 1
    return out


def compare(a: dict, b: dict) -> dict:
    tokens = sum(a[i][0] == b[i][0] for i in a)
    first = sum(json.loads(a[i][1])[:1] == json.loads(b[i][1])[:1] for i in a)
    whole = sum(a[i][:2] == b[i][:2] for i in a)
    return {"requests": len(a), "same_tokens": tokens, "same_first_logprobs": first, "same_everything": whole}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--spec", default="smollm2-135m", help="packaged model to prepare if MODEL_DIR is absent")
    ap.add_argument("--packages", type=Path, default=Path("resources/packages"))
    ap.add_argument("--kernels", choices=["invariant", "stock"], default="invariant")
    ap.add_argument("--matmul", choices=["cublaslt", "triton"], default="cublaslt")
    ap.add_argument("--rms-norm", choices=["row", "vllm"], default="row")
    ap.add_argument("--attention", choices=sorted(ATTENTION), default="FA2")
    ap.add_argument("--device", default="cuda", help="cpu only to try the script (stock kernels)")
    ap.add_argument("--block-size", type=int, default=16, help="vLLM's CPU backend needs 32")
    ap.add_argument("--kv-cache-gib", type=int, default=8)
    ap.add_argument("--problems", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not args.model_dir.exists():
        prepare_model(args.spec, "bfloat16", args.model_dir, args.packages)
    if args.kernels == "invariant":
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # before vLLM is first imported
        engine_vllm.invariant_llm_kwargs = lambda: {"attention_config": ATTENTION[args.attention]}
        if args.rms_norm == "vllm":
            engine_vllm.patch_invariant_rms_norm = lambda: None
        if args.matmul == "triton":
            triton_matmul_everywhere()
    settings = {
        "device": args.device,
        "kernels": args.kernels,
        "dtype": "bfloat16",
        "block_size": args.block_size,
        "kv_cache_gib": args.kv_cache_gib,
    }
    t0 = time.time()
    llm = engine_vllm.build_llm(args.model_dir, settings, topk=5, threads=8)
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    rng = random.Random(0)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions(args.problems, rng)
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]

    def params(seed, n):
        return SamplingParams(seed=seed, temperature=0.7, top_p=0.95, max_tokens=n, logprobs=5, detokenize=False)

    salts = [f"rollout-{i}" for i in range(len(prompts))]
    rollouts = run(llm, prompts, salts, [params(i, 64) for i in range(len(prompts))])
    alone = run(llm, prompts[:8], [f"alone-{i}" for i in range(8)], [params(i, 64) for i in range(8)], sizes=[1])
    requests, rsalts, rsampling = [], [], []
    for i, p in enumerate(prompts):
        response = rollouts[i][0]
        for t in (8, 16 + 1, 32 + 2, 48):  # block boundaries and off them, as the workflow's pivots lie
            if t < len(response):
                for k in range(args.k):
                    requests.append(p + response[:t] + [response[t]])
                    rsalts.append(salts[i])
                    rsampling.append(params(10_000 * i + 100 * t + k, 32))
    exact = run(llm, requests, rsalts, rsampling)
    order = list(range(len(requests)))
    random.Random(1).shuffle(order)
    replica = run(llm, requests, rsalts, rsampling, order=order, sizes=[97, 300, 41, 512])
    refeed = run(llm, requests, ["refeed"] * len(requests), rsampling)
    expected = [((len(r) - 1) // args.block_size) * args.block_size for r in requests]
    invariant = args.kernels == "invariant"
    report = {
        "kernels": args.kernels,
        "matmul": args.matmul if invariant else None,
        "attention": args.attention if invariant else None,
        "rms_norm": args.rms_norm if invariant else None,
        "rollouts_alone_vs_batched": compare(alone, {i: rollouts[i] for i in alone}),
        "exact_vs_replica": compare(exact, replica),
        "exact_vs_refeed": compare(exact, refeed),
        "exact_cache_hits": sum(exact[i][2] == expected[i] for i in exact),
        "replica_cache_hits": sum(replica[i][2] == expected[i] for i in replica),
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(report))
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
