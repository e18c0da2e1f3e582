#!/usr/bin/env bash
# The 7B-scale measurement on a GPU machine: random-weight 7B-shape models made on the GPU, then the workflow's own
# rules on benchmarks/configs/scale-7b.yaml, the HF engine and stock vLLM at the paper's settings first, vLLM at
# its own H200 defaults (exact pass) last, one job on the GPU at a time; then the per-rule report. Run it from the
# project's root with snakemake and the packages on the path, and vLLM for its columns (without vLLM, the HF
# engine's configuration alone). On a machine without network, copy the wheels there first; set $WORK to a
# folder that outlives the session, with resources/ (the pinned wheels) linked into it:
#   bash benchmarks/h200-scale.sh OUT_DIR [TIMEOUT_S] [CONFIG]
# CONFIG is benchmarks/configs/scale-7b.yaml unless named (benchmarks/configs/real-1.5b.yaml: the real 1.5B, the same
# design). Interrupted by TIMEOUT_S, a second call resumes (the models are kept, Snakemake keeps finished jobs, the
# passes keep finished batches). Writes OUT_DIR/h200-<config>.{json,md} and OUT_DIR/logs-<config>.tgz.
set -uo pipefail
out=$1 limit=${2:-3600} cfg=${3:-benchmarks/configs/scale-7b.yaml}
name=$(basename "$cfg" .yaml)
export WORK=${WORK:-$PWD/benchmarks/out/$name}
end=$((SECONDS + limit))
mkdir -p "$out" "$WORK"
[ -e "$WORK/resources" ] || ln -sfn "$PWD/resources" "$WORK/resources"
if grep -q "model: shapes/" "$cfg"; then  # random-weight shapes, made on the GPU (a packaged model needs none)
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python benchmarks/scale.py make-models "$WORK/shapes" \
        --packages "$WORK/resources/packages" || exit 1
fi
# the configurations of the file: *-s1024 (vLLM at its own defaults) runs its exact pass last, the others all passes
configs() {
    python - "$cfg" "$1" <<'PY'
import sys

import yaml

configs = yaml.safe_load(open(sys.argv[1]))["configs"]
print(" ".join(n for n, c in configs.items() if sys.argv[2] != "hf" or c.get("engine", "hf") == "hf"))
PY
}
pass() { echo "results/passes/$1/$2/000.parquet"; }
if python -c "import vllm" 2> /dev/null; then
    first="$(for c in $(configs all); do [[ $c == *-s1024 ]] || for p in exact replica refeed; do pass "$c" $p; done; done)"
    last="$(for c in $(configs all); do [[ $c != *-s1024 ]] || pass "$c" exact; done)"
else
    # the workflow refuses a configuration file naming an engine this interpreter lacks: the HF engine's alone
    echo "vLLM is not installed for this interpreter: the HF engine's configuration only"
    mkdir -p benchmarks/out
    python - "$cfg" "benchmarks/out/$name-hf.yaml" <<'PY'
import sys

import yaml

config = yaml.safe_load(open(sys.argv[1]))
config["configs"] = {name: c for name, c in config["configs"].items() if c.get("engine", "hf") == "hf"}
yaml.safe_dump(config, open(sys.argv[2], "w"), sort_keys=False)
PY
    first="$(for c in $(configs hf); do for p in exact replica refeed; do pass "$c" $p; done; done)" last=""
    cfg=benchmarks/out/$name-hf.yaml
fi
for targets in "$first" "$last"; do
    [ -n "$targets" ] || continue
    left=$((end - SECONDS - 30))
    [ "$left" -gt 60 ] || { echo "no time left for: $targets"; break; }
    TARGETS=$(echo $targets) bash benchmarks/h200-pipeline.sh "$cfg" "$left"
done
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python benchmarks/scale.py report "$WORK" --configfile "$cfg" \
    --out "$out/h200-$name.json" > "$out/h200-$name.md"
cat "$out/h200-$name.md"
tar -C "$WORK" -czf "$out/logs-$name.tgz" results/logs results/benchmarks
