#!/usr/bin/env bash
# llama-cpp-python (the device's `--backend llamacpp` engine, hat-bench edge's reference), built from source for THIS
# machine's CPU.
# Machines of this kind differ (Intel with AVX-512 and AMX, AMD with AVX2 only): the SIMD flags are read from
# /proc/cpuinfo at install time, never hard-coded, and never AMX (advertised but not usable here; the default native
# build crashed). The built wheel is kept under ~/.cache/hatspec/wheels/<flags>, so a second run installs in seconds
# and a wheel built for another CPU is never reused (pip's own wheel cache does not key on CMAKE_ARGS).
# The bootstrap runs it; hatspec runs without it (the torch engine) and says so when llamacpp is asked for.
set -euo pipefail
PY="${PYTHON:-python3}"
if "$PY" -c "import llama_cpp" 2>/dev/null; then
  exit 0
fi
if [ -z "${CMAKE_ARGS:-}" ]; then
  flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
  has() { [[ " $flags " == *" $1 "* ]]; }
  CMAKE_ARGS="-DGGML_NATIVE=OFF"
  has avx && CMAKE_ARGS+=" -DGGML_AVX=ON"
  has avx2 && CMAKE_ARGS+=" -DGGML_AVX2=ON"
  has fma && CMAKE_ARGS+=" -DGGML_FMA=ON"
  has f16c && CMAKE_ARGS+=" -DGGML_F16C=ON"
  has avx512f && CMAKE_ARGS+=" -DGGML_AVX512=ON"
fi
export CMAKE_ARGS
key="$(printf '%s' "$CMAKE_ARGS" | sha256sum | cut -c1-12)"
wheels="${HATSPEC_CACHE:-$HOME/.cache/hatspec}/wheels/llama-cpp-$key"
if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "install_llamacpp: building llama-cpp-python from source ($CMAKE_ARGS); a few minutes on 2 cores" >&2
  mkdir -p "$wheels"
  "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-cache-dir -w "$wheels" \
    "llama-cpp-python>=0.3,<0.4"
fi
"$PY" -m pip install --quiet --disable-pip-version-check "$wheels"/llama_cpp_python-*.whl
