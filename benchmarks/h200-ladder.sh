#!/usr/bin/env bash
# The ladder (reference/gpu-vllm/ladder/) on a lent GPU machine, one pair of campaign files of
# config/campaigns/gpu-vllm/ladder/ per lease (a lease holds the machine 30 minutes at most, staging included):
#   small: qwen-0.5b.yaml beside smollm2.yaml (staged without the 1.5B's weights);
#   large: qwen-1.5b.yaml beside qwen-invariant.yaml (staged without SmolLM2's and the 0.5B's);
#   large-stock: qwen-1.5b.yaml alone, in every slot the card holds (staged as large; for a lease after the
#   invariant control has finished: one H100 80GB runs three 1.5B jobs at once).
# Each file runs in a slot group of its own, bounded by the GiB its jobs ask for (Snakemake's gpu_gib resource: a
# vLLM cache of kv_cache_gib and its headroom per job), sized to the card's memory. Draws run in order (first
# draws, then second, then third), so a lease cut short leaves whole pairs. Each campaign leaves
# OUT_DIR/ladder-<file>.tgz (its reference folder; ladder-<file>.partial.tgz with what finished, where it did not).
#   bash benchmarks/h200-ladder.sh OUT_DIR LIMIT_S small|large|large-stock
# Run it from a copy of the project outside the call's working tree (a lent machine lays that tree anew at every
# call), staged as reference/gpu-vllm/README.md says, with an OUT_DIR other than the lent machine's $OUT (/root/out there, emptied at
# the start of every call); rerun with the same arguments to resume, or to pack a finished run's archives again.
set -uo pipefail
out=$(realpath -m "$1") limit=$2 pair=$3  # OUT_DIR as the caller named it, before the cd below
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
gib=$((mib / 1024))
ladder=config/campaigns/gpu-vllm/ladder
case "$pair:$((gib >= 120))" in
    # an H200: five 0.5B jobs (8 GiB caches) beside two SmolLM2 ones; four 1.5B jobs (18 GiB) beside two invariant
    small:1) groups=("$ladder/qwen-0.5b.yaml:5:$((gib - 32))" "$ladder/smollm2.yaml:2:28") ;;
    large:1) groups=("$ladder/qwen-1.5b.yaml:4:$((gib - 32))" "$ladder/qwen-invariant.yaml:2:28") ;;
    # each 1.5B job asks for 26 GiB (an 18 GiB cache and its headroom): five on an H200, three on an H100 80GB
    large-stock:1) groups=("$ladder/qwen-1.5b.yaml:5:$((gib - 8))") ;;
    large-stock:0) groups=("$ladder/qwen-1.5b.yaml:3:$((gib - 1))") ;;
    # an H100 80GB: three 0.5B jobs beside one SmolLM2; two 1.5B jobs beside one invariant
    small:0) groups=("$ladder/qwen-0.5b.yaml:3:$((gib - 16))" "$ladder/smollm2.yaml:1:14") ;;
    large:0) groups=("$ladder/qwen-1.5b.yaml:2:$((gib - 24))" "$ladder/qwen-invariant.yaml:1:14") ;;
    *) echo "usage: h200-ladder.sh OUT_DIR LIMIT_S small|large|large-stock" >&2; exit 2 ;;
esac
echo "GPU: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), ${gib} GiB; $pair: ${groups[*]}"
cd "$(dirname "$0")/.."
RETRIES=1 bash benchmarks/h200-campaigns-parallel.sh "$out" "$limit" "${groups[@]}"
