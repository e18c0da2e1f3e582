#!/usr/bin/env bash
# The SGLang factor lease (docs/mechanism.md) on a staged GPU machine, one card: the GEMMs' rows against a
# prefill-sized GEMM (benchmarks/kernel_switch.py --gemm-only), then the regime probe of the listed 1.5B campaign
# (config/campaigns/gpu-sglang/qwen-1.5b-vllm-problems.yaml) alone, then twice at once (each in its own WORK folder,
# the prepared model copied): three runs of one file, so that equal bytes settle both reproducibility and load in two
# probe-times. Then once per one-factor overlay (benchmarks/configs/regime-sglang-*.yaml), alone, and the base alone
# again last. Each probe's files go to OUT_DIR/<phase>/<n>-<file stem>/.
#   bash benchmarks/gpu-regime-sglang.sh OUT_DIR
set -uo pipefail
out=$(realpath -m "$1")
cd "$(dirname "$0")/.."
base=config/campaigns/gpu-sglang/qwen-1.5b-vllm-problems.yaml
w=${WORK:-/root/work}
mkdir -p "$out"
for m in 4096 512; do
    [ -s "$out/gemm-prefill-$m.json" ] || python benchmarks/kernel_switch.py --gemm-only --prefill-m $m \
        --out "$out/gemm-prefill-$m.json" > "$out/gemm-prefill-$m.log" 2>&1
done
KERNELS=none WORK=$w bash benchmarks/gpu-regime.sh "$out/alone" $base
for i in 1 2; do
    mkdir -p "$w-$i/results" && cp -a "$w/results/problems" "$w/results/models" "$w-$i/results/"
    ln -sfn "$w/resources" "$w-$i/resources"
done
KERNELS=none WORK=$w-1 bash benchmarks/gpu-regime.sh "$out/two-1" $base &
KERNELS=none WORK=$w-2 bash benchmarks/gpu-regime.sh "$out/two-2" $base &
wait
KERNELS=none WORK=$w bash benchmarks/gpu-regime.sh "$out/factors" \
    benchmarks/configs/regime-sglang-{nograph,deterministic,triton,flashinfer,running32,chunk256}.yaml $base
echo "$(date +%T) lease done" >> "$out/phases.log"
