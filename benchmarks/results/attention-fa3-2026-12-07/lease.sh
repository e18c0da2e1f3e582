#!/bin/bash
# The attention lease of issue 56 (static_attention: fa3), 2026-12-07. From the call's tree:
#   bash .gpu-stage/lease/lease.sh install COMMIT   (the stage installed; the tree copied to /root/proj with the
#                                                     commit's replaynoise/ over it; the tokenizer)
#   bash /root/lease.sh run COMMIT LIMIT             (in the background: GPU tests, step profiles, attention-7b)
#   bash /root/lease.sh status | pack
set -u
P=/root/proj W=/root/work/attention-7b R=/root/res
case $1 in
install)
    # as benchmarks/results/rollouts-compiled-2026-12-07/lease.sh's install, with the stage cut in 32 MiB parts
    # (.gpu-stage/s2: the tree, 28.5 MiB with reference/, travels beside each part) and the measured commit's
    # replaynoise/ (git archive HEAD replaynoise, head.tgz) extracted over the copied tree, which held uncommitted work
    ;;
run)
    cd $P
    export PYTHONPATH=/root/site:$P PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 WORK=$W COMMIT=$2
    t() { echo "$1 $(date +%T) rc $2" >> /root/phases.log; }
    t start 0
    python -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_gpu.py tests/test_flash_attention.py \
        tests/test_compile_rollouts.py > $R/gpu-tests.txt 2>&1; t gpu-tests $?
    for a in gemm fa3; do
        REPLAYNOISE_STATIC_ATTENTION=$a timeout 240 python benchmarks/profile_step.py --shape qwen2.5-7b \
            --rows 512 1024 --length 1024 --commit $2 --out $R/profile-step-7b-$a.json > $R/profile-step-7b-$a.txt 2>&1
        t profile-7b-$a $?
    done
    ENGINES=hf bash benchmarks/h200-scale.sh $R $3 benchmarks/configs/attention-7b.yaml > /root/run.log 2>&1
    t attention-7b $?
    for a in gemm fa3; do
        REPLAYNOISE_STATIC_ATTENTION=$a timeout 200 python benchmarks/profile_step.py --shape qwen2.5-1.5b \
            --commit $2 --out $R/profile-step-1.5b-$a.json > $R/profile-step-1.5b-$a.txt 2>&1
        t profile-1.5b-$a $?
    done
    ;;
status)
    cat /root/phases.log 2>/dev/null; tail -c 1200 /root/run.log 2>/dev/null; ls $R 2>/dev/null
    tail -n 3 $R/gpu-tests.txt 2>/dev/null
    grep -h ": done,\|time by phase" $W/results/logs/*/*.log $W/results/logs/*/*/*.log 2>/dev/null | tail -n 12
    ;;
pack)
    cd $R && tar -czf "$OUT/res.tgz" *.json *.md *.txt 2>/dev/null; cp logs-*.tgz "$OUT"/ 2>/dev/null
    tar -czf "$OUT/lease-logs.tgz" -C /root phases.log run.log install.log -C $W snakemake.log 2>/dev/null
    ls -la "$OUT"
    ;;
esac
