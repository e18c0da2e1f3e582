#!/usr/bin/env bash
# Install replaynoise into ./.venv with the pinned dependency set (requirements.txt).
# torch 2.13.0 is the CPU build where pip finds it locally; elsewhere pip fetches the matching wheel.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -r requirements.txt
.venv/bin/python -m pip install --quiet --no-deps -e .
echo "replaynoise installed in $(pwd)/.venv"
