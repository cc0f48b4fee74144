#!/usr/bin/env bash
# llama.cpp for hatspec, built from source for THIS machine's CPU.
#   bash scripts/install_llamacpp.sh           llama-cpp-python (the llamacpp engine of hat-edge / hat-cloud, and
#                                              hat-cloud rpc-server), with the RPC backend compiled in
#   bash scripts/install_llamacpp.sh --tools   also llama.cpp's own programs from the same source (llama-bench,
#                                              llama-speculative, ggml-rpc-server): the references of hat-bench engines;
#                                              prints the folder that holds them
# Machines of this kind differ (Intel with AVX-512 and AMX, AMD with AVX2 only): the SIMD flags are read from
# /proc/cpuinfo at install time, never hard-coded, and never AMX (advertised but not usable here; the default native
# build crashed). Set CMAKE_ARGS yourself for another build (CUDA on a Jetson or a GPU server: docs/ENGINES.md).
# What is built is kept under ~/.cache/hatspec/wheels/llama-cpp-<hash of the flags> (and llama.cpp-<hash>/bin for
# the tools), so a second run installs in seconds and a build for another CPU is never reused (pip's own wheel cache
# does not key on CMAKE_ARGS).
# The bootstrap runs it; hatspec runs without it (the torch engine) and says so when llamacpp is asked for.
set -euo pipefail
PY="${PYTHON:-python3}"
SPEC="llama-cpp-python>=0.3,<0.4"
tools=0
[ "${1:-}" = "--tools" ] && tools=1
if [ -z "${CMAKE_ARGS:-}" ]; then
  flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
  has() { [[ " $flags " == *" $1 "* ]]; }
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_RPC=ON"
  has avx && CMAKE_ARGS+=" -DGGML_AVX=ON"
  has avx2 && CMAKE_ARGS+=" -DGGML_AVX2=ON"
  has fma && CMAKE_ARGS+=" -DGGML_FMA=ON"
  has f16c && CMAKE_ARGS+=" -DGGML_F16C=ON"
  has avx512f && CMAKE_ARGS+=" -DGGML_AVX512=ON"
fi
export CMAKE_ARGS
key="$(printf '%s' "$CMAKE_ARGS" | sha256sum | cut -c1-12)"
cache="${HATSPEC_CACHE:-$HOME/.cache/hatspec}"
wheels="$cache/wheels/llama-cpp-$key"

# An installed llama-cpp-python with the RPC backend is kept (a user's own CUDA build included).
if ! "$PY" -c "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_rpc() else 1)" 2>/dev/null; then
  if ! ls "$wheels"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "install_llamacpp: building llama-cpp-python from source ($CMAKE_ARGS); a few minutes on 2 cores" >&2
    mkdir -p "$wheels"
    "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-cache-dir -w "$wheels" "$SPEC"
  fi
  "$PY" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheels"/llama_cpp_python-*.whl
fi
# its own dependencies (the wheel went in without them, so that numpy is never reinstalled): a machine without
# diskcache could not import llama_cpp, and every llama.cpp path skipped
"$PY" -c "import diskcache, jinja2, typing_extensions" 2>/dev/null \
  || "$PY" -m pip install --quiet --disable-pip-version-check "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0"
[ "$tools" = 1 ] || exit 0

# llama.cpp's own programs, from the source tree vendored in the very llama-cpp-python release installed above.
bin="$cache/llama.cpp-$key/bin"
if [ ! -x "$bin/llama-speculative" ] || [ ! -x "$bin/llama-bench" ] || [ ! -x "$bin/ggml-rpc-server" ]; then
  version="$("$PY" -c "import llama_cpp; print(llama_cpp.__version__)")"
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  echo "install_llamacpp: building llama-bench, llama-speculative, ggml-rpc-server from llama-cpp-python $version's" \
       "llama.cpp ($CMAKE_ARGS); several minutes on 2 cores" >&2
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: -d "$work" \
    "llama-cpp-python==$version"
  tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
  # shellcheck disable=SC2086  # CMAKE_ARGS is a list of flags
  cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF $CMAKE_ARGS >/dev/null
  cmake --build "$work/build" -j "$(nproc)" --target llama-bench llama-speculative ggml-rpc-server >/dev/null
  mkdir -p "$bin"
  cp "$work/build/bin/llama-bench" "$work/build/bin/llama-speculative" "$work/build/bin/ggml-rpc-server" "$bin/"
fi
echo "$bin"
