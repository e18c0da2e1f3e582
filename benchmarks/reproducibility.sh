#!/usr/bin/env bash
# Two clean runs of the workflow in scratch directories, then a byte comparison of their manifests.
#
#   bash benchmarks/reproducibility.sh [SCRATCH_DIR] [extra snakemake arguments...]
#
# Without arguments: the embedded default config, in a fresh temporary directory. Both runs share the package
# cache (resources/packages), so nothing is downloaded twice. Prints the wall time of each run and either
# "identical: N files" (exit 0) or the differing lines (exit 1).
set -euo pipefail
scratch=$(realpath -m "${1:-$(mktemp -d)}")  # as the caller named it, before the cd
cd "$(dirname "$0")/.."
shift || true
mkdir -p resources/packages
for run in a b; do
  mkdir -p "$scratch/$run/resources"
  ln -sfn "$PWD/resources/packages" "$scratch/$run/resources/packages"
  start=$(date +%s)
  .venv/bin/snakemake --cores all --directory "$scratch/$run" --quiet rules "$@"
  echo "run $run: $(( $(date +%s) - start )) s in $scratch/$run"
done
if diff "$scratch/a/results/MANIFEST.sha256" "$scratch/b/results/MANIFEST.sha256"; then
  echo "identical: $(wc -l < "$scratch/a/results/MANIFEST.sha256") files"
else
  echo "the two runs differ (lines above)" >&2
  exit 1
fi
