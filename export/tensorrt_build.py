"""`hat-export tensorrt`: TensorRT engines from a bundle's ONNX artifacts, validated like them.

Each engine gets two optimization profiles over the dynamic shapes (export.graphs): "prefill" (1 to max_chunk new
positions on a cache of 0 to max_context − n) and "decode" (1 to 8 new positions), so a single step does not run in
kernels tuned for a long chunk. The three TensorRT generations on Jetsons differ here:
  - 8.5 (JetPack 5): networks need the EXPLICIT_BATCH flag; fp16 is a builder flag over the fp32 graph's types.
  - 10.x (JetPack 6): explicit batch is the only mode; the graph's own types (the fp16 artifact) are kept with the
    STRONGLY_TYPED flag.
  - 11: strongly typed only, the FP16 builder flag is gone: precision comes from the graph (the fp16 artifact).
int8 / int4 artifacts use onnxruntime's MatMulNBits, which TensorRT does not parse: those are refused with the reason.
Before 10, TensorRT's ONNX parser reads opsets up to 17 (onnx-tensorrt's operators.md for 8.5 and 8.6), and its
ReduceMean ignores the axes input opset 18 gives it, reducing over every axis: a wrong RMSNorm, not a parse error. So
an artifact above opset 17 is refused on those versions (check_opset); `hat-export onnx --opset 17` writes one.
Engines are specific to the GPU and TensorRT version that built them: build on the device (or an identical one).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Sequence

import torch

from edge_runtime.backends.trt_backend import TrtPart, tensorrt_version
from export.config import ExportConfig
from export.graphs import TorchPart, part_specs
from export.validate import THRESHOLDS, Schedule, compare, validation_chain, verdict
from hat_split.files import bundle as M
from hat_split.models.partition import head_rows, model_fingerprint

DECODE_MAX = 8  # new positions: the top of the "decode" profile (a draft step, a short verification)
OPSET_17_BEFORE = 10  # TensorRT major version from which opset-18 graphs parse right; before it, opset <= 17


def check_opset(trt_version: str, opset: int) -> None:
    """Refuse an ONNX artifact of `opset` that TensorRT `trt_version` ("8.5.2.2") would misread, with the fix."""
    major = int(trt_version.split(".")[0])
    if major < OPSET_17_BEFORE and opset > 17:
        raise ValueError(f"TensorRT {trt_version} parses ONNX opsets up to 17 (its ReduceMean ignores opset 18's axes "
                         f"input), and this artifact is opset {opset}: export the bundle's fp32 / fp16 parts again "
                         f"with `hat-export onnx --opset 17 --precision fp16` (or fp32,fp16)")


def _flags(trt: Any, strongly_typed: bool) -> int:
    flags = 0
    if int(trt.__version__.split(".")[0]) < 10:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    if strongly_typed:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    return flags


def profile_shapes(name: str, shape: Sequence, n_range: tuple, max_context: int) -> tuple:
    """(min, opt, max) of one input under a profile whose new positions n span n_range = (lo, opt, hi)."""
    lo, opt, hi = n_range
    if name in (M.X, M.POSITION_IDS, M.TOKENS):
        rest = [int(d) for d in shape[2:]]
        return tuple((1, k, *rest) for k in (lo, opt, hi))
    if name == M.LOGIT_INDEX:
        return (1,), (opt,), (hi,)
    if name in (M.MASK, M.MASK_SLIDING):
        return (1, 1, lo, lo), (1, 1, opt, max_context // 2), (1, 1, hi, max_context)
    heads, head_dim = int(shape[1]), int(shape[3])  # past_key_i / past_value_i
    return (1, heads, 0, head_dim), (1, heads, max_context // 2, head_dim), (1, heads, max_context - lo, head_dim)


def build_engine(onnx_path: Path, engine_path: Path, precision: str, max_context: int, max_chunk: int,
                 workspace_gb: float = 4.0) -> Dict[str, Any]:
    """Build and write one engine; returns what the manifest records about the build."""
    import tensorrt as trt

    if precision not in ("fp32", "fp16"):
        raise ValueError(f"TensorRT engines are built from fp32 or fp16 artifacts; {precision} uses onnxruntime's "
                         "MatMulNBits, which TensorRT cannot parse")
    major = int(trt.__version__.split(".")[0])
    strongly_typed = hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED") and major >= 10
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(_flags(trt, strongly_typed))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT could not parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * (1 << 30)))
    if precision == "fp16" and not strongly_typed:
        config.set_flag(trt.BuilderFlag.FP16)
    ranges = {"prefill": (1, max(1, max_chunk // 2), max_chunk), "decode": (1, 1, DECODE_MAX)}
    for n_range in ranges.values():
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            profile.set_shape(tensor.name, *profile_shapes(tensor.name, tuple(tensor.shape), n_range, max_context))
        config.add_optimization_profile(profile)
    t0 = time.perf_counter()
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path.name} (see its log above)")
    engine_path.write_bytes(bytes(blob))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "unknown"
    cc = ".".join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else "unknown"
    return {"tensorrt": trt.__version__, "strongly_typed": strongly_typed, "profiles": ranges,
            "max_context": max_context, "max_chunk": max_chunk, "gpu": gpu, "compute_capability": cc,
            "build_s": time.perf_counter() - t0, "from": onnx_path.name}


def build_bundle(loaded: Any, config: ExportConfig, adapter: Any, prompts: Sequence[Sequence[int]],
                 draft_ids: Any = None) -> M.Manifest:
    """Engines for every ONNX part of `config.tensorrt.precisions` in the bundle `config.out`, validated against torch
    (on `prompts`, token ids) like the ONNX artifacts; `adapter`: the Λ or feature drafter the bundle's hat parts were
    exported with (draft_ids: the feature part's draft vocabulary, None: the whole head)."""
    trt_version = tensorrt_version()
    trt_config, bundle = config.tensorrt, Path(config.out)
    man = M.load(bundle, model_fingerprint=model_fingerprint(loaded.model))
    for a in man.artifacts:  # before any engine is built
        if a.backend == "onnx" and a.precision in trt_config.precisions:
            check_opset(trt_version, a.opset)
    model = loaded.model
    n = model.config.num_hidden_layers
    for prec in trt_config.precisions:
        onnx_parts = sorted((a for a in man.artifacts if a.backend == "onnx" and a.precision == prec),
                            key=lambda a: M.PARTS.index(a.part))
        chains = [[a for a in onnx_parts if a.part == "draft"], [a for a in onnx_parts if a.part != "draft"]]
        for chain in [c for c in chains if c]:
            specs = part_specs([a.part for a in chain], n, man.model["m"], man.model["tail"])
            builds, runners = [], []
            for a in chain:
                engine = bundle / f"{a.part}.{prec}.engine"
                builds.append(build_engine(bundle / a.path, engine, prec, trt_config.max_context,
                                           trt_config.max_chunk, trt_config.workspace_gb))
                runners.append(TrtPart(engine))
            window = man.model.get("sliding_window") or None
            rows = [head_rows(model, draft_ids) if s.drafter and draft_ids is not None else None for s in specs]
            reference = validation_chain([TorchPart(model, s, adapter, r) for s, r in zip(specs, rows)],
                                         man.model["vocab"], window)
            figures = compare(reference, validation_chain(runners, man.model["vocab"], window), prompts, Schedule())
            for a, build, fig, runner in zip(chain, builds, figures, runners):
                ok, reason = verdict(fig, prec, runner.io.logits_out)
                name = f"{a.part}.{prec}.engine"
                man.replace(M.Artifact(
                    part=a.part, precision=prec, backend="tensorrt", files={name: M.sha256(bundle / name)},
                    sizes={name: (bundle / name).stat().st_size}, path=name, inputs=a.inputs, outputs=a.outputs,
                    layers=a.layers, adapter=a.adapter, opset=a.opset, build=build,
                    validation={"regimes": fig, "thresholds": THRESHOLDS[prec], "prompts": len(prompts),
                                "providers": runner.providers, "reason": reason, "reference": "torch float32"},
                    status="validated" if ok else "failed"))
            M.write(bundle, man)
    return man
