#!/usr/bin/env bash
# The mechanism lease on a staged GPU machine (docs/mechanism.md): benchmarks/kernel_switch.py (KERNELS: vllm, the
# default, sglang, or none), then the regime probe (snakemake regime) for each campaign file in order (an overlay runs over its base: replaynoise.overlays), on one
# WORK folder, each probe's files copied to OUT_DIR/<n>-<file stem>/ as it ends. Run in the background and poll
# OUT_DIR/phases.log; rerun to resume (a probe whose files were copied is not run again).
#   bash benchmarks/gpu-regime.sh OUT_DIR CAMPAIGN.yaml ...
set -uo pipefail
out=$(realpath -m "$1"); shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
work=${WORK:-/root/work}
log() { echo "$(date +%T) $*" | tee -a "$out/phases.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"
kernels=${KERNELS:-vllm}
if [ "$kernels" != none ] && [ ! -s "$out/kernel-switch.json" ]; then
    log "kernel_switch start"
    python benchmarks/kernel_switch.py --backend "$kernels" --out "$out/kernel-switch.json" \
        > "$out/kernel-switch.log" 2>&1
    log "kernel_switch end rc $?"
fi
n=0
for item in "$@"; do
    n=$((n + 1))
    files=(--configfile $(python -m replaynoise.overlays "$item"))
    dest="$out/$n-$(basename "$item" .yaml)"
    [ -s "$dest/probe.json" ] && continue
    rm -rf "$dest"
    log "probe $n $item start"
    snakemake regime -s "$PWD/Snakefile" --directory "$work" "${files[@]}" --replace-workflow-config --cores 16 \
        > "$out/snakemake-$n.log" 2>&1
    rc=$?
    mkdir -p "$dest"
    cp "$work"/results/regime/*/probe.json "$work"/results/regime/*/first_steps.parquet \
        "$work"/results/regime/*/mismatch.parquet "$work"/results/regime/*/decode.parquet "$dest/" 2>/dev/null
    cp "$work"/results/logs/regime_probe/*.log "$dest/" 2>/dev/null
    rm -rf "$work"/results/regime
    log "probe $n $item end rc $rc"
done
log "all done"
