"""SGLang generate time for one batch of 512 rows, with and without the per-token top-5 log-probs that the sglang
engine asks for (issue 55's second lease, 2026-12-06; run on the lent H100 with the staged SGLang 0.5.16 and the
listed campaign's prepared 0.5B, after the campaign's jobs had ended):
    python logprob-probe.py   # printed: logprob-probe.out
"""

import random
import time

import sglang as sgl

if __name__ == "__main__":
    m = "/root/work/gpu-sglang-qwen-0.5b-vllm-problems/results/models/qwen2.5-coder-0.5b-bfloat16"
    e = sgl.Engine(
        model_path=m,
        mem_fraction_static=0.3,
        skip_tokenizer_init=True,
        sampling_backend="pytorch",
        log_level="error",
        random_seed=0,
    )
    rng = random.Random(0)
    ids = [[rng.randrange(1000, 30000) for _ in range(300)] for _ in range(512)]
    sp = {"temperature": 0.7, "top_p": 0.95, "max_new_tokens": 400, "ignore_eos": True}
    e.generate(input_ids=ids[:8], sampling_params={**sp, "max_new_tokens": 8})
    for lp in (True, False, True):
        e.flush_cache()
        t = time.time()
        e.generate(input_ids=ids, sampling_params=sp, return_logprob=lp, top_logprobs_num=5 if lp else 0)
        print(f"logprobs={lp}: 512 x 400 tokens in {time.time() - t:.2f} s", flush=True)
    e.shutdown()
