#!/bin/bash
# issue 55 + 56, the install call: x's part, the three stages' install, the 1.5B campaign launched in the background
# (lease.sh run LIMIT), then the k-ary nucleus probe (issue 56) in the campaign's CPU-only first steps; it records
# the other GPU processes before and after each row.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
bash .gpu-stage-x/drv/stage.sh put p01
bash .stage-sgl/lease.sh install
mkdir -p /root/sgl-out
cp .stage-sgl/kary2.py /root/kary2.py
setsid nohup bash /root/lease.sh run $1 > /root/launch.log 2>&1 < /dev/null &
sleep 1
cd /root/proj
echo "kary start $(date +%T)" >> /root/phases.log
PYTHONPATH=/root/site-p:/root/proj PYTHONUNBUFFERED=1 timeout ${2:-110} python /root/kary2.py /root/sgl-out/kary.json > /root/sgl-out/kary.log 2>&1
echo "kary end $(date +%T) rc $?" >> /root/phases.log
cp /root/sgl-out/kary.* $OUT/ 2>/dev/null
grep -v -i warn /root/sgl-out/kary.log | tail -8 | cut -c1-600
bash /root/lease.sh status
