#!/usr/bin/env bash
# The GPU check, run on a lent GPU machine (NVIDIA GPU, torch with CUDA, no network at all), from any directory:
#   bash scripts/gpu_check.sh
# It needs the kit that scripts/gpu_kit.sh makes beforehand on a machine with PyPI (.gpu-kit in the repository root,
# carried along with the working tree; GPU_KIT=DIR moves it). Everything it records goes to ${OUT:-./gpu-out}:
#   env.txt               date, nvidia-smi, Python / torch / CUDA / GPU facts
#   install.log           the kit installed offline into this machine's Python, and what then imports from where
#   pytest-gpu.log, .xml  the tests marked `gpu` (pytest -m gpu), JUnit XML beside the log
#   bench.log, gpu-bench/ hat-bench gpu's output (JSON and PNG); not run where torch sees no CUDA GPU
#   summary.txt           one line per step: name, exit status, seconds, note (tab-separated)
# Every step runs whatever happened in the ones before it (a failed install still lets the tests and the bench say
# why); the script exits 1 when any step failed, 0 when all passed. The whole run stays within GPU_CHECK_BUDGET_S
# (570 s: the lent machine allows 600 s a command): the tests get at most 300 s and hat-bench 240 s, less where the
# steps before them took longer.
# Environment: PYTHON (the interpreter; default the first of python3, python that imports torch), GPU_KIT, OUT,
# GPU_CHECK_BUDGET_S, GPU_CHECK_BENCH_ARGS (more arguments of hat-bench gpu, e.g. "--models qwen2.5-1.5b --steps 16").
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT" || { echo "gpu_check: cannot make the output directory $OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
KIT="${GPU_KIT:-$ROOT/.gpu-kit}"
[ -d "$KIT" ] && KIT=$(cd "$KIT" && pwd)
BUDGET_S="${GPU_CHECK_BUDGET_S:-570}"  # s, for all steps together
PYTEST_MAX_S=300                       # s, the gpu tests at most
BENCH_MAX_S=240                        # s, hat-bench gpu at most
BENCH_ARGS="${GPU_CHECK_BENCH_ARGS:-}"  # split on spaces, as written
BENCH_MIN_S=60                         # s kept for the bench when the tests' time is cut
START=$SECONDS
SUMMARY="$OUT/summary.txt"
printf '# step\trc\tseconds\tnote\n' >"$SUMMARY"
failed=0

left() { echo $((BUDGET_S - (SECONDS - START))); }
clamp() { # clamp VALUE LOW HIGH
  local v=$1
  [ "$v" -gt "$3" ] && v=$3
  [ "$v" -lt "$2" ] && v=$2
  echo "$v"
}
STEP=""  # the step running now (for the summary line of a check stopped by a signal), and when it began
T0=$SECONDS
begin() { STEP=$1; T0=$SECONDS; }  # begin NAME: a step starts
# record NAME RC SECONDS [NOTE]: one summary line; a non-zero status fails the check
record() {
  local note=${4:-}
  case "$2" in
    124 | 137) note="timed out${note:+; $note}" ;;
    127) note="command not found${note:+; $note}" ;;
  esac
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$note" >>"$SUMMARY"
  STEP=""
  echo "gpu_check: $1: rc $2 after $3 s${note:+ ($note)}"
  [ "$2" = 0 ] || failed=1
}

# limited SECONDS LOG CMD...: CMD under `timeout` (TERM at SECONDS, KILL 10 s later), its output into LOG. timeout
# leads its own process group, so what CMD started (test servers, bench workers) ends with it; and a TERM / INT / HUP
# sent to this script reaches that group too (the trap below), so nothing outlives the check.
CHILD=""
limited() {
  local s=$1 log=$2 rc
  shift 2
  timeout -k 10 "$s" "$@" >"$log" 2>&1 &
  CHILD=$!
  wait "$CHILD"
  rc=$?
  CHILD=""
  return "$rc"
}
# shellcheck disable=SC2317  # (called by the trap)
on_signal() {
  [ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null
  [ -n "$STEP" ] && printf '%s\t143\t%s\tstopped by a signal\n' "$STEP" $((SECONDS - T0)) >>"$SUMMARY"
  echo "gpu_check: stopped by a signal${STEP:+ during $STEP}" >&2
  exit 143
}
trap on_signal TERM INT HUP

# The interpreter: PYTHON when given, else the first python3 / python that imports torch (the machine's own, where
# torch with CUDA is installed), else the first there is, so the steps still report what is missing.
pick_python() {
  local c
  if [ -n "${PYTHON:-}" ]; then command -v "$PYTHON"; return; fi
  for c in python3 python; do
    command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" >/dev/null 2>&1 && { command -v "$c"; return; }
  done
  for c in python3 python; do command -v "$c" 2>/dev/null && return; done
  return 1
}
PY=$(pick_python) || PY=""
HAT_BENCH=""  # this Python's hat-bench console script, found by the install step

# No network there: the Hugging Face libraries fail at once instead of waiting on connections that cannot open.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# The GPU tests build a tiny random model with SmolLM2-135M's vocabulary from these files; the real packaged models
# are not there (no network, no model cache), so the tests that need them skip.
export HATSPEC_GPU_TOKENIZER="$KIT/tokenizer" HATSPEC_SKIP_REAL=1

# --- 1. env: what machine this is ---------------------------------------------------------------------------------
step_env() {
  local rc=0
  echo "== date -u"
  date -u
  echo "== host"
  uname -a
  echo "== working tree $ROOT"
  git -C "$ROOT" rev-parse HEAD 2>/dev/null && git -C "$ROOT" status --short 2>/dev/null | head -40 \
    || echo "(no git metadata: a copy of the working tree)"
  echo "== nvidia-smi"
  timeout 30 nvidia-smi || { rc=1; echo "(nvidia-smi failed or is missing)"; }
  echo "== nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv"
  timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.memory --format=csv || rc=1
  echo "== python"
  if [ -z "$PY" ]; then
    echo "no python3 or python on PATH"
    return 1
  fi
  timeout 120 "$PY" - <<'PYEOF' || rc=1
import platform
import sys

print("python", sys.executable, sys.version.replace("\n", " "))
print("glibc", "-".join(platform.libc_ver()))
for name in ("pip", "setuptools", "numpy", "transformers", "tokenizers", "onnx", "onnxruntime", "matplotlib"):
    try:
        print(name, getattr(__import__(name), "__version__", "?"))
    except Exception as exc:
        print(name, f"not importable ({type(exc).__name__}: {exc})")
try:
    import onnxruntime
    print("onnxruntime providers", onnxruntime.get_available_providers())
except Exception:
    pass
import torch

print("torch", torch.__version__)
print("torch.version.cuda", torch.version.cuda)
print("cudnn", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
print("torch.cuda.is_available()", torch.cuda.is_available())
if not torch.cuda.is_available():
    sys.exit("no usable CUDA GPU for torch")
print("cuda devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"device {i}: {torch.cuda.get_device_name(i)}, capability {p.major}.{p.minor}, "
          f"{p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
print("bf16 supported", torch.cuda.is_bf16_supported())
# One small bfloat16 matmul: the driver, the CUDA runtime and cuBLAS answer together.
x = torch.ones(1024, 1024, device="cuda", dtype=torch.bfloat16)
total = (x @ x).float().sum().item()  # every entry is 1024: 1024**3 in all
torch.cuda.synchronize()
print("bf16 matmul", "ok" if total == 1024 ** 3 else f"WRONG: {total} != {1024 ** 3}")
sys.exit(0 if total == 1024 ** 3 else 1)
PYEOF
  return $rc
}

# --- 2. install: the kit, offline, into this machine's Python --------------------------------------------------------
# hatspec runs from THIS working tree, so edits made here are what runs:
#   - where setuptools >= 64 is installed (PEP 660), an editable install (pip install -e, no build isolation: no
#     network to fetch build tools): `import hat_split` and the console scripts point at the tree;
#   - else the kit's wheel of hatspec, for the console scripts (hat-bench, ...) and the metadata only;
#   - and in every case the repository root first on PYTHONPATH, ahead of site-packages: whatever was installed, the
#     tree's code is what imports (for pytest, hat-bench and the processes they start), and the check proves it.
# pip: PIP_BREAK_SYSTEM_PACKAGES lets it install into a distribution's Python (PEP 668; the machine is lent and
# wiped); older pips ignore it. Requirements already satisfied (numpy, a newer pytest, ...) are left as they are.
# Without pip (and no ensurepip), the kit's wheels for this Python are unpacked into a directory on PYTHONPATH
# (what this Python lacks is then importable; console scripts there are none).
kit_wheel() { # the kit's wheel of hatspec, or nothing
  local w
  for w in "$KIT"/hatspec-*.whl; do [ -f "$w" ] && echo "$w" && return; done
}
step_install() {
  local rc=0 v reqs whl site=""
  if [ -z "$PY" ]; then
    echo "no python3 or python on PATH"
    return 1
  fi
  v=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || return 1
  echo "== python $PY ($v)"
  reqs="$KIT/py$v.txt"
  if [ ! -f "$KIT/MANIFEST.txt" ]; then
    echo "no kit at $KIT: run bash scripts/gpu_kit.sh on a machine with PyPI and carry .gpu-kit along"
    rc=1
  elif (cd "$KIT" && awk '{ print $3 "  " $1 }' MANIFEST.txt | sha256sum -c --quiet); then
    echo "kit: $(wc -l <"$KIT/MANIFEST.txt") files, all as MANIFEST.txt says"
  else
    echo "kit: files differ from MANIFEST.txt (above)"
    rc=1
  fi
  if [ -f "$KIT/MANIFEST.txt" ] && [ ! -f "$reqs" ]; then
    echo "the kit has no wheels for Python $v (gpu_kit.sh makes 3.10-3.13: GPU_KIT_PYTHONS)"
    rc=1
  fi
  export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore
  if ! "$PY" -m pip --version; then
    echo "== no pip: python -m ensurepip"
    timeout 120 "$PY" -m ensurepip --upgrade || timeout 120 "$PY" -m ensurepip --user || echo "ensurepip failed"
  fi
  if "$PY" -m pip --version >/dev/null 2>&1; then
    if [ -f "$reqs" ]; then
      echo "== pip install --no-index --find-links $KIT/wheels -r $reqs"
      timeout 180 "$PY" -m pip install --no-index --find-links "$KIT/wheels" -r "$reqs" || rc=1
    fi
    if "$PY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 64)' 2>/dev/null; then
      echo "== pip install --no-index --no-deps --no-build-isolation -e $ROOT"
      if timeout 180 "$PY" -m pip install --no-index --no-deps --no-build-isolation -e "$ROOT"; then
        whl=""
      else
        echo "(the editable install failed: the kit's wheel instead)"
        whl=$(kit_wheel)
      fi
    else
      echo "(no setuptools >= 64 here for an editable install: the kit's wheel, the code from PYTHONPATH)"
      whl=$(kit_wheel)
    fi
    if [ -n "$whl" ]; then
      echo "== pip install --no-index --no-deps --force-reinstall $whl"
      timeout 180 "$PY" -m pip install --no-index --no-deps --force-reinstall "$whl" || rc=1
    fi
    for whl in "$KIT"/data/*.whl; do  # GPU_KIT_DATA=1: the data hat-distill reads (pure Python, no dependencies)
      [ -f "$whl" ] || continue
      echo "== pip install --no-index --no-deps $whl"
      timeout 180 "$PY" -m pip install --no-index --no-deps "$whl" || rc=1
    done
  elif [ -f "$KIT/py$v.files" ]; then
    site="${TMPDIR:-/tmp}/hatspec-gpu-site-py$v"  # outside the kit, which stays as MANIFEST.txt lists it
    echo "== no pip: unpacking the kit's wheels for Python $v into $site (hat-bench then runs through python -m)"
    rm -rf "$site"
    "$PY" - "$KIT" "$v" "$site" <<'PYEOF' || rc=1
import sys
import zipfile

kit, version, site = sys.argv[1:4]
for name in open(f"{kit}/py{version}.files").read().split():
    zipfile.ZipFile(f"{kit}/wheels/{name}").extractall(site)
    print("unpacked", name)
PYEOF
  else
    rc=1
  fi
  export PYTHONPATH="$ROOT${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
  # Console scripts land in this Python's scripts directory, or in the user base's when site-packages is read-only;
  # a hat-bench anywhere else on PATH may belong to another Python and is not used.
  local d
  for d in "$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')" \
           "$("$PY" -c 'import site; print(site.USER_BASE)')/bin"; do
    if [ -x "$d/hat-bench" ]; then HAT_BENCH="$d/hat-bench"; break; fi
  done
  echo "== PYTHONPATH=$PYTHONPATH"
  echo "== what imports, from where"
  "$PY" - "$ROOT" <<'PYEOF' || rc=1
import importlib
import os
import sys

root = os.path.realpath(sys.argv[1])
bad = []
for name in ("zmq", "msgspec", "psutil", "yaml", "jinja2", "pytest", "hypothesis", "numpy",
             "hat_split.wire.messages", "edge_runtime", "cloud_runtime", "profiles.bench.bench"):
    try:
        mod = importlib.import_module(name)
        print(f"{name:24} {getattr(mod, '__version__', '')!s:10} {mod.__file__}")
        if name.split(".")[0] in ("hat_split", "edge_runtime", "cloud_runtime", "profiles") \
                and not os.path.realpath(mod.__file__).startswith(root + os.sep):
            bad.append(f"{name} imports from {mod.__file__}, not from the working tree {root}")
    except Exception as exc:
        bad.append(f"{name}: {type(exc).__name__}: {exc}")
try:
    import matplotlib
    print(f"{'matplotlib':24} {matplotlib.__version__:10} (hat-bench draws PNGs)")
except ImportError as exc:
    print(f"matplotlib not importable ({exc}): hat-bench writes its JSON without PNGs")
for line in bad:
    print("PROBLEM:", line)
sys.exit(1 if bad else 0)
PYEOF
  echo "== hat-bench: ${HAT_BENCH:-"no console script of this Python's (python -m profiles.bench.bench instead)"}"
  "$PY" -m pip list --format=freeze 2>/dev/null | sed 's/^/   /'
  return $rc
}

# --- run the steps ------------------------------------------------------------------------------------------------
begin env
step_env >"$OUT/env.txt" 2>&1
record env $? $((SECONDS - T0)) "${PY:-no python}"

begin install
step_install >"$OUT/install.log" 2>&1
record install $? $((SECONDS - T0))

# --- 3. the tests marked gpu --------------------------------------------------------------------------------------
# --continue-on-collection-errors: a test module that cannot be imported here (a dependency this machine lacks) is
# reported, and the gpu tests in the other modules still run; pytest's status is then non-zero all the same.
# Exit status 5 means no test was selected: nothing marked gpu ran, which fails the check too. The output goes to
# pytest-gpu.log as it runs (through `limited`, not a pipe into tee, so a stop reaches pytest's process group) and to
# stdout when it ends.
begin pytest-gpu
cap=$(clamp $(($(left) - BENCH_MIN_S)) 30 $PYTEST_MAX_S)
if [ -n "$PY" ]; then
  limited "$cap" "$OUT/pytest-gpu.log" "$PY" -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors \
    --junitxml "$OUT/pytest-gpu.xml" tests/
  rc=$?
else
  echo "no python" >"$OUT/pytest-gpu.log"
  rc=127
fi
cat "$OUT/pytest-gpu.log"
case $rc in
  5) note="no test selected: nothing marked gpu ran" ;;
  *) note="limit ${cap} s" ;;
esac
record pytest-gpu "$rc" $((SECONDS - T0)) "$note"

# --- 4. hat-bench gpu ---------------------------------------------------------------------------------------------
# Not run where torch sees no CUDA GPU (env.txt says why): this is the GPU check, and the bench's CPU fallback would
# spend the whole budget measuring the wrong thing. GPU_CHECK_BENCH_ON_CPU=1 runs it anyway (a dry run elsewhere).
begin bench
cap=$(clamp $(($(left) - 5)) 10 $BENCH_MAX_S)
if ! grep -q '^torch.cuda.is_available() True' "$OUT/env.txt" && [ "${GPU_CHECK_BENCH_ON_CPU:-0}" != 1 ]; then
  echo "not run: torch sees no CUDA GPU (env.txt)" >"$OUT/bench.log"
  rc=1
  note="not run: no CUDA GPU"
elif [ -n "$HAT_BENCH" ]; then
  # shellcheck disable=SC2086  # BENCH_ARGS: words
  limited "$cap" "$OUT/bench.log" "$HAT_BENCH" gpu --out "$OUT/gpu-bench" $BENCH_ARGS
  rc=$?
  note="limit ${cap} s"
elif [ -n "$PY" ]; then  # no console script (no pip there): the same entry point through the module
  limited "$cap" "$OUT/bench.log" "$PY" -m profiles.bench.bench gpu --out "$OUT/gpu-bench" $BENCH_ARGS
  rc=$?
  note="limit ${cap} s, python -m profiles.bench.bench"
else
  echo "no python" >"$OUT/bench.log"
  rc=127
  note=""
fi
record bench "$rc" $((SECONDS - T0)) "$note"
[ "$rc" = 0 ] || tail -n 15 "$OUT/bench.log" | sed 's/^/  bench.log: /'

echo "gpu_check: $((SECONDS - START)) s in all; $OUT/summary.txt:"
cat "$SUMMARY"
exit $failed
