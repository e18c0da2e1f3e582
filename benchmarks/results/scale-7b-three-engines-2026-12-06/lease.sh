#!/bin/bash
# The three-engine 7B-shape lease (issue 55 item 5): the sites of the four stages, then benchmarks/h200-scale.sh
# once per environment on one $WORK. Kept as it ran in benchmarks/results/<this lease>/lease.sh.
#   bash /root/lease.sh install            (from the call's tree, with the four stages' drv/ carried)
#   bash /root/lease.sh run ENGINES LIMIT   (in the background: setsid nohup ... &)
#   bash /root/lease.sh chain DEADLINE      (both, one after the other, until DEADLINE in epoch seconds)
#   bash /root/lease.sh pack               (the report, the logs and the environments into $OUT)
set -u
P=/root/proj W=/root/work/scale-7b R=/root/res
case $1 in
install)
    rm -f /root/install.rc
    for x in p v s x; do
        (bash .gpu-stage-$x/drv/stage.sh install > /root/install-$x.log 2>&1; echo "$x rc $?" >> /root/install.rc) &
    done
    wait
    cat /root/install.rc; tail -qn1 /root/install-?.log
    rm -rf $P && mkdir -p $P && tar --exclude='./.gpu-stage-*' --exclude=./.stage-tok -cf - . | tar -C $P -xf -
    ln -sfn /root/stage-p/files/resources $P/resources
    mkdir -p $W/shapes/qwen2.5-coder-0.5b-tokenizer && cp /root/tok/* $W/shapes/qwen2.5-coder-0.5b-tokenizer/
    # vLLM at its own defaults (q7b-vllm-s1024) held back: the lease's time goes to the three engines' own rows
    python3 - $P/benchmarks/configs/scale-7b.yaml <<'PY'
import sys, yaml
p = sys.argv[1]; c = yaml.safe_load(open(p)); c["configs"].pop("q7b-vllm-s1024"); yaml.safe_dump(c, open(p, "w"), sort_keys=False)
print(list(c["configs"]))
PY
    ;;
run)
    engines=$2 limit=$3
    cd $P
    if [ "$engines" = sglang ]; then
        export PYTHONPATH=/root/site-x:/root/site-s:/root/site-p:$P PATH=/root/site-s/bin:/root/site-p/bin:$PATH
    else
        export PYTHONPATH=/root/site-v:/root/site-p:$P PATH=/root/site-v/bin:/root/site-p/bin:$PATH
    fi
    export PYTHONUNBUFFERED=1 WORK=$W ENGINES="$engines"
    echo "start $(date +%T) $engines $limit" >> /root/phases.log
    bash benchmarks/h200-scale.sh $R "$limit" > "/root/phase-${engines// /-}.log" 2>&1
    echo "end $(date +%T) $engines rc $?" >> /root/phases.log
    ;;
chain)
    # HF and vLLM (vLLM's environment), then SGLang (its own), until DEADLINE (epoch seconds)
    deadline=$2
    left=$(( deadline - $(date +%s) - 420 )); bash /root/lease.sh run "hf vllm" $(( left < 950 ? left : 950 ))
    bash /root/lease.sh run sglang $(( deadline - $(date +%s) ))
    ;;
pack)
    cp $R/h200-scale-7b.json $R/h200-scale-7b.md $R/logs-scale-7b.tgz $W/environments.json "$OUT"/ 2>/dev/null
    tar -czf "$OUT/lease-logs.tgz" -C /root phases.log phase-*.log install-?.log -C $W snakemake.log 2>/dev/null
    ls -la "$OUT"
    ;;
esac
