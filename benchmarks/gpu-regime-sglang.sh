#!/usr/bin/env bash
# The SGLang factor lease (docs/mechanism.md) on a staged GPU machine, one card: SGLang's FA3 kernel switch, then the
# regime probe of the listed 1.5B campaign (config/campaigns/gpu-sglang/qwen-1.5b-vllm-problems.yaml) twice alone,
# twice at once (each in its own WORK folder, the prepared model copied), then once per one-factor overlay
# (benchmarks/configs/regime-sglang-*.yaml), alone. Each probe's files go to OUT_DIR/<phase>/<n>-<file stem>/.
#   bash benchmarks/gpu-regime-sglang.sh OUT_DIR
set -uo pipefail
out=$(realpath -m "$1")
cd "$(dirname "$0")/.."
base=config/campaigns/gpu-sglang/qwen-1.5b-vllm-problems.yaml
w=${WORK:-/root/work}
KERNELS=sglang WORK=$w bash benchmarks/gpu-regime.sh "$out/alone" $base $base
for i in 1 2; do
    mkdir -p "$w-$i/results" && cp -a "$w/results/problems" "$w/results/models" "$w-$i/results/"
    ln -sfn "$w/resources" "$w-$i/resources"
done
KERNELS=none WORK=$w-1 bash benchmarks/gpu-regime.sh "$out/two-1" $base &
KERNELS=none WORK=$w-2 bash benchmarks/gpu-regime.sh "$out/two-2" $base &
wait
KERNELS=none WORK=$w bash benchmarks/gpu-regime.sh "$out/factors" \
    benchmarks/configs/regime-sglang-{nograph,running32,triton,flashinfer,chunk256,deterministic}.yaml
echo "$(date +%T) lease done" >> "$out/phases.log"
