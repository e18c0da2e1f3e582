#!/usr/bin/env bash
# The reference/gpu campaign on a GPU machine: each campaign file of config/campaigns/gpu/ runs in a
# working directory of its own under $WORK (a folder that outlives the session, with resources/ and its pinned
# wheels in it; on a machine without network, copied there first), then what reference/gpu keeps is packed into
# one tarball per file:
#   bash benchmarks/h200-campaign.sh OUT_DIR TIMEOUT_S config/campaigns/gpu/smollm2.yaml [more.yaml ...]
# TIMEOUT_S bounds the whole call; interrupted, a second call resumes every run where it stopped (Snakemake
# keeps finished jobs, the passes keep finished batches).
set -uo pipefail
out=$1 limit=$2; shift 2
base=${WORK:-$PWD/benchmarks/out}
end=$((SECONDS + limit))
for cfg in "$@"; do
    name=$(basename "$cfg" .yaml)
    # gpu/<name>.yaml runs in $WORK/<name> (reference/gpu/<name>); any other folder's file in $WORK/<folder>-<name>,
    # so that gpu/smollm2.yaml and gpu-vllm/smollm2.yaml never share a working directory (they once did)
    folder=$(basename "$(dirname "$cfg")")
    [ "$folder" = gpu ] || name="$folder-$name"
    export WORK=$base/$name
    mkdir -p "$WORK"
    [ -e "$base/resources" ] && ln -sfn "$base/resources" "$WORK/resources"
    left=$((end - SECONDS - 20))
    [ "$left" -gt 30 ] || { echo "$name: no time left"; continue; }
    rm -f "$out/$name.tgz" "$out/$name.partial.tgz" "$out/$name.reference-partial.tgz"  # an earlier call's
    echo "== $name ($left s left)"
    bash benchmarks/h200-pipeline.sh "$cfg" "$left" "$WORK/h200-pipeline.json"
    if [ -f "$WORK/results/MANIFEST.sha256" ]; then
        python -m replaynoise.reference snapshot "$WORK/results" "$WORK/reference" >/dev/null
        mkdir -p "$WORK/reference/credit" "$WORK/reference/logs"
        cp -r "$WORK"/results/credit/* "$WORK/reference/credit/"
        cp -r "$WORK"/results/logs/* "$WORK/reference/logs/"
        cp "$WORK/h200-pipeline.json" "$WORK/reference/"
        for m in "$WORK"/results/models/*/replaynoise-model.json; do  # what made each model (a trained one's recipe)
            mkdir -p "$WORK/reference/models/$(basename "$(dirname "$m")")" && cp "$m" "$_/"
        done
        tar -C "$WORK" -czf "$out/$name.tgz" reference
        ls -la "$out/$name.tgz"
    else  # cut short: a partial reference folder where exact and a whole pair of draws finished, else what did
        packed="$out/$name.reference-partial.tgz"
        bash benchmarks/h200-partial.sh "$WORK" "$cfg" "$packed" "the run stopped before every pass ran" 2>&1 | tail -3
        if [ ! -f "$packed" ] && [ -d "$WORK/results/logs" ]; then  # the logs to see why, and what did finish
            parts=$(cd "$WORK" && ls -d results/logs results/pivots results/credit results/analysis \
                results/problems results/benchmarks 2>/dev/null)
            tar -C "$WORK" -czf "$out/$name.partial.tgz" $parts
        fi
    fi
done
