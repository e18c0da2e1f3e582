#!/bin/bash
# issue 56: coldwarm.py for 2 and 4 ways at 512 and 1,024 rows, each cold (fresh cache folders) then warm.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
for rows in 512 1024; do
  for w in 2 4; do
    export TORCHINDUCTOR_CACHE_DIR=/root/ic-$w-$rows TRITON_CACHE_DIR=/root/tc-$w-$rows
    rm -rf $TORCHINDUCTOR_CACHE_DIR $TRITON_CACHE_DIR
    for c in cold warm; do
      timeout 90 python .stage-sgl/coldwarm.py $w $rows $c 2>&1 | grep '^{' | tee -a $OUT/coldwarm.jsonl
    done
  done
done
cp .stage-sgl/coldwarm.py .stage-sgl/coldwarm.sh $OUT/
