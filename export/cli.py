"""`hat-export`: build and check the bundles devices run.

    hat-export onnx --model NAME --parts draft|hat|hat-feature|ushape [--m M --adapter DIR] --precision fp32,int8 \
        --out DIR [--draft-vocab N]
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
import sys
from pathlib import Path
from typing import Optional, Sequence

from edge_runtime.backends.trt_backend import tensorrt_version
from export.config import ExportConfig
from hat_split.files import bundle as M
from hat_split.files.config_file import add_config_argument, config_from_flags
from hat_split.files.settings import add_flags, fields_of, overrides
from hat_split.models.loading import load_model, vocab_fingerprint
from hat_split.models.partition import SplitModel, model_fingerprint
from hat_split.prompt_sets import validation_prompts

# the ExportConfig keys `hat-export tensorrt` takes besides its [tensorrt] table (its positional bundle sets `out`)
TENSORRT_KEYS = ("model", "adapter", "prompts")


def _draft_module(path: str, split: SplitModel, feature: bool):
    """The hat-distill output at `path` for the bundle's draft part: the feature drafter (hat-feature) or Λ (hat);
    the other kind is refused, naming the parts that export it."""
    from hat_split.models.adapter import load_adapter  # torch
    from hat_split.models.feature_drafter import is_feature_drafter, load_feature_drafter

    holds = is_feature_drafter(path)
    if holds != feature:
        raise ValueError(f"{path} holds {'a feature drafter' if holds else 'Λ (an adapter)'}: export it with --parts "
                         f"{'hat-feature' if holds else 'hat'}")
    return load_feature_drafter(path, split) if feature else load_adapter(path, split)


def _parser() -> argparse.ArgumentParser:
    """onnx: a flag for every ExportConfig key but its [tensorrt] table; tensorrt: the [tensorrt] table's flags and
    TENSORRT_KEYS' (hat_split.files.settings)."""
    p = argparse.ArgumentParser(prog="hat-export", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    keys = [key for key, _, _ in fields_of(ExportConfig)]
    o = sub.add_parser("onnx", help="export, validate and record ONNX artifacts")
    add_config_argument(o, "export")
    o.set_defaults(flag_keys=add_flags(o, ExportConfig, skip=[k for k in keys if k.startswith("tensorrt.")]))
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    t = sub.add_parser("tensorrt", help="build TensorRT engines from a bundle's ONNX artifacts and validate them")
    add_config_argument(t, "export")
    t.add_argument("bundle", nargs="?", default="", help="the bundle directory, its `out` (required without --config)")
    t.set_defaults(flag_keys=add_flags(t, ExportConfig, skip=[k for k in keys if not k.startswith("tensorrt.")
                                                              and k not in TENSORRT_KEYS]))
    v = sub.add_parser("verify", help="check a bundle's checksums and compatibility, and list it")
    v.add_argument("bundle")
    v.add_argument("--model", default="", help="also check it holds this model (its weights and vocabulary)")
    v.add_argument("--device-profile", default=None)
    return p


def export_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> ExportConfig:
    """The command's ExportConfig: the --config file with the flags typed on this command line on top of it, or the
    flags alone."""
    typed = overrides(args, args.flag_keys)
    if args.cmd == "tensorrt" and args.bundle:
        typed["out"] = args.bundle
    if not args.config:
        missing = [what for key, what in (("model", "--model"), ("out", "--out" if args.cmd == "onnx" else "a bundle"))
                   if key not in typed]
        if missing:
            raise ValueError(f"hat-export {args.cmd}: give {' and '.join(missing)} (or --config FILE)")
    return config_from_flags(ExportConfig, args.config, typed)


def _onnx(config: ExportConfig, args: argparse.Namespace) -> int:
    from export.onnx_export import export_bundle  # torch, onnx, onnxruntime: the export extra
    from hat_split.models.adapter import load_draft_vocab

    drafts = {"adapter", "feature"} & set(config.part_kinds)
    if drafts and not config.adapter:
        raise ValueError(f"--parts {config.parts} needs --adapter DIR (a hat-distill output)")
    loaded = load_model(config.model, dtype="float32")
    adapter = ids = None
    if drafts:
        adapter = _draft_module(config.adapter, SplitModel(loaded.model, config.m, config.tail), "feature" in drafts)
        ids = load_draft_vocab(config.adapter, config.draft_vocab) if config.draft_vocab else None
    prompts = validation_prompts(loaded.tokenizer, config.prompts)
    man = export_bundle(loaded, config, adapter, prompts, progress=not args.quiet, draft_ids=ids)
    _print(man)
    failed = [a for a in man.artifacts
              if a.status == "failed" and a.precision in config.precisions and a.part in config.part_kinds]
    for a in failed:
        print(f"hat-export: {a.part}/{a.precision} FAILED validation: {a.validation['reason']}", file=sys.stderr)
    return 1 if failed else 0


def _tensorrt(config: ExportConfig, args: argparse.Namespace) -> int:
    from export.tensorrt_build import build_bundle  # torch

    tensorrt_version()  # says so before a model is loaded when TensorRT is absent
    man = M.read(Path(config.out))
    loaded = load_model(config.model, dtype="float32")
    adapter = ids = None
    drafts = {a.part for a in man.artifacts} & {"adapter", "feature"}
    if len(drafts) > 1:
        raise ValueError("the bundle holds both Λ and the feature part: build engines for a bundle of one (export "
                         "hat and hat-feature into directories of their own)")
    if drafts:
        if not config.adapter:
            raise ValueError(f"the bundle holds {'the feature drafter' if 'feature' in drafts else 'Λ'}: give "
                             "--adapter DIR (the one it was exported with)")
        split = SplitModel(loaded.model, man.model["m"], man.model["tail"])
        adapter = _draft_module(config.adapter, split, "feature" in drafts)
        ids = M.read_draft_vocab(config.out, man.model) if "feature" in drafts else None
    man = build_bundle(loaded, config, adapter, validation_prompts(loaded.tokenizer, config.prompts), ids)
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
