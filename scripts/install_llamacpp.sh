#!/usr/bin/env bash
# llama-cpp-python, the reference hat-bench edge measures against, built from source with flags that work on this
# kind of VM (its default native build crashes here: AMX is advertised but not usable; ../shared/OFFLINE.md).
# pip caches the built wheel, so a second run installs in seconds. Nothing else in hatspec needs it.
set -euo pipefail
PY="${PYTHON:-python3}"
if "$PY" -c "import llama_cpp" 2>/dev/null; then
  exit 0
fi
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON}"
"$PY" -m pip install --quiet --disable-pip-version-check "llama-cpp-python>=0.3,<0.4"
