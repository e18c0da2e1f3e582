#!/usr/bin/env bash
# A campaign cut short on a lent GPU machine, packed for reference/ before the lease ends: the partial reference
# folder (python -m replaynoise.reference partial: credit tables, pivots, logs, the replayed rows' verification,
# cache-hit and first-step-digest columns, the comparison of the whole pairs of draws) and the Snakemake log without
# progress bars, into one tarball:
#   bash benchmarks/h200-partial.sh WORK_DIR CAMPAIGN_FILE TARBALL [NOTE]
# Run it from the project's root. WORK_DIR is the campaign's working directory (benchmarks/h200-campaign.sh:
# $WORK/<folder>-<name>), which runs this itself when a run stopped before its end. Fails, leaving no tarball, where
# the run has no credit tables of exact and a whole pair of draws, or where CAMPAIGN_FILE is an overlay or holds
# several configurations (a partial folder keeps one; h200-campaign.sh then packs the logs instead).
set -euo pipefail
work=$1 campaign=$2 tarball=$3 note=${4:-the lease ended before every pass ran}
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
python -m replaynoise.reference partial "$work/results" "$campaign" "$stage/reference" --note "$note"
if [ -f "$work/snakemake.log" ]; then  # progress bars left out (grep fails only where no line is left)
    tr '\r' '\n' < "$work/snakemake.log" | grep -v -E "Capturing|it/s\]|row/s" > "$stage/snakemake.log" || true
else
    echo "no snakemake.log in $work" > "$stage/snakemake.log"
fi
mkdir -p "$(dirname "$tarball")"
tar -C "$stage" -czf "$stage/packed.tgz" reference snakemake.log
mv "$stage/packed.tgz" "$tarball"
ls -la "$tarball"
