#!/usr/bin/env bash
# Several campaign files at once on one GPU machine, each through benchmarks/h200-campaign.sh with its own number
# of GPU slots (models of 135M-0.5B parameters leave an H200 mostly idle, and one lease holds the machine for
# 30 minutes at most). Each file runs in its own working directory under $WORK, logs to OUT_DIR/<file>.log and
# leaves OUT_DIR/<folder>-<file>.tgz with what reference/ keeps:
#   bash benchmarks/h200-campaigns-parallel.sh OUT_DIR TIMEOUT_S config/campaigns/gpu-vllm/paper-qwen.yaml:3 ...
# FILE:SLOTS gives that file's jobs SLOTS GPU slots (default 1). Rerun with the same arguments to resume.
set -uo pipefail
out=$1 limit=$2; shift 2
mkdir -p "$out"
pids=()
for spec in "$@"; do
    cfg=${spec%%:*} slots=${spec##*:}
    [ "$slots" = "$spec" ] && slots=1
    GPU_SLOTS=$slots bash benchmarks/h200-campaign.sh "$out" "$limit" "$cfg" > "$out/$(basename "$cfg" .yaml).log" 2>&1 &
    pids+=($!)
done
wait "${pids[@]}"
