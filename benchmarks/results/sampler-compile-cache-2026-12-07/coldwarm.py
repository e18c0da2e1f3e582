"""issue 56: the compiled sampler's first call in a fresh process, with inductor's and Triton's caches cold and then
warm (another process, the same cache folders), at SAMPLER_WAYS = argv[1] and argv[2] rows: what a run's first job
and its later jobs pay for the sampler's compilation."""
import json, sys, time
import torch
import replaynoise.engines.hf.kernels as k

k.SAMPLER_WAYS = int(sys.argv[1])
rows = int(sys.argv[2])
g = torch.Generator(device="cuda").manual_seed(0)
logits = (torch.randn(rows, 151936, device="cuda", generator=g) * 2).to(torch.bfloat16)
seeds = torch.arange(rows, device="cuda", dtype=torch.int64)
steps = torch.zeros(rows, dtype=torch.int64, device="cuda")
torch.cuda.synchronize()
t = time.perf_counter()
k.compiled_sampler()(logits, seeds, steps, 0.7, 0.95)
torch.cuda.synchronize()
print(json.dumps({"ways": k.SAMPLER_WAYS, "rows": rows, "cache": sys.argv[3], "first_call_s": round(time.perf_counter() - t, 2)}), flush=True)
