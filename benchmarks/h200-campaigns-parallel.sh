#!/usr/bin/env bash
# Several campaign files at once on one GPU machine, each through benchmarks/h200-campaign.sh with its own number
# of GPU slots (models of 135M-0.5B parameters leave an H200 mostly idle, and one lease holds the machine for
# 30 minutes at most). Each file runs in its own working directory under $WORK, logs to OUT_DIR/<file>.log and
# leaves OUT_DIR/<folder>-<file>.tgz with what reference/ keeps:
#   bash benchmarks/h200-campaigns-parallel.sh OUT_DIR TIMEOUT_S config/campaigns/gpu-vllm/paper-qwen.yaml:3 ...
# FILE:SLOTS gives that file's jobs SLOTS GPU slots (default 1); FILE:SLOTS:GIB also bounds the GiB of the GPU
# they ask for together (each job a vLLM cache of kv_cache_gib and its headroom: GPU_GIB of
# benchmarks/h200-pipeline.sh); FILE,FILE2:... runs the files one after the other in those slots.
# Rerun with the same arguments to resume.
set -uo pipefail
out=$1 limit=$2; shift 2
mkdir -p "$out"
pids=()
for spec in "$@"; do
    IFS=: read -r files slots gib <<< "$spec"
    IFS=, read -r -a cfgs <<< "$files"
    GPU_SLOTS=${slots:-1} GPU_GIB=${gib:-} bash benchmarks/h200-campaign.sh "$out" "$limit" "${cfgs[@]}" \
        > "$out/$(basename "${cfgs[0]}" .yaml).log" 2>&1 &
    pids+=($!)
done
wait "${pids[@]}"
