#!/bin/bash
# issue 56: the compiled sampler's threshold search at 16 ways (kernels.SAMPLER_WAYS, the tree's form) against the
# bisection (2 ways, the form before), in one lease. step: the refilled step at the 1.5B shape with each form
# (benchmarks/profile_step.py; the bisection by setting SAMPLER_WAYS = 2 in its own process). alone: the sampler
# alone at 2, 4, 8 and 16 ways (benchmarks/sampler.py, tokens against the eager sort), then the HF GPU tests.
set -u
C=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $OUT/gpu.txt
[ -d /root/pol/polars ] || python -m pip install -q --no-index --no-deps --no-compile --target /root/pol .stage-pol/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/root/pol PYTHONUNBUFFERED=1
case $2 in
step)
    echo "== profile_step gemm, 4-ary search (SAMPLER_WAYS) $(date +%T)" | tee -a $OUT/run.log
    timeout 150 python benchmarks/profile_step.py --commit $C --out $OUT/step-search4.json 2>&1 | grep -v -i warn | tee -a $OUT/run.log
    echo "== profile_step gemm, bisection (SAMPLER_WAYS = 2) $(date +%T)" | tee -a $OUT/run.log
    timeout 150 python -c "
import runpy, sys
import replaynoise.engines.hf.kernels as k
k.SAMPLER_WAYS = 2
sys.argv = ['profile_step.py', '--commit', '$C', '--out', '$OUT/step-bisection.json']
runpy.run_path('benchmarks/profile_step.py', run_name='__main__')
" 2>&1 | grep -v -i warn | tee -a $OUT/run.log
    echo "== gpu tests $(date +%T)" | tee -a $OUT/run.log
    timeout 150 python -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider 2>&1 | tail -4 | tee -a $OUT/run.log
    ;;
alone)
    echo "== sampler $(date +%T)" | tee -a $OUT/run.log
    timeout 260 python benchmarks/sampler.py --rows 256 512 1024 --ways 2 4 8 16 --commit $C --out $OUT/sampler.json 2>&1 | grep -v -i warn | cut -c1-900 | tee -a $OUT/run.log
    echo "== gpu tests $(date +%T)" | tee -a $OUT/run.log
    timeout 150 python -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider 2>&1 | tail -4 | tee -a $OUT/run.log
    ;;
esac
echo "end $(date +%T)" | tee -a $OUT/run.log
