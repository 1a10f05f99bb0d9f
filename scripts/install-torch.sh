#!/usr/bin/env bash
# Install torch==$TORCH_VERSION (default 2.13.0) into PYTHON's environment, never pulling CUDA wheels on a machine
# without an NVIDIA GPU; the arguments after PYTHON (say `-e .`) are installed by the same pip command, so that pip
# resolves and installs everything once (usage: install-torch.sh PYTHON [PIP ARGS...]).
#
# pip is asked first, in a dry run, which file it would take. A CPU build (a "+cpu" wheel, for example one that lies
# on local disk, or any build on macOS) is installed as is. Otherwise, on a machine with no GPU, torch comes from
# PyTorch's CPU index instead of PyPI's default CUDA build. With a GPU, PyPI's default (CUDA) build is installed.
set -euo pipefail
PYTHON=${1:-python3}
EXTRA=("${@:2}")
VERSION=${TORCH_VERSION:-2.13.0}
SPEC="torch==${VERSION}"
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

if "$PYTHON" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '${VERSION}')" 2>/dev/null; then
  echo "install-torch: torch ${VERSION} is already installed"
  if [ ${#EXTRA[@]} -gt 0 ]; then "$PYTHON" -m pip install --quiet "${EXTRA[@]}"; fi
  exit 0
fi

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi

url=$("$PYTHON" -m pip install --dry-run --ignore-installed --no-deps --quiet --report - "$SPEC" \
  | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["download_info"]["url"])')

if [ "$has_gpu" = 1 ] || [ "$(uname -s)" = Darwin ] || [[ "$url" == *"%2Bcpu"* || "$url" == *"+cpu"* ]]; then
  echo "install-torch: ${SPEC} from ${url%%\?*}"
  "$PYTHON" -m pip install --quiet "$SPEC" "${EXTRA[@]}"
else
  echo "install-torch: no GPU here; ${SPEC} from the CPU index ${CPU_INDEX} instead of a CUDA build"
  "$PYTHON" -m pip install --quiet "$SPEC" "${EXTRA[@]}" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
fi
