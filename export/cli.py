"""`hat-export`: build and check the bundles devices run.

    hat-export onnx --model NAME --parts draft|hat|ushape [--m M --adapter DIR] --precision fp32,fp16,int8,int4 --out DIR
    hat-export tensorrt DIR --model NAME [--adapter DIR] --precision fp16 [--max-context N --max-chunk N]
    hat-export verify DIR [--model NAME] [--device-profile NAME]

`onnx` exports the parts, validates every artifact against torch on real prompts (a prefill, chunks, single steps)
and writes DIR/manifest.json; it exits 1 when an artifact failed validation (it stays in the bundle, marked failed,
and runtimes refuse it). `verify` checks a bundle's checksums and compatibility and prints what it holds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List

PART_SETS = {"draft": ["draft"], "hat": ["input", "adapter", "output"], "ushape": ["input", "output"]}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hat-export", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("onnx", help="export, validate and record ONNX artifacts")
    o.add_argument("--model", required=True, help="registry name, HF directory or .gguf file")
    o.add_argument("--parts", default="draft", choices=sorted(PART_SETS),
                   help="draft: the whole model as a draft; hat: input part, Λ and output part; ushape: input and "
                        "output parts")
    o.add_argument("--m", type=int, default=2, help="hat / ushape: layers of the input part")
    o.add_argument("--tail", type=int, default=0, help="hat / ushape: layers kept beside the head")
    o.add_argument("--adapter", default="", help="hat: a hat-distill adapter directory")
    o.add_argument("--precision", default="fp32,int8,int4", help="comma list of fp32, fp16, int8, int4")
    o.add_argument("--out", required=True, help="bundle directory (created; an existing bundle of the same model "
                                                 "gains or replaces artifacts)")
    o.add_argument("--device-profile", default="any", help="the device profile the bundle targets")
    o.add_argument("--prompts", type=int, default=4, help="real prompts to validate on (half HumanEval, half "
                                                          "ShareGPT)")
    o.add_argument("--threads", type=int, default=0, help="onnxruntime threads during validation (0: default)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    t = sub.add_parser("tensorrt", help="build TensorRT engines from a bundle's ONNX artifacts and validate them")
    t.add_argument("bundle")
    t.add_argument("--model", required=True, help="the bundle's model (the torch reference for validation)")
    t.add_argument("--adapter", default="", help="the adapter the bundle's hat parts were exported with")
    t.add_argument("--precision", default="fp16", help="comma list of fp32, fp16")
    t.add_argument("--max-context", type=int, default=2048, help="longest cache + new positions an engine accepts")
    t.add_argument("--max-chunk", type=int, default=256, help="most new positions per call (a prompt chunk)")
    t.add_argument("--prompts", type=int, default=4)
    v = sub.add_parser("verify", help="check a bundle's checksums and compatibility, and list it")
    v.add_argument("bundle")
    v.add_argument("--model", default="", help="also check it holds this model (its weights and vocabulary)")
    v.add_argument("--device-profile", default=None)
    return p


def validation_prompts(tokenizer, n: int, min_tokens: int = 40, max_tokens: int = 160) -> List[List[int]]:
    """n real prompts as token ids (held out from the distillation and benchmark sets by offset)."""
    from profiles.testbed.prompts import encode, humaneval_prompts, sharegpt_prompts

    pool = humaneval_prompts(n, offset=150) + sharegpt_prompts(4 * n, offset=5000, min_chars=200, max_chars=2000)
    out = []
    for p in pool:
        ids = encode(tokenizer, p.text, p.chat)
        if len(ids) >= min_tokens:
            out.append(ids[:max_tokens])
        if len(out) == n:
            break
    if len(out) < n:
        raise RuntimeError(f"found only {len(out)} validation prompts of >= {min_tokens} tokens")
    return out


def _onnx(args) -> int:
    from export.onnx_export import export_bundle
    from hat_split.models.loading import load_model

    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    parts = PART_SETS[args.parts]
    adapter = None
    loaded = load_model(args.model, dtype="float32")
    if "adapter" in parts:
        if not args.adapter:
            raise ValueError("--parts hat needs --adapter DIR (a hat-distill output)")
        from hat_split.models.adapter import load_adapter
        from hat_split.models.partition import SplitModel

        adapter = load_adapter(args.adapter, SplitModel(loaded.model, args.m, args.tail))
    prompts = validation_prompts(loaded.tokenizer, args.prompts)
    man = export_bundle(loaded, Path(args.out), parts, precisions, args.m, args.tail, adapter, args.adapter, prompts,
                        args.device_profile, args.threads, progress=not args.quiet)
    _print(man)
    failed = [a for a in man.artifacts if a.status == "failed" and a.precision in precisions and a.part in parts]
    for a in failed:
        print(f"hat-export: {a.part}/{a.precision} FAILED validation: {a.validation['reason']}", file=sys.stderr)
    return 1 if failed else 0


def _tensorrt(args) -> int:
    from hat_split.files import bundle as M
    from export.tensorrt_build import build_bundle
    from hat_split.models.loading import load_model

    from edge_runtime.backends.trt_backend import tensorrt_version

    tensorrt_version()  # says so before a model is loaded when TensorRT is absent
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    man = M.read(Path(args.bundle))
    loaded = load_model(args.model, dtype="float32")
    adapter = None
    if any(a.part == "adapter" for a in man.artifacts):
        if not args.adapter:
            raise ValueError("the bundle holds Λ: give --adapter DIR (the one it was exported with)")
        from hat_split.models.adapter import load_adapter
        from hat_split.models.partition import SplitModel

        adapter = load_adapter(args.adapter, SplitModel(loaded.model, man.model["m"], man.model["tail"]))
    man = build_bundle(Path(args.bundle), loaded, adapter, precisions, validation_prompts(loaded.tokenizer, args.prompts),
                       args.max_context, args.max_chunk)
    _print(man)
    failed = [a for a in man.artifacts if a.backend == "tensorrt" and a.status == "failed"]
    return 1 if failed else 0


def _verify(args) -> int:
    from hat_split.files import bundle as M

    fingerprint = vocab = None
    if args.model:
        from hat_split.models.loading import load_model, vocab_fingerprint
        from hat_split.models.partition import model_fingerprint

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
        agree = min((f.get("argmax_agreement", 1.0) for f in regimes.values()), default=None)
        fig = "" if worst is None else f"max rel |Δ| {worst['max_rel_diff']:.2e}"
        if agree is not None and any("argmax_agreement" in f for f in regimes.values()):
            fig += f", argmax agreement {100 * agree:.1f} %"
        print(f"  {a.part:8s} {a.precision:5s} {a.backend:9s} {sum(a.sizes.values()) / 2 ** 20:8.1f}  "
              f"{a.status:11s} {fig}")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return {"onnx": _onnx, "tensorrt": _tensorrt, "verify": _verify}[args.cmd](args)
    except (ValueError, RuntimeError, OSError) as exc:  # BundleError is a ValueError
        print(f"hat-export: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
