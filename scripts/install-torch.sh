#!/usr/bin/env bash
# Install torch==$TORCH_VERSION (default 2.13.0) into PYTHON's environment, never pulling CUDA wheels on a machine
# without an NVIDIA GPU; the arguments after PYTHON (say `-e .`) are installed by the same command, so that
# everything is resolved and installed once (usage: install-torch.sh PYTHON [PIP ARGS...]).
#
# pip is asked first, in a dry run, which file it would take (pip reads pip.conf: a local wheel, a private index).
# A CPU build (a "+cpu" wheel, for example one that lies on local disk, or any build on macOS) is installed as is.
# Otherwise, on a machine with no GPU, torch comes from PyPI's CPU index instead of PyPI's default CUDA build.
# With a GPU, PyPI's default (CUDA) build is installed.
#
# The installing is done by uv (installed into the environment first, a few MB) when it can be: it resolves in a
# second and unpacks the wheels in parallel, where pip resolves the ~80 packages for ~18 s and unpacks them one after
# the other (a fresh `make train` took 60-85 s with pip, about 35 s with uv, on 2 cores). uv reads no pip.conf, so it
# gets torch as the file pip chose, and the rest from PyPI (or $UV_INDEX_URL). Where uv cannot be installed or
# fails (no route to PyPI, say), pip does it all as before; ATTNLAB_INSTALLER=pip asks for pip.
#
# Both byte-compile what they install (uv on every core), as pip does by default: where PYTHONDONTWRITEBYTECODE is
# set, Python never writes the bytecode of what it imports, and without it every process compiled torch, Lightning
# and the rest from source again (12 s of imports against 4.5 s; the test suite's hundreds of processes took 14
# minutes instead of 9).
set -euo pipefail
PYTHON=${1:-python3}
EXTRA=("${@:2}")
VERSION=${TORCH_VERSION:-2.13.0}
SPEC="torch==${VERSION}"
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

# install ARGS...: with uv when it can, else with pip (the same arguments: requirements, -e ., --index-url ...)
install() {
  if [ "${ATTNLAB_INSTALLER:-uv}" != pip ] && "$PYTHON" -m pip install --quiet uv >/dev/null 2>&1; then
    if "$PYTHON" -m uv pip install --python "$PYTHON" --quiet --no-progress --compile-bytecode "$@"; then
      return 0
    fi
    echo "install-torch: uv could not install it; pip instead"
  fi
  "$PYTHON" -m pip install --quiet --compile "$@"
}

if "$PYTHON" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '${VERSION}')" 2>/dev/null; then
  echo "install-torch: torch ${VERSION} is already installed"
  if [ ${#EXTRA[@]} -gt 0 ]; then install "${EXTRA[@]}"; fi
  exit 0
fi

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_gpu=1; fi

url=$("$PYTHON" -m pip install --dry-run --ignore-installed --no-deps --quiet --report - "$SPEC" \
  | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["download_info"]["url"])')

if [[ "$url" == *"%2Bcpu"* || "$url" == *"+cpu"* ]]; then
  echo "install-torch: ${SPEC} from ${url%%\?*}"
  install "torch @ ${url}" "${EXTRA[@]}"
elif [ "$has_gpu" = 1 ] || [ "$(uname -s)" = Darwin ]; then
  echo "install-torch: ${SPEC} from ${url%%\?*}"
  install "$SPEC" "${EXTRA[@]}"
else
  echo "install-torch: no GPU here; ${SPEC} from the CPU index ${CPU_INDEX} instead of a CUDA build"
  # (the CPU index as the extra one: pip takes the highest version of both, 2.13.0+cpu; uv asks an extra index first)
  install "$SPEC" "${EXTRA[@]}" --extra-index-url "$CPU_INDEX"
fi
