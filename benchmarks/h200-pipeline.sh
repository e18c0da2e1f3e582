#!/usr/bin/env bash
# The H200 pipeline measurement on a GPU machine: the workflow's own rules, real packaged weights, wall time from
# prepared models (or from nothing) to results/MANIFEST.sha256, then per-rule generated tokens/s and where each
# loop's time went. Run it from the project's root where `snakemake` and the packages are on the path, with
# $WORK a folder that outlives the session (on a machine without network, the wheels copied there first):
#   bash benchmarks/h200-pipeline.sh benchmarks/configs/h200-pipeline.yaml [TIMEOUT_S] [OUT_JSON]
# TARGETS (optional, in the environment): the files to make instead of the whole run, in Snakemake's syntax.
# Interrupted by TIMEOUT_S, a second call resumes the run (Snakemake keeps finished jobs; passes keep batches).
set -uo pipefail
cfg=$1 limit=${2:-520} out=${3:-}
work=${WORK:-$PWD/benchmarks/out/run}
# A normal install has compiled bytecode; the lent machine's site packages have none and cannot keep it, so
# without a cache every job would spend about 10 s compiling the imports of torch and transformers again.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-$work/.pycache}
SECONDS=0
# Snakemake in a process group of its own, ended with its jobs at the limit: a plain `timeout snakemake | grep`
# waited on for the jobs (a vLLM job keeps the pipe open after Snakemake is gone), so the call ran past its limit
# and brought nothing back (measured on the H200).
# --keep-going: one failing step (an invariant comparison that finds differences) must not stop the other
# configurations' passes, which a lease cannot rerun cheaply.
mkdir -p "$work"
log="$work/snakemake.log"
set -m
# GPU_SLOTS: model jobs sharing the GPU at once (default 1; small models leave an H200 mostly idle, but their
# per-rule seconds then include the sharing, so the cost statement overstates their GPU time).
# a campaign file that is an overlay (overlay_of) runs with its base before it: replaynoise/overlays.py
# GPU_GIB: the GiB of the GPU those jobs may ask for together (each a vLLM cache of kv_cache_gib and its headroom;
# workflow/rules/common.smk, gpu_gib), so that jobs of several sizes share one GPU; unset: no bound.
# RETRIES: Snakemake's --retries (a job that could not start, e.g. for want of GPU memory, runs again).
snakemake -s "$PWD/Snakefile" --directory "$work" --cores "$(nproc)" --keep-going ${RETRIES:+--retries "$RETRIES"} \
    --resources gpu="${GPU_SLOTS:-1}" ${GPU_GIB:+gpu_gib="$GPU_GIB"} \
    --configfile $(python -m replaynoise.overlays "$PWD/$cfg") --replace-workflow-config ${TARGETS:-} >> "$log" 2>&1 &
run=$!
( sleep "$limit"; kill -TERM -- "-$run"; sleep 15; kill -KILL -- "-$run" ) > /dev/null 2>&1 &
watchdog=$!
wait "$run"
kill -- "-$watchdog" 2>/dev/null  # its sleep too, which would otherwise hold the caller's output open
set +m
grep -E -i "error|exception" "$log" | head -20
echo "wall ${SECONDS} s; MANIFEST: $(test -f "$work/results/MANIFEST.sha256" && echo present || echo absent)"
grep -h -E ": done,|time by phase" "$work"/results/logs/generate_rollouts/*.log "$work"/results/logs/replay_*/*.log
[ -n "${TARGETS:-}" ] || python benchmarks/pipeline.py "$work" --configfile "$cfg" ${out:+--out "$out"}
