#!/bin/bash
# four 64-row batches a job: q7b-hf-cw (compiled, caches filled), q7b-hf (eager), q7b-vllm, one at a time
P=/root/proj W=/root/work/rollouts-7b-4 R=/root/res4
cd $P && cp /root/four.yaml benchmarks/configs/rollouts-7b-4batches.yaml
export PYTHONPATH=/root/site:$P PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 WORK=$W
export TORCHINDUCTOR_CACHE_DIR=/root/work/rollouts-7b/inductor-cache TRITON_CACHE_DIR=/root/work/rollouts-7b/triton-cache
mkdir -p $W $R && ln -sfn /root/work/rollouts-7b/shapes $W/shapes && ln -sfn $P/resources $W/resources
echo "four start $(date +%T)" >> /root/phases.log
for c in q7b-hf-cw q7b-hf q7b-vllm; do
    TARGETS=results/rollouts/$c/shards/000.parquet bash benchmarks/h200-pipeline.sh benchmarks/configs/rollouts-7b-4batches.yaml 300 >> /root/four.log 2>&1
done
echo "four end $(date +%T)" >> /root/phases.log
python benchmarks/scale.py report $W --configfile benchmarks/configs/rollouts-7b-4batches.yaml --commit 5927ab8 --out $R/h200-rollouts-7b-4batches.json > $R/h200-rollouts-7b-4batches.md 2>&1
tar -C $W -czf $R/logs-rollouts-7b-4batches.tgz results/logs results/benchmarks
