#!/usr/bin/env bash
# The 7B shape's rollout rule (issue 56, item 1) on a GPU machine, one job at a time through the workflow's own rule:
# the HF engine with eager layers in its captured step (q7b-hf), with compiled layers on empty inductor and Triton
# caches (q7b-hf-c) and again with those caches filled (q7b-hf-cw), then stock vLLM at the paper's settings where
# this interpreter has it (q7b-vllm); then each HF form's step profiled (benchmarks/profile_rollouts.py, caches
# filled) and the per-rule report. Run it from the project's root with snakemake and the packages on the path:
#   bash benchmarks/rollouts-7b.sh OUT_DIR [TIMEOUT_S]
# Interrupted by TIMEOUT_S, a second call resumes (the caches are emptied once per $WORK, before the first job).
# Writes OUT_DIR/profile-<config>.{json,txt}, OUT_DIR/h200-rollouts-7b.{json,md} and OUT_DIR/logs-rollouts-7b.tgz.
set -uo pipefail
out=$1 limit=${2:-1200} cfg=benchmarks/configs/rollouts-7b.yaml
export WORK=${WORK:-$PWD/benchmarks/out/rollouts-7b}
end=$((SECONDS + limit))
mkdir -p "$out" "$WORK"
[ -e "$WORK/resources" ] || ln -sfn "$PWD/resources" "$WORK/resources"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python benchmarks/scale.py make-models "$WORK/shapes" --packages "$WORK/resources/packages" || exit 1
# The caches' folders inside $WORK, emptied before the first job only: q7b-hf-c compiles its shape cold, q7b-hf-cw
# (the same settings, a later job) finds it compiled, as a run's later rollout jobs on one machine do.
export TORCHINDUCTOR_CACHE_DIR=$WORK/inductor-cache TRITON_CACHE_DIR=$WORK/triton-cache
if [ ! -e "$WORK/.caches-emptied" ]; then
    rm -rf "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR" && touch "$WORK/.caches-emptied"
fi
configs="q7b-hf q7b-hf-c q7b-hf-cw"
python -c "import vllm" 2> /dev/null && configs="$configs q7b-vllm"
for c in $configs; do
    left=$((end - SECONDS - 30))
    [ "$left" -gt 60 ] || { echo "no time left for $c"; break; }
    TARGETS=results/rollouts/$c/shards/000.parquet bash benchmarks/h200-pipeline.sh "$cfg" "$left"
done
for c in q7b-hf q7b-hf-c; do
    [ -s "$out/profile-$c.json" ] && continue
    left=$((end - SECONDS - 30))
    [ "$left" -gt 90 ] || { echo "no time left to profile $c"; break; }
    timeout "$left" python benchmarks/profile_rollouts.py "$WORK" --configfile "$cfg" --config "$c" \
        ${COMMIT:+--commit "$COMMIT"} --out "$out/profile-$c.json" > "$out/profile-$c.txt" 2>&1
done
python benchmarks/scale.py report "$WORK" --configfile "$cfg" ${COMMIT:+--commit "$COMMIT"} \
    --out "$out/h200-rollouts-7b.json" > "$out/h200-rollouts-7b.md"
cat "$out/h200-rollouts-7b.md"
tar -C "$WORK" -czf "$out/logs-rollouts-7b.tgz" results/logs results/benchmarks
