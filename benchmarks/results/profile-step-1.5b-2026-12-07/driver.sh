#!/bin/bash
# issue 56: the compiled sampler with inductor's split_reductions off (SAMPLER_INDUCTOR, the tree's form) against
# inductor's default, in one lease: the sampler alone (benchmarks/sampler.py, tokens against the eager sort), the HF
# engine's GPU tests (the compiled sampler's tokens among them), the refilled step at the 1.5B shape with each form.
set -u
C=$1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python -m pip install -q --no-index --no-deps --no-compile --target /root/pol .stage-pol/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/root/pol PYTHONUNBUFFERED=1
echo "== sampler $(date +%T)" | tee -a $OUT/run.log
timeout 120 python benchmarks/sampler.py --rows 256 512 1024 --commit $C --out $OUT/sampler.json 2>&1 | grep -v -i warn | tee -a $OUT/run.log
echo "== gpu tests $(date +%T)" | tee -a $OUT/run.log
timeout 130 python -m pytest -q -m gpu tests/test_engine_gpu.py -p no:cacheprovider 2>&1 | tail -4 | tee -a $OUT/run.log
echo "== profile_step gemm, sampler unsplit (SAMPLER_INDUCTOR) $(date +%T)" | tee -a $OUT/run.log
timeout 100 python benchmarks/profile_step.py --commit $C --out $OUT/step-unsplit.json 2>&1 | grep -v -i warn | tee -a $OUT/run.log
echo "== profile_step gemm, inductor's default (split) $(date +%T)" | tee -a $OUT/run.log
timeout 100 python -c "
import runpy, sys
import replaynoise.engines.hf.kernels as k
k.SAMPLER_INDUCTOR.clear()
sys.argv = ['profile_step.py', '--commit', '$C', '--out', '$OUT/step-split.json']
runpy.run_path('benchmarks/profile_step.py', run_name='__main__')
" 2>&1 | grep -v -i warn | tee -a $OUT/run.log
echo "end $(date +%T)" | tee -a $OUT/run.log
