"""`hat-export`: build and check the bundles devices run.

    hat-export onnx --model NAME --parts draft|hat|ushape [--m M --adapter DIR] --precision fp32,int8 --out DIR
    hat-export onnx --model NAME --precision fp16 --opset 17 --out DIR   (for TensorRT 8.5, JetPack 5)
    hat-export tensorrt DIR --model NAME [--adapter DIR] --precision fp16 [--max-context N --max-chunk N]
    hat-export onnx|tensorrt --config export.toml [flags]   (an ExportConfig, docs/CONFIG.md; flags given win)
    hat-export verify DIR [--model NAME] [--device-profile NAME]

`onnx` exports the parts, validates every artifact against torch on real prompts (a prefill, chunks, single steps)
and writes DIR/manifest.json; it exits 1 when an artifact failed validation (it stays in the bundle, marked failed,
and runtimes refuse it). `verify` checks a bundle's checksums and compatibility and prints what it holds.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from edge_runtime.backends.trt_backend import tensorrt_version
from export.config import OPSETS, PART_SETS, ExportConfig, TensorRTConfig
from hat_split.files import bundle as M
from hat_split.files.config_file import add_config_argument, config_from_command_line
from hat_split.models.loading import load_model, vocab_fingerprint
from hat_split.models.partition import SplitModel, model_fingerprint
from testbed.prompts import validation_prompts

# argparse dest -> ExportConfig key (dotted: a key of its [tensorrt] table), per command; the flags given override
# the --config file's keys
FLAG_KEYS: Dict[str, Dict[str, str]] = {
    "onnx": {"model": "model", "out": "out", "parts": "parts", "m": "m", "tail": "tail", "adapter": "adapter",
             "precision": "precisions", "opset": "opset", "device_profile": "device_profile", "prompts": "prompts",
             "threads": "threads", "int4_embeddings": "int4_embeddings"},
    "tensorrt": {"bundle": "out", "model": "model", "adapter": "adapter", "precision": "tensorrt.precisions",
                 "max_context": "tensorrt.max_context", "max_chunk": "tensorrt.max_chunk", "prompts": "prompts"},
}


def _default(cls: type, name: str) -> Any:
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hat-export", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("onnx", help="export, validate and record ONNX artifacts")
    add_config_argument(o, "export")
    o.add_argument("--model", default="", help="registry name, HF directory or .gguf file (required without --config)")
    o.add_argument("--parts", default=_default(ExportConfig, "parts"), choices=sorted(PART_SETS),
                   help="draft: the whole model as a draft; hat: input part, Λ and output part; ushape: input and "
                        "output parts")
    o.add_argument("--m", type=int, default=_default(ExportConfig, "m"), help="hat / ushape: layers of the input part")
    o.add_argument("--tail", type=int, default=_default(ExportConfig, "tail"),
                   help="hat / ushape: layers kept beside the head")
    o.add_argument("--adapter", default="", help="hat: a hat-distill adapter directory")
    o.add_argument("--precision", default=",".join(_default(ExportConfig, "precisions")),
                   help="comma list of fp32, fp16, int8, int4")
    o.add_argument("--opset", type=int, default=_default(ExportConfig, "opset"),
                   help=f"ONNX opset of the fp32 / fp16 graphs, {OPSETS[0]}..{OPSETS[-1]}; 17 for TensorRT before 10 "
                        "(JetPack 5), with --precision fp16 or fp32,fp16")
    o.add_argument("--int4-embeddings", default=_default(ExportConfig, "int4_embeddings"),
                   action=argparse.BooleanOptionalAction,
                   help="int4: quantize the embedding table too (onnxruntime >= 1.20); --no-int4-embeddings for "
                        "devices on onnxruntime 1.17-1.19 (Python 3.8, JetPack 5)")
    o.add_argument("--out", default="", help="bundle directory (created; an existing bundle of the same model gains or "
                                             "replaces artifacts; required without --config)")
    o.add_argument("--device-profile", default=_default(ExportConfig, "device_profile"),
                   help="the device profile the bundle targets")
    o.add_argument("--prompts", type=int, default=_default(ExportConfig, "prompts"),
                   help="real prompts to validate on (half HumanEval, half ShareGPT)")
    o.add_argument("--threads", type=int, default=_default(ExportConfig, "threads"),
                   help="onnxruntime threads during validation (0: default)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    t = sub.add_parser("tensorrt", help="build TensorRT engines from a bundle's ONNX artifacts and validate them")
    add_config_argument(t, "export")
    t.add_argument("bundle", nargs="?", default="", help="the bundle directory (required without --config)")
    t.add_argument("--model", default="", help="the bundle's model (the torch reference for validation)")
    t.add_argument("--adapter", default="", help="the adapter the bundle's hat parts were exported with")
    t.add_argument("--precision", default=",".join(_default(TensorRTConfig, "precisions")),
                   help="comma list of fp32, fp16")
    t.add_argument("--max-context", type=int, default=_default(TensorRTConfig, "max_context"),
                   help="longest cache + new positions an engine accepts")
    t.add_argument("--max-chunk", type=int, default=_default(TensorRTConfig, "max_chunk"),
                   help="most new positions per call (a prompt chunk)")
    t.add_argument("--prompts", type=int, default=_default(ExportConfig, "prompts"))
    v = sub.add_parser("verify", help="check a bundle's checksums and compatibility, and list it")
    v.add_argument("bundle")
    v.add_argument("--model", default="", help="also check it holds this model (its weights and vocabulary)")
    v.add_argument("--device-profile", default=None)
    return p


def export_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> ExportConfig:
    """The command's ExportConfig: the --config file with the flags typed on this command line on top of it, or the
    flags alone."""
    keys = FLAG_KEYS[args.cmd]
    values = {dest: {key: _csv(getattr(args, dest)) if dest == "precision" else getattr(args, dest)}
              for dest, key in keys.items()}
    return config_from_command_line(ExportConfig, parser, args, argv, values)


def _csv(text: str) -> List[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _onnx(config: ExportConfig, args: argparse.Namespace) -> int:
    from export.onnx_export import export_bundle  # torch, onnx, onnxruntime: the export extra
    from hat_split.models.adapter import load_adapter  # torch

    if "adapter" in config.part_kinds and not config.adapter:
        raise ValueError("--parts hat needs --adapter DIR (a hat-distill output)")
    loaded = load_model(config.model, dtype="float32")
    adapter = None
    if "adapter" in config.part_kinds:
        adapter = load_adapter(config.adapter, SplitModel(loaded.model, config.m, config.tail))
    prompts = validation_prompts(loaded.tokenizer, config.prompts)
    man = export_bundle(loaded, config, adapter, prompts, progress=not args.quiet)
    _print(man)
    failed = [a for a in man.artifacts
              if a.status == "failed" and a.precision in config.precisions and a.part in config.part_kinds]
    for a in failed:
        print(f"hat-export: {a.part}/{a.precision} FAILED validation: {a.validation['reason']}", file=sys.stderr)
    return 1 if failed else 0


def _tensorrt(config: ExportConfig, args: argparse.Namespace) -> int:
    from export.tensorrt_build import build_bundle  # torch
    from hat_split.models.adapter import load_adapter  # torch

    tensorrt_version()  # says so before a model is loaded when TensorRT is absent
    man = M.read(Path(config.out))
    loaded = load_model(config.model, dtype="float32")
    adapter = None
    if any(a.part == "adapter" for a in man.artifacts):
        if not config.adapter:
            raise ValueError("the bundle holds Λ: give --adapter DIR (the one it was exported with)")
        adapter = load_adapter(config.adapter, SplitModel(loaded.model, man.model["m"], man.model["tail"]))
    man = build_bundle(loaded, config, adapter, validation_prompts(loaded.tokenizer, config.prompts))
    _print(man)
    failed = [a for a in man.artifacts if a.backend == "tensorrt" and a.status == "failed"]
    return 1 if failed else 0


def _verify(args: argparse.Namespace) -> int:
    fingerprint = vocab = None
    if args.model:
        loaded = load_model(args.model, dtype="float32")
        fingerprint, vocab = model_fingerprint(loaded.model), vocab_fingerprint(loaded.tokenizer)
    man = M.load(Path(args.bundle), fingerprint, vocab, args.device_profile)
    _print(man)
    print(f"hat-export verify: {args.bundle}: {len(man.artifacts)} artifacts, checksums match")
    return 0


def _print(man) -> None:
    m = man.model
    print(f"bundle of {m['name']} ({m['family']}, {m['layers']} layers), device profile {man.device_profile}, "
          f"hatspec {man.hatspec_version}, protocol v{man.protocol_version}")
    print(f"  {'part':8s} {'prec':5s} {'backend':9s} {'MB':>8s}  {'status':11s} worst regime figures")
    for a in sorted(man.artifacts, key=lambda a: (a.backend, a.part, a.precision)):
        regimes = a.validation.get("regimes", {})
        worst = max(regimes.values(), key=lambda f: f["max_rel_diff"], default=None)
        fig = "" if worst is None else f"max rel |Δ| {worst['max_rel_diff']:.2e}"
        tvs = [f for f in regimes.values() if "mean_tv" in f]
        if tvs:
            far = max(tvs, key=lambda f: f["mean_tv"])
            fig += f", mean TV {far['mean_tv']:.3f} (argmax agreement {100 * far['argmax_agreement']:.1f} %)"
        print(f"  {a.part:8s} {a.precision:5s} {a.backend:9s} {sum(a.sizes.values()) / 2 ** 20:8.1f}  "
              f"{a.status:11s} {fig}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.cmd == "verify":
            return _verify(args)
        config = export_config(parser, args, argv)
        return {"onnx": _onnx, "tensorrt": _tensorrt}[args.cmd](config, args)
    except (ValueError, RuntimeError, OSError) as exc:  # BundleError and ConfigError are ValueErrors
        print(f"hat-export: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
