"""Load a model for hatspec: a registry name, a local Hugging Face directory, or a .gguf file; with a fast cache.

Loading a GGUF file with transformers is slow: it parses the GGUF metadata in Python (10-40 s for Qwen's 151k-token
vocabulary, once per parse) and dequantises every tensor. Measured on the 2-core machine, idle: Qwen2.5-Coder-0.5B 52 s,
1.5B 79 s, SmolLM2-135M 21 s (2-3x that while other jobs use the CPU). So the first load of a GGUF converts it once:
the dequantised float32 model and its tokenizer are saved (`save_pretrained`, safetensors) into
``cache_dir()/hf/<name>/``, and every later load reads that directory: 2.0 s / 2.6 s / 0.25 s for the same models
(safetensors are memory-mapped, so pages come in on first use and are shared between processes), bit-identical logits.

The cache dir is written under a temporary name and renamed when complete; its ``hatspec.json`` records the source
file's size and mtime, so a changed GGUF invalidates it (rules in `hat_split.models.registry.cache_is_valid`).

Facts about the packaged GGUFs that loading preserves rather than "fixes":
- The Qwen GGUFs store `output.weight` (Q8_0) apart from `token_embd.weight` (Q5_0), so the loaded model has an
  untied LM head (tie_word_embeddings=False, max |diff| 0.008 / 0.013 from the embeddings), unlike upstream Qwen.
- The Qwen GGUF tokenizer has 151936 entries (151665 real + [PAD151665]..[PAD151935]) = the LM head size; eos is
  <|im_end|> 151645, bos = pad = <|endoftext|> 151643 (not prepended when encoding).

torch and transformers are imported inside the functions: `vocab_fingerprint` and `check_pair` work on anything with a
tokenizer-like interface, and importing this module needs neither.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List

from hat_split.models.registry import (
    HF_META,
    MODEL_DTYPES,
    MODELS,
    WEIGHT_QUANTS,
    ModelSpec,
    cache_is_valid,
    get_model_spec,
    gguf_cache_path,
    gguf_path,
    hf_cache_path,
    is_installed,
    part_paths,
    source_signature,
)

CACHE_FORMAT = 1  # bump when the layout of a converted cache dir changes; older dirs are then re-converted
FINGERPRINT_VERSION = 1  # part of the fingerprint's hashed payload; bump if the recipe changes


@dataclass
class LoadedModel:
    """A model ready for inference, with where it came from."""

    model: Any  # transformers PreTrainedModel in eval mode on the requested device; None if tokenizer_only
    tokenizer: Any  # transformers (fast) tokenizer
    spec: ModelSpec | None  # registry entry; None for a local directory or .gguf path
    source: str  # what was actually read: the HF dir (the cache or the user's) or the .gguf file
    load_seconds: float  # wall time to get model + tokenizer into memory (excludes writing the cache)
    from_cache: bool  # True if read from the converted cache under cache_dir()/hf/
    name: str = ""  # registry name, or the path's stem; used in messages and handshakes
    save_seconds: float = 0.0  # time spent writing the converted cache (first GGUF load only; 0 otherwise)

    @property
    def n_logits(self) -> int | None:
        """Rows of the LM head (size of the logits' last dim); from the spec if only the tokenizer was loaded."""
        if self.model is not None:
            return int(self.model.get_output_embeddings().weight.shape[0])
        return self.spec.vocab_size if self.spec is not None else None


# ------------------------------------------------------------------------------------------------------ resolving


@dataclass(frozen=True)
class _Resolved:
    name: str  # registry name or path stem
    spec: ModelSpec | None
    hf_dir: Path | None  # a user's HF directory (loaded directly, never cached)
    gguf: Path | None  # the GGUF source (None until assembled for a registry name; see _gguf_for)
    cache: Path | None  # converted cache dir for a GGUF source


def _resolve(name_or_path: str | os.PathLike[str]) -> _Resolved:
    text = os.fspath(name_or_path)
    if text in MODELS:
        return _Resolved(text, get_model_spec(text), None, None, hf_cache_path(text))
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory without config.json: not a Hugging Face checkpoint")
        return _Resolved(path.name, None, path, None, None)
    if path.is_file() and path.suffix == ".gguf":
        path = path.resolve()
        known_name = _registry_name_of(path)
        if known_name is not None:  # a registry model's own GGUF: share its cache dir, don't convert twice
            return _Resolved(known_name, get_model_spec(known_name), None, path, hf_cache_path(known_name))
        key = f"{path.stem}-{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"  # distinct per absolute path
        return _Resolved(path.stem, None, None, path, hf_cache_path(key))
    known = ", ".join(sorted(MODELS))
    raise FileNotFoundError(
        f"{text!r} is neither a known model ({known}), nor a Hugging Face directory with config.json, nor a .gguf file"
    )


def _registry_name_of(path: Path) -> str | None:
    """The registry model whose GGUF file `path` is, if any."""
    for name, spec in MODELS.items():
        if path.name != spec.gguf_filename:
            continue
        if spec.assemble == "single-file":
            candidates = part_paths(name) if is_installed(name) else []
        else:
            candidates = [gguf_cache_path(name)]
        if any(c.exists() and c.resolve() == path for c in candidates):
            return name
    return None


def cpu_has_bf16_matmul() -> bool:
    """True if this CPU multiplies bfloat16 in hardware (AMX or AVX512-BF16; Linux /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def matmul_seconds(dtype: str, rows: int, inner: int = 1536, cols: int = 4096, repeats: int = 3) -> float:
    """The best of `repeats` timings of a `[rows, inner] × [inner, cols]` product in `dtype` on this CPU (one warm-up
    first), with torch's current threads."""
    import torch

    kind = getattr(torch, dtype)
    a, b = torch.randn(rows, inner).to(kind), torch.randn(inner, cols).to(kind)
    best = float("inf")
    with torch.inference_mode():
        a @ b
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=None)
def faster_cpu_dtype(rows: int) -> str:
    """For CPU work on `rows` tokens at once: "bfloat16" where this CPU multiplies them by a layer's weights faster in
    bfloat16 than in float32 (measured once per row count in this process: `matmul_seconds`), else "float32". A CPU
    without a bfloat16 multiply is not measured (bfloat16 is emulated there, always slower). Where AVX512-BF16 does
    the work without AMX, bfloat16 wins for a few rows (half the weight bytes to read) and loses for long windows:
    a 256-token forward of the 1.5B took 5.0 s in bfloat16 against 3.0 s in float32 on 2 threads of such a machine,
    while AMX machines run it 2.7x faster in bfloat16 (docs/HAT.md)."""
    if not cpu_has_bf16_matmul():
        return "float32"
    return "bfloat16" if matmul_seconds("bfloat16", rows) < matmul_seconds("float32", rows) else "float32"


def resolve_dtype(dtype: str, device: Any = "cpu", rows: int = 0) -> str:
    """'auto' → the fastest exact-enough dtype for the matmuls of `device` (a torch device or its name); other names
    pass through (validated).

    On a CPU with AMX / AVX512-BF16, bfloat16 makes a multi-token forward (a verification of γ + 1 positions) cost
    about the same as a one-token forward; float32 costs ~1.9x for 5 tokens (docs/ARCHITECTURE.md, "dtypes"). Work on
    many tokens at once (rows > 0: a training batch, a teacher's windows) gets whichever of the two this CPU
    multiplies faster at that size, measured (`faster_cpu_dtype`).
    CUDA: bfloat16 where supported (Ampere+, Jetson Orin), else float16 (Volta, Jetson Xavier). Otherwise float32.
    """
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(MODEL_DTYPES)}")
    if dtype != "auto":
        return dtype
    if str(device).startswith("cuda"):  # bfloat16 in hardware from compute capability 8.0 (Ampere, Orin) on
        import torch

        return "bfloat16" if torch.cuda.get_device_capability(torch.device(device))[0] >= 8 else "float16"
    if rows > 0:
        return faster_cpu_dtype(rows)
    return "bfloat16" if cpu_has_bf16_matmul() else "float32"


def _torch_dtype(dtype: Any, device: Any = "cpu") -> Any:
    import torch

    if not isinstance(dtype, str):
        return dtype
    dtype = resolve_dtype(dtype, device) if dtype == "auto" else dtype
    value = getattr(torch, dtype, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32', 'bfloat16', 'float16'")
    return value


@contextlib.contextmanager
def _progress_bars(show: bool) -> Iterator[None]:
    """Hide the tqdm bars (dequantising, loading, writing shards) for quiet loads; restore the settings after.

    transformers' own bars obey its logging switch; the GGUF dequantiser calls a bare `tqdm` imported into
    `transformers.modeling_gguf_pytorch_utils` (TQDM_DISABLE is read only when tqdm is imported), so that name is
    swapped for a disabled one while the quiet load runs.
    """
    if show:
        yield
        return

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is not None:
        gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
        if was:
            hf_logging.enable_progress_bar()


def _log(quiet: bool, msg: str) -> None:
    if not quiet:
        print(f"[hatspec] {msg}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------------------------- loading


def load_model(name_or_path: str | os.PathLike[str], dtype: Any = "float32", device: Any = "cpu", *,
               tokenizer_only: bool = False, use_cache: bool = True, quiet: bool = False) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    name_or_path: a registry name (`hat_split.models.registry.MODELS`), a Hugging Face directory (with config.json), or
        a .gguf file. A registry model's GGUF is assembled on first use (its packages must be installed).
    dtype: torch dtype or its name ('float32', 'bfloat16', 'float16', or 'auto': see `resolve_dtype`, for `device`).
        GGUF files are dequantised to float32, cached as float32, and cast afterwards.
    device: where the model runs (a torch device: 'cpu', 'cuda:0'; hat_split.models.placement resolves 'auto').
    tokenizer_only: load just the tokenizer (from the cache if valid, else from the GGUF metadata: a few seconds);
        `model` is then None.
    use_cache: False loads a GGUF directly, neither reading nor writing the converted cache.
    """
    with _progress_bars(not quiet):
        return _load_model(name_or_path, dtype, device, tokenizer_only, use_cache, quiet)


def _load_model(name_or_path: str | os.PathLike[str], dtype: Any, device: Any, tokenizer_only: bool,
                use_cache: bool, quiet: bool) -> LoadedModel:
    t0 = time.perf_counter()
    r = _resolve(name_or_path)
    if r.hf_dir is not None:
        tok, model = _load_hf(r.hf_dir, dtype, device, tokenizer_only)
        return LoadedModel(model, tok, r.spec, str(r.hf_dir), time.perf_counter() - t0, False, r.name)
    assert r.cache is not None  # a GGUF source always has a cache key
    if use_cache and cache_is_valid(r.cache) and _cache_format_ok(r.cache):
        tok, model = _load_hf(r.cache, dtype, device, tokenizer_only)
        return LoadedModel(model, tok, r.spec, str(r.cache), time.perf_counter() - t0, True, r.name)

    gguf = r.gguf if r.gguf is not None else gguf_path(r.name, quiet=quiet)
    signature = source_signature(gguf)  # taken before reading, so a concurrent change is noticed next time
    if tokenizer_only:
        tok = _load_gguf_tokenizer(gguf)
        return LoadedModel(None, tok, r.spec, str(gguf), time.perf_counter() - t0, False, r.name)
    _log(quiet, f"loading {gguf.name} (dequantising GGUF: one-off, 0.5-3 min on 2 CPU cores) ...")
    config = _load_gguf_config(gguf)  # parsed once and shared: each parse of a Qwen GGUF's metadata takes 10-30 s
    tok = _load_gguf_tokenizer(gguf, config)
    model = _load_gguf_model(gguf, config)
    load_s = time.perf_counter() - t0
    save_s = 0.0
    if use_cache:
        t1 = time.perf_counter()
        try:
            _write_cache(model, tok, r.cache, {**signature, "name": r.name, "load_seconds": round(load_s, 2)})
            _log(quiet, f"converted {r.name} -> {r.cache} ({time.perf_counter() - t1:.1f} s); later loads use it")
        except OSError as exc:  # disk full, read-only cache: still hand back the loaded model
            _log(False, f"warning: could not write the model cache {r.cache}: {exc}")
        save_s = time.perf_counter() - t1
    model = _finish(model, dtype, device)
    return LoadedModel(model, tok, r.spec, str(gguf), load_s, False, r.name, save_s)


def quantize_weights(model: Any, scheme: str) -> Any:
    """Weight quantization for CPU inference, in place; returns the model. `scheme` in registry.WEIGHT_QUANTS.

    "int8": every nn.Linear (the LM head included) gets per-output-channel int8 weights with activations quantized
    on the fly (torch dynamic quantization, fbgemm/VNNI kernels). Measured on the 2-core Xeon: a one-token forward
    of qwen2.5-coder-0.5b takes 47 ms instead of 93 ms in float32. Only for drafts: the distributions change a
    little, which speculative verification tolerates (the output still follows the target). CPU only.
    """
    if scheme not in WEIGHT_QUANTS:
        raise ValueError(f"unknown weight quantization {scheme!r}; choose from {', '.join(WEIGHT_QUANTS)}")
    if scheme == "none":
        return model

    import torch

    if next(model.parameters()).device.type != "cpu":
        raise ValueError("int8 dynamic quantization runs on CPU only; on a GPU use a TensorRT / onnxruntime bundle")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("int8 dynamic quantization needs a float32 model (load it with dtype='float32')")
    ao = torch.ao.quantization
    with warnings.catch_warnings():  # the eager-mode API is deprecated in favour of torchao, which is not a dependency
        warnings.simplefilter("ignore")
        ao.quantize_dynamic(model, {torch.nn.Linear: ao.per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    return model


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> Any:
    """Just the tokenizer of a model (see `load_model(..., tokenizer_only=True)`)."""
    return load_model(name_or_path, tokenizer_only=True, quiet=True).tokenizer


def _cache_format_ok(cache: Path) -> bool:
    try:
        return json.loads((cache / HF_META).read_text()).get("format") == CACHE_FORMAT
    except (OSError, ValueError):
        return False


def _load_hf(path: Path, dtype: Any, device: Any, tokenizer_only: bool) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tokenizer_only:
        return tok, None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(dtype, device))
    return tok, _finish(model, None, device)


def _load_gguf_config(gguf: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _load_gguf_tokenizer(gguf: Path, config: Any = None) -> Any:
    """The GGUF's tokenizer, round-tripped through save_pretrained so it equals what the cache gives later.

    Loaded straight from GGUF metadata, transformers 5.x builds the Qwen2 tokenizer without the NFC normalizer that
    upstream Qwen (and the same tokenizer reloaded from its saved tokenizer.json) has: 'cafe\u0301' tokenizes
    differently. The round trip (~1 s) makes first and later loads tokenize identically.
    """
    from transformers import AutoTokenizer

    extra = {} if config is None else {"config": config}
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, **extra)
    with tempfile.TemporaryDirectory(prefix="hatspec-tok-") as tmp:
        tok.save_pretrained(tmp)
        return AutoTokenizer.from_pretrained(tmp)


def _load_gguf_model(gguf: Path, config: Any = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:  # transformers needs both to read a GGUF checkpoint; its own error names only one at a time
        raise ImportError(f"loading a GGUF model needs {' and '.join(missing)}: pip install {' '.join(missing)}")
    with torch.no_grad():
        extra = {} if config is None else {"config": config}
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **extra)
    return _as_dense(model, gguf)


def _as_dense(model: Any, gguf: Path) -> Any:
    """Detach transformers' GGUF quantizer from a model whose weights were all dequantised.

    For llama / qwen2 / gemma3 transformers 5.x unpacks every GGUF tensor into a plain float32 Parameter but leaves a
    `GgufHfQuantizer` attached, which makes `save_pretrained` refuse ("not serializable") and `.to(dtype)` fail. The
    model is an ordinary dense model, so the quantizer and `config.quantization_config` are dropped. If some layer was
    kept packed (possible for newer GGUF architectures when the `kernels` package is installed), refuse clearly.
    """
    import torch

    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    not_float = [n for n, p in model.named_parameters() if not torch.is_floating_point(p)]
    if packed or not_float:
        raise RuntimeError(f"{gguf.name}: transformers kept some weights packed ({', '.join(packed or not_float[:3])});"
                           f" hatspec needs a dense model: load with quantization_config=GgufConfig(dequantize=True)")
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def _finish(model: Any, dtype: Any, device: Any) -> Any:
    """Cast (if asked), move to `device`, eval mode."""
    if dtype is not None:
        model = model.to(dtype=_torch_dtype(dtype, device))
    return model.to(device).eval()


def _write_cache(model: Any, tok: Any, cache: Path, meta: dict[str, Any]) -> None:
    """save_pretrained into a temp dir next to `cache`, write hatspec.json last, then rename onto `cache`."""
    import torch
    import transformers

    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", suffix=".tmp", dir=cache.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        meta = {"format": CACHE_FORMAT, **meta, "dtype": "float32", "created": time.time(),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "vocab_fingerprint": vocab_fingerprint(tok)}
        (tmp / HF_META).write_text(json.dumps(meta, indent=1) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700, and some writers 0600 files: the cache is shared read-only
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        old = None
        if cache.exists():  # a stale conversion: move it aside, swap in the new one, then delete it
            old = cache.with_name(f".{cache.name}.old-{os.getpid()}")
            os.replace(cache, old)
        try:
            os.replace(tmp, cache)
        except OSError:
            if not cache_is_valid(cache):  # not a concurrent writer that got there first
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- vocabulary checks


def vocab_fingerprint(tokenizer: Any) -> str:
    """A stable hex sha256 of a tokenizer's vocabulary: every (id, token) pair sorted by id, plus the special ids.

    Two tokenizers with equal fingerprints map every token string to the same id, which is what speculative decoding
    needs of a draft/target pair. Cheap enough (~0.1 s for 150k tokens) to compute at a handshake.
    """
    vocab = tokenizer.get_vocab()  # token -> id, added tokens included
    items = sorted((int(i), str(t)) for t, i in vocab.items())
    special = sorted({int(i) for i in (getattr(tokenizer, "all_special_ids", None) or []) if i is not None})
    payload = json.dumps({"v": FINGERPRINT_VERSION, "vocab": items, "special": special},
                         ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def _describe(x: Any) -> tuple[str, Any, int | None]:
    """(name, tokenizer, logits size or None) of a LoadedModel, or of anything with .tokenizer, or of a tokenizer."""
    tok = getattr(x, "tokenizer", None)
    if tok is None:  # a bare tokenizer
        return str(getattr(x, "name_or_path", "") or type(x).__name__), x, None
    name = getattr(x, "name", "") or str(getattr(x, "source", "") or type(x).__name__)
    n = getattr(x, "n_logits", None)
    if n is None and getattr(x, "model", None) is not None:
        n = output_size(x.model)
    return name, tok, n


def eos_ids(model: Any, tokenizer: Any) -> List[int]:
    """The tokens that end a generation: the model's generation config's, else the tokenizer's end of sequence."""
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    return sorted([eos] if isinstance(eos, int) else (eos or []))


def output_size(model: Any) -> int:
    """Rows of the model's output layer (its logits), also for a weight-quantized head (weight is then a method)."""
    weight = model.get_output_embeddings().weight
    return int((weight() if callable(weight) else weight).shape[0])


def check_pair(draft: Any, target: Any) -> str:
    """Check that `draft` and `target` can be a speculative-decoding pair; return their shared vocab fingerprint.

    draft, target: LoadedModel (model may be None: tokenizer_only), or a bare tokenizer.
    Raises ValueError naming both models if the tokenizers' vocabularies differ, or if both output sizes are known
    (model loaded, or from the registry spec) and differ.
    """
    dname, dtok, dn = _describe(draft)
    tname, ttok, tn = _describe(target)
    dfp, tfp = vocab_fingerprint(dtok), vocab_fingerprint(ttok)

    def who(role: str, name: str, tok: Any, n: int | None, fp: str) -> str:
        logits = f", logits {n}" if n is not None else ""
        return f"{role} {name} (vocab {len(tok)}{logits}, fingerprint {fp[:8]}…)"

    if dfp != tfp:
        raise ValueError(f"{who('draft', dname, dtok, dn, dfp)} and {who('target', tname, ttok, tn, tfp)} do not "
                         f"share a vocabulary; speculative decoding needs the same tokenizer")
    if dn is not None and tn is not None and dn != tn:
        raise ValueError(f"{who('draft', dname, dtok, dn, dfp)} and {who('target', tname, ttok, tn, tfp)} share a "
                         f"vocabulary but their output layers differ ({dn} vs {tn} logits); speculative decoding "
                         f"compares distributions over the same logits")
    return dfp


def load_pair(draft: str, target: str, weight_quant: str = "none", target_dtype: str = "auto"):
    """The draft (weights quantized by `weight_quant`) and the target (`target_dtype`, resolved), checked as a pair,
    and the target's end-of-sequence ids: (draft LoadedModel, target LoadedModel, frozenset of ids)."""
    d = load_model(draft)
    quantize_weights(d.model, weight_quant)
    t = load_model(target, dtype=resolve_dtype(target_dtype))
    check_pair(d, t)
    eos = getattr(t.model.generation_config, "eos_token_id", None)
    return d, t, frozenset([eos] if isinstance(eos, int) else (eos or []))


__all__ = ["LoadedModel", "check_pair", "load_pair", "load_model", "load_tokenizer", "vocab_fingerprint"]
