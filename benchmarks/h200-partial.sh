#!/usr/bin/env bash
# A campaign cut short on a lent GPU machine, packed for reference/ before the lease ends: the partial reference
# folder (python -m replaynoise.reference partial: credit tables, pivots, logs, the comparison of the whole pairs
# of draws) with the replayed rows' verification, cache-hit and first-step-digest columns in rows/ (tokens and
# log-probs left out for size), the Snakemake log without progress bars, into OUT_DIR/partial.tgz:
#   bash benchmarks/h200-partial.sh WORK_DIR CAMPAIGN_FILE OUT_DIR [NOTE]
# WORK_DIR is the campaign's working directory (benchmarks/h200-campaign.sh: $WORK/<folder>-<name>).
set -euo pipefail
work=$1 campaign=$2 out=$3 note=${4:-the lease ended before every pass ran}
stage=$(mktemp -d)
python -m replaynoise.reference partial "$work/results" "$campaign" "$stage/reference" --note "$note"
python - "$work/results/passes" "$stage/reference/rows" <<'PY'
import pathlib, sys
import polars as pl
KEPT = ["pivot_id", "problem_id", "branch", "k", "seed", "batch_id", "prefix_source", "verified", "prefix_len",
        "answer", "correct", "finish_reason", "n_tokens", "next_digest", "cached_tokens", "expected_cached_tokens",
        "tail_tokens"]
for f in sorted(pathlib.Path(sys.argv[1]).glob("*/*.parquet")):
    rows = pl.read_parquet(f)
    dest = pathlib.Path(sys.argv[2]) / f.parent.name
    dest.mkdir(parents=True, exist_ok=True)
    rows.select([c for c in KEPT if c in rows.columns]).write_parquet(dest / f.name)
    print(f"{f.parent.name}/{f.name}: {rows.height} rows")
PY
tr '\r' '\n' < "$work/snakemake.log" | grep -v -E "Capturing|it/s\]|row/s" > "$stage/snakemake.log" || true
mkdir -p "$out"
tar -C "$stage" -czf "$out/partial.tgz" reference snakemake.log
rm -rf "$stage"
ls -la "$out/partial.tgz"
