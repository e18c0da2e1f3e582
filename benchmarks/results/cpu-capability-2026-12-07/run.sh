#!/bin/bash
# three embedded-default runs, one per ATEN_CPU_CAPABILITY, one at a time
for cap in default avx2 avx512; do
  d=/tmp/cap77/$cap
  rm -rf $d
  git clone -q /work/wt-b $d
  ln -s /work/main/resources $d/resources
  ln -s /work/main/.venv $d/.venv
  cd $d
  echo "start $cap $(date -u +%FT%TZ) $(git rev-parse --short HEAD)" >> /tmp/cap77/log
  s=$(date +%s)
  ATEN_CPU_CAPABILITY=$cap PYTHONPATH=$d .venv/bin/snakemake --cores all > /tmp/cap77/$cap.out 2>&1
  rc=$?
  e=$(date +%s)
  echo "end $cap rc=$rc wall=$((e-s))s $(date -u +%FT%TZ)" >> /tmp/cap77/log
done
