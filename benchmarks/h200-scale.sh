#!/usr/bin/env bash
# The 7B-scale measurement on a GPU machine: random-weight 7B-shape models made on the GPU, then the workflow's own
# rules on benchmarks/configs/scale-7b.yaml, the HF engine and stock vLLM at the paper's settings first, vLLM at
# its own H200 defaults (exact pass) last, one job on the GPU at a time; then the per-rule report. Run it from the
# project's root with snakemake and the packages on the path: each call runs the configurations of the engines its
# environment has (HF always; vLLM, SGLang) or ENGINES names, so a second call from SGLang's environment on the same
# $WORK (ENGINES=sglang) adds SGLang's rows to the report. On a machine without network, copy the wheels there
# first; set $WORK to a folder that outlives the session, with resources/ (the pinned wheels) linked into it:
#   bash benchmarks/h200-scale.sh OUT_DIR [TIMEOUT_S] [CONFIG]
# CONFIG is benchmarks/configs/scale-7b.yaml unless named (benchmarks/configs/real-1.5b.yaml: the real 1.5B, the same
# design). Interrupted by TIMEOUT_S, a second call resumes (the models are kept, Snakemake keeps finished jobs, the
# passes keep finished batches). Writes OUT_DIR/h200-<config>.{json,md} and OUT_DIR/logs-<config>.tgz. COMMIT names
# the commit measured in the report where the tree's git metadata is not its files' (a lent machine's copy).
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
# The engines of this call: ENGINES (e.g. "sglang"), else every engine this interpreter has (HF always; vLLM,
# SGLang where installed). The workflow refuses a configuration file naming an engine its interpreter lacks, and vLLM
# and SGLang cannot share one environment, so each call runs the file's configurations of its engines, and a second
# call from the other environment on the same $WORK (ENGINES=sglang, so that HF's jobs all run in the first call's
# environment) adds the rest; Snakemake keeps what the first finished, and the report covers whatever ran.
installed() { [ "$1" = hf ] || python -c "import $1" 2> /dev/null; }
engines=hf
for engine in vllm sglang; do installed $engine && engines="$engines $engine"; done
engines=${ENGINES:-$engines}
for engine in $engines; do installed "$engine" || { echo "ENGINES: $engine is not installed here"; exit 2; }; done
echo "engines of this call: $engines"
# each call's engines and package versions, for the report
python - "$WORK/environments.json" $engines <<'PY' || exit 1
import importlib.metadata
import json
import pathlib
import sys


def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


path = pathlib.Path(sys.argv[1])
calls = [c for c in json.loads(path.read_text()) if c["engines"] != sys.argv[2:]] if path.is_file() else []
calls.append({"engines": sys.argv[2:], "packages": {n: version(n) for n in ("torch", "transformers", "vllm", "sglang")}})
path.write_text(json.dumps(calls, indent=1) + "\n")
PY
mkdir -p benchmarks/out && here=benchmarks/out/$name-${engines// /-}.yaml
python - "$cfg" "$here" $engines <<'PY' || exit 1
import sys

import yaml

config = yaml.safe_load(open(sys.argv[1]))
config["configs"] = {n: c for n, c in config["configs"].items() if c.get("engine", "hf") in sys.argv[3:]}
yaml.safe_dump(config, open(sys.argv[2], "w"), sort_keys=False)
PY
configs() { python -c 'import sys, yaml; print(" ".join(yaml.safe_load(open(sys.argv[1]))["configs"]))' "$here"; }
pass() { echo "results/passes/$1/$2/000.parquet"; }
# *-s1024 (vLLM at its own defaults) runs its exact pass last, the others all passes
first="$(for c in $(configs); do [[ $c == *-s1024 ]] || for p in exact replica refeed; do pass "$c" $p; done; done)"
last="$(for c in $(configs); do [[ $c != *-s1024 ]] || pass "$c" exact; done)"
for targets in "$first" "$last"; do
    [ -n "$targets" ] || continue
    left=$((end - SECONDS - 30))
    [ "$left" -gt 60 ] || { echo "no time left for: $targets"; break; }
    TARGETS=$(echo $targets) bash benchmarks/h200-pipeline.sh "$here" "$left"
done
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python benchmarks/scale.py report "$WORK" --configfile "$cfg" ${COMMIT:+--commit "$COMMIT"} \
    --out "$out/h200-$name.json" > "$out/h200-$name.md"
cat "$out/h200-$name.md"
tar -C "$WORK" -czf "$out/logs-$name.tgz" results/logs results/benchmarks
