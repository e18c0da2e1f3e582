#!/usr/bin/env bash
# The 7B-scale measurement on a GPU machine: random-weight 7B-shape models made on the GPU, then the workflow's own
# rules on benchmarks/configs/scale-7b.yaml, the HF engine and stock vLLM at the paper's settings first, vLLM at
# its own H200 defaults (exact pass) last, one job on the GPU at a time; then the per-rule report. Run it from the
# project's root with snakemake and the packages on the path, and vLLM for its columns (without vLLM, the HF
# engine's configuration alone). On a machine without network, copy the wheels there first; set $WORK to a
# folder that outlives the session, with resources/ (the pinned wheels) linked into it:
#   bash benchmarks/h200-scale.sh OUT_DIR [TIMEOUT_S]
# Interrupted by TIMEOUT_S, a second call resumes (the models are kept, Snakemake keeps finished jobs, the passes
# keep finished batches). Writes OUT_DIR/h200-scale-7b.{json,md} and OUT_DIR/logs.tgz.
set -uo pipefail
out=$1 limit=${2:-3600}
cfg=benchmarks/configs/scale-7b.yaml
export WORK=${WORK:-$PWD/benchmarks/out/scale}
end=$((SECONDS + limit))
mkdir -p "$out" "$WORK"
[ -e "$WORK/resources" ] || ln -sfn "$PWD/resources" "$WORK/resources"
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python benchmarks/scale.py make-models "$WORK/shapes" \
    --packages "$WORK/resources/packages" || exit 1
pass() { echo "results/passes/$1/$2/000.parquet"; }
if python -c "import vllm" 2> /dev/null; then
    first="$(for c in q7b-hf q7b-vllm; do for p in exact replica refeed; do pass $c $p; done; done)"
    last="$(pass q7b-vllm-s1024 exact)"
else
    # the workflow refuses a configuration file naming an engine this interpreter lacks: the HF engine's alone
    echo "vLLM is not installed for this interpreter: the HF engine's configuration only"
    mkdir -p benchmarks/out
    python - "$cfg" benchmarks/out/scale-7b-hf.yaml <<'PY'
import sys

import yaml

config = yaml.safe_load(open(sys.argv[1]))
config["configs"] = {name: c for name, c in config["configs"].items() if c.get("engine", "hf") == "hf"}
yaml.safe_dump(config, open(sys.argv[2], "w"), sort_keys=False)
PY
    cfg=benchmarks/out/scale-7b-hf.yaml
    first="$(for p in exact replica refeed; do pass q7b-hf $p; done)" last=""
fi
for targets in "$first" "$last"; do
    [ -n "$targets" ] || continue
    left=$((end - SECONDS - 30))
    [ "$left" -gt 60 ] || { echo "no time left for: $targets"; break; }
    TARGETS=$(echo $targets) bash benchmarks/h200-pipeline.sh "$cfg" "$left"
done
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python benchmarks/scale.py report "$WORK" --configfile "$cfg" \
    --out "$out/h200-scale-7b.json" > "$out/h200-scale-7b.md"
cat "$out/h200-scale-7b.md"
tar -C "$WORK" -czf "$out/logs.tgz" results/logs results/benchmarks
