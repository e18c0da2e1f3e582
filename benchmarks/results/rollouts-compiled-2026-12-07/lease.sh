#!/bin/bash
# The rollout lease of issue 56 (compile_rollouts), 2026-12-07. From the call's tree:
#   bash .gpu-stage/lease/lease.sh install     (the stage installed, the tree copied to /root/proj, the tokenizer)
#   bash /root/lease.sh run LIMIT              (in the background: benchmarks/rollouts-7b.sh, then the GPU tests)
#   bash /root/lease.sh status | pack
set -u
P=/root/proj W=/root/work/rollouts-7b R=/root/res
case $1 in
install)
    cp .gpu-stage/lease/lease.sh /root/lease.sh
    bash .gpu-stage/drv/stage.sh install > /root/install.log 2>&1; echo "install rc $?"; tail -n 3 /root/install.log
    rm -rf $P && mkdir -p $P && tar --exclude=./.gpu-stage -cf - . | tar -C $P -xf -
    ln -sfn /root/stage/files/resources $P/resources
    mkdir -p $W/shapes/qwen2.5-coder-0.5b-tokenizer && cp .gpu-stage/lease/tok/* $W/shapes/qwen2.5-coder-0.5b-tokenizer/
    export PYTHONPATH=/root/site:$P PATH=/root/site/bin:$PATH
    python -c "import vllm, torch, transformers, snakemake; print(vllm.__version__, torch.__version__, transformers.__version__, snakemake.__version__)" 2>&1 | tail -1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
    ;;
run)
    cd $P
    export PYTHONPATH=/root/site:$P PATH=/root/site/bin:$PATH PYTHONUNBUFFERED=1 WORK=$W COMMIT=$2
    echo "start $(date +%T)" >> /root/phases.log
    bash benchmarks/rollouts-7b.sh $R $3 > /root/run.log 2>&1
    echo "rollouts-7b end $(date +%T) rc $?" >> /root/phases.log
    python -m pytest -q -p no:cacheprovider -m gpu tests/test_engine_gpu.py tests/test_compile_rollouts.py > $R/gpu-tests.txt 2>&1
    echo "gpu tests end $(date +%T) rc $?" >> /root/phases.log
    ;;
status)
    cat /root/phases.log 2>/dev/null; tail -c 1500 /root/run.log 2>/dev/null; ls $R 2>/dev/null
    grep -h ": done,\|time by phase" $W/results/logs/generate_rollouts/*.log 2>/dev/null
    ;;
pack)
    cp $R/*.json $R/*.md $R/*.txt $R/*.tgz "$OUT"/ 2>/dev/null
    tar -czf "$OUT/lease-logs.tgz" -C /root phases.log run.log install.log -C $W snakemake.log 2>/dev/null
    ls -la "$OUT"
    ;;
esac
