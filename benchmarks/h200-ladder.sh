#!/usr/bin/env bash
# The ladder (reference/gpu-vllm/ladder/) on a lent GPU machine in one lease: the campaign files of
# config/campaigns/gpu-vllm/ladder/ side by side, the Qwen pair in one slot group and the invariant control then the
# SmolLM2 rung in another, each group bounded by the GiB its jobs ask for (Snakemake's gpu_gib resource: a vLLM
# cache of kv_cache_gib and its headroom per job), sized to the card's memory. Draws run in order (first draws,
# then second, then third), so a lease cut short leaves whole pairs. Each campaign leaves OUT_DIR/ladder-<file>.tgz
# (its reference folder; ladder-<file>.partial.tgz with what finished, where it did not).
#   bash benchmarks/h200-ladder.sh OUT_DIR LIMIT_S
# Run it from a copy of the project outside the call's working tree (a lent machine lays that tree anew at every
# call), staged as docs/vllm.md says; rerun with the same arguments to resume.
set -uo pipefail
out=$1 limit=$2
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
gib=$((mib / 1024))
if [ "$gib" -ge 120 ]; then  # an H200: four Qwen jobs (18 GiB caches for the 1.5B) beside two of the other group
    qwen="4:$((gib - 32))" other="2:28"
else                         # an H100 80GB: two 1.5B jobs, or one and two 0.5B, beside one other
    qwen="3:$((gib - 16))" other="1:14"
fi
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ${gib} GiB; Qwen slots:GiB ${qwen}, others ${other}"
cd "$(dirname "$0")/.."
RETRIES=1 bash benchmarks/h200-campaigns-parallel.sh "$out" "$limit" \
    "config/campaigns/gpu-vllm/ladder/qwen.yaml:$qwen" \
    "config/campaigns/gpu-vllm/ladder/qwen-invariant.yaml,config/campaigns/gpu-vllm/ladder/smollm2.yaml:$other"
