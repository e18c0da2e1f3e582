#!/bin/bash
# The second call, as run (after coldwarm.sh in the same lease): one more process per case on the filled cache
# folders, then the import time of the kernels module.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; for rows in 512 1024; do for w in 2 4; do TORCHINDUCTOR_CACHE_DIR=/root/ic-$w-$rows TRITON_CACHE_DIR=/root/tc-$w-$rows timeout 40 python .stage-sgl/coldwarm.py $w $rows warm2 2>&1 | grep '^{' | tee -a $OUT/coldwarm-2.jsonl; done; done; TORCHINDUCTOR_CACHE_DIR=/root/ic-4-512 TRITON_CACHE_DIR=/root/tc-4-512 python -X importtime -c "import replaynoise.engines.hf.kernels" 2>&1 | sort -t'|' -k2 -n | tail -3
