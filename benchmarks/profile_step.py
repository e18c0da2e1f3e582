"""Profile one static decode step of the Qwen2.5-0.5B shape on a GPU (kernel table), and the sampler alone."""
import sys, time, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.replay_throughput import qwen25_05b
from replaynoise.engines.fast import StaticDecoder, _compiled_sampler, _eager_sampler

B, L, P = int(sys.argv[1]) if len(sys.argv) > 1 else 512, 448, 280
model = qwen25_05b("cuda")
layers = [[(torch.randn(1, 2, P, 64, device="cuda", dtype=torch.bfloat16),) * 2 for _ in range(24)]]
def bench(fn, n=20):
    fn(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e3
for attention in ("sdpa", "efficient", "gemm"):
    dec = StaticDecoder(model, B, L, graphs=True, attention=attention)
    dec.load(layers, [P], [0] * B, list(range(B)), [5] * B, (1.0, 1.0))
    for _ in range(3): dec.step()
    print(attention, "graph step ms", bench(dec.step), "compiled sampler is eager:", _compiled_sampler().eager)
logits = torch.randn(B, 151936, device="cuda", dtype=torch.bfloat16)
s, st = torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.int64, device="cuda")
cs = _compiled_sampler()
print("sampler eager ms", bench(lambda: _eager_sampler(logits, s, st, 1.0, 1.0)), "compiled ms", bench(lambda: cs(logits, s, st, 1.0, 1.0)))
x = torch.randn(B, 1, 896, device="cuda", dtype=torch.bfloat16)
print("lm_head ms", bench(lambda: model.lm_head(x)))
print("one layer mlp ms", bench(lambda: model.model.layers[0].mlp(x)))
dec.graphs = False
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3): dec._step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
