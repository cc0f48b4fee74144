"""`hat-export onnx`: a model's device parts (or a whole draft model) as ONNX graphs, in several precisions, each
validated against torch and recorded in the bundle's manifest.

fp32 and fp16 graphs are exported from torch (torch.onnx, the torch.export-based exporter, every length dynamic) in
the config's opset (18, the exporter's own; 17, for TensorRT before 10, is converted down from it); int8 and int4 are
weight-only block quantizations of the fp32 graph (onnxruntime's MatMulNBits: weights in blocks of 32 with one scale
each, activations in float). Weights go to an external-data file beside each graph (a 0.5B
model in fp32 is past protobuf's 2 GB limit).
"""
from __future__ import annotations

import copy
import logging
import os
import shutil
import time
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from edge_runtime.backends.onnx_backend import OrtPart
from export.config import OPSET, ExportConfig
from export.graphs import PartGraph, PartSpec, TorchPart, example_inputs, part_specs
from export.validate import THRESHOLDS, Schedule, compare, validation_chain, verdict
from hat_split.files import bundle as M
from hat_split.models.loading import eos_ids, output_size, vocab_fingerprint
from hat_split.models.partition import head_rows, model_fingerprint
from hat_split.wire.messages import PROTOCOL_VERSION

QUANT_BLOCK = 32
# MatMulNBits' compute type: 4 = int8 products of the activations (quantized per block at run time) with the weights.
# On this CPU it is what makes weight-only int8 fast at all (69 vs 4.7 tok/s for smollm2's draft; int4 79 tok/s).
ACCURACY_LEVEL = 4


def export_graph(model: Any, spec: PartSpec, adapter: Any, path: Path, opset: int = OPSET,
                 untie: bool = False, rows: Any = None) -> None:
    """One part as an ONNX graph at `path` (weights in `path`.data) in `opset` (export.config.OPSETS); rows: the
    feature part's draft-vocabulary head (hat_split.models.partition.head_rows), None: the model's head.

    untie: a head tied to the embeddings reaches the graph as Transpose(shared table), which the weight-only
    quantizers cannot use (no constant weight), so the largest matmul of a small model would stay float; the graph
    that quantization starts from gets a copy of its own. fp32 / fp16 artifacts keep the one table.
    """
    if untie and spec.logits_out and model.lm_head.weight is model.model.embed_tokens.weight:
        tied = model.lm_head.weight
        model.lm_head.weight = torch.nn.Parameter(tied.detach().clone(), requires_grad=False)
        try:
            return export_graph(model, spec, adapter, path, opset, rows=rows)
        finally:
            model.lm_head.weight = tied
    graph = PartGraph(model, spec, adapter, rows).eval()
    args = example_inputs(model, spec, adapter)
    adapter_type = adapter.layer_type if adapter is not None else None
    names = spec.input_names(model.config, adapter_type)
    shapes = [{d: torch.export.Dim.DYNAMIC for d in range(a.dim()) if not _static(n, d)} for n, a in zip(names, args)]
    shapes = (shapes[0], shapes[1], tuple(shapes[2:]))  # forward(x, position_ids, *rest)
    # the exporter warns once per torchvision operator it cannot register; hatspec exports no vision model
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pytree deprecations inside the exporter
        program = torch.onnx.export(graph, args, input_names=names, output_names=spec.output_names(model.config),
                                    dynamic_shapes=shapes, opset_version=max(opset, OPSET), dynamo=True,
                                    optimize=True, verbose=False)
    program.save(str(path), external_data=True)
    if opset < OPSET:
        convert_opset(path, opset)
    written = graph_opset(path)
    if written != opset:  # torch keeps its own opset when a conversion fails, with a warning only
        raise RuntimeError(f"{path.name}: asked for ONNX opset {opset}, torch's exporter wrote {written}")


def untie_graph(src: Path, dst: Path) -> bool:
    """The graph at `src` with its head's weight, when tied to the embeddings, given a copy of its own: the
    Transpose(shared table) feeding the head's MatMul becomes a constant initializer, the table transposed, which the
    weight-only quantizers can use. Written to `dst` (weights in `dst`.data); the same computation to the bit (a
    transpose moves values, never rounds them). Returns False, writing nothing, when no head is tied there.

    What `export_graph(untie=True)` gets by exporting the model again, in a second or two instead of a second export
    (43 s for smollm2-135m's 30 layers here): int8 / int4 start from the fp32 artifact of the same run."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(src))
    tables = {t.name: t for t in model.graph.initializer if len(t.dims) == 2}
    users: Dict[str, list] = {}
    for node in model.graph.node:
        for name in node.input:
            users.setdefault(name, []).append(node)
    for node in list(model.graph.node):
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        if node.op_type != "Transpose" or node.input[0] not in tables or perm != [1, 0]:
            continue
        heads = users.get(node.output[0], [])
        if len(users[node.input[0]]) < 2 or not heads or any(h.op_type != "MatMul" for h in heads):
            continue  # a table nothing else reads, or a transpose that feeds something other than the head
        table = numpy_helper.to_array(tables[node.input[0]])
        copy_ = numpy_helper.from_array(np.ascontiguousarray(table.T), name=f"{node.input[0]}.untied")
        model.graph.initializer.append(copy_)
        for head in heads:
            head.input[:] = [copy_.name if x == node.output[0] else x for x in head.input]
        model.graph.node.remove(node)
        onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dst.name + ".data")
        return True
    return False


def convert_opset(path: Path, opset: int) -> None:
    """Rewrite the graph at `path` down to `opset` with onnx.version_converter (18 -> 17: ReduceMean's axes input
    back to an attribute), its weights left in the external-data file they are in.

    torch's exporter asked for an opset below its own converts too, but in memory without the initializers: the
    converter then cannot read ReduceMean's axes (an initializer), fails, and the graph stays at 18.
    """
    import onnx
    from onnx import version_converter

    model = onnx.load(str(path), load_external_data=False)  # external tensors keep their location references
    try:
        converted = version_converter.convert_version(model, opset)
    except Exception as exc:  # the converter raises RuntimeError / ValueError from C++ without naming the graph
        raise RuntimeError(f"{path.name}: onnx.version_converter could not convert it to opset {opset}: {exc}") \
            from exc
    for node in converted.graph.node:
        _drop_noop_with_empty_axes(node, opset)
    path.write_bytes(converted.SerializeToString())
    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        raise RuntimeError(f"{path.name} converted to opset {opset} is not a valid graph: {exc}") from exc


def _drop_noop_with_empty_axes(node: Any, opset: int) -> None:
    """The converter moves a Reduce op's axes input to the attribute but keeps noop_with_empty_axes, which the ops
    other than ReduceSum only have from 18 on. Without it, no axes means every axis, as noop_with_empty_axes = 0."""
    import onnx

    if node.domain not in ("", "ai.onnx") or not node.op_type.startswith("Reduce"):
        return
    if "noop_with_empty_axes" in onnx.defs.get_schema(node.op_type, opset).attributes:
        return
    attrs = {a.name: a for a in node.attribute}
    noop = attrs.get("noop_with_empty_axes")
    if noop is None:
        return
    if noop.i and not ("axes" in attrs and attrs["axes"].ints):  # an identity opset 17 cannot say
        raise RuntimeError(f"{node.name}: {node.op_type} with no axes and noop_with_empty_axes = 1 has no opset "
                           f"{opset} form")
    node.attribute.remove(noop)


def graph_opset(path: Path) -> int:
    """The opset of the default (ai.onnx) domain the graph at `path` imports, as written; 0 if none."""
    import onnx

    return _default_opset(onnx.load(str(path), load_external_data=False))


def _default_opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _static(name: str, dim: int) -> bool:
    """Dimensions fixed: the batch of 1, the hidden size of states, heads and head size of caches."""
    if name == M.LOGIT_INDEX:
        return False
    if dim == 0:
        return True
    if name in (M.X, M.TOKENS):
        return dim == 2
    if name.startswith((M.PAST_KEY, M.PAST_VALUE)):
        return dim in (1, 3)
    if name in (M.MASK, M.MASK_SLIDING):
        return dim == 1
    return False


def quantize_graph(src: Path, dst: Path, bits: int, embeddings: bool = True) -> Dict[str, Any]:
    """Weight-only int`bits` of every MatMul with a constant weight (MatMulNBits, blocks of 32); at 4 bits the
    embedding table too unless `embeddings` is false (GatherBlockQuantized needs onnxruntime >= 1.20)."""
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as q

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.ERROR)

    symmetric = bits != 4  # int4 keeps a zero point per block (as llama.cpp's Q4_1): better agreement at 4 bits
    # at 4 bits the embeddings too (Gather along the hidden axis; onnxruntime quantizes Gather at 4 bits only): a
    # 151936-token table is 545 MB in float32. The quantizer lifts the graph to opset 21 for its int4 tensors
    # (onnxruntime runs it; TensorRT never sees these artifacts).
    ops = ("MatMul", "Gather") if bits == 4 and embeddings else ("MatMul",)
    cfg = q.DefaultWeightOnlyQuantConfig(block_size=QUANT_BLOCK, is_symmetric=symmetric,
                                         accuracy_level=ACCURACY_LEVEL, bits=bits, op_types_to_quantize=ops,
                                         quant_axes=(("MatMul", 0), ("Gather", 1)))
    quant = q.MatMulNBitsQuantizer(onnx.load(str(src)), algo_config=cfg)
    quant.process()
    quant.model.save_model_to_file(str(dst), use_external_data_format=True)
    return {"method": "onnxruntime MatMulNBits (weight-only, round to nearest)", "bits": bits,
            "block_size": QUANT_BLOCK, "symmetric": symmetric, "accuracy_level": ACCURACY_LEVEL, "ops": list(ops)}


def _files(bundle: Path, graph: Path) -> Dict[str, str]:
    out = {}
    for p in sorted(bundle.glob(graph.name + "*")):  # the graph and its external data
        if p.suffix != ".tmp":
            out[p.name] = M.sha256(p)
    return out


def _io(path: Path) -> tuple:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    g = model.graph

    def rows(values):
        return [{"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name,
                 "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]} for v in values]

    return rows(g.input), rows(g.output), _default_opset(model)  # the opset the graph really imports


def export_bundle(loaded: Any, config: ExportConfig, adapter: Any = None, prompts: Sequence[Sequence[int]] = (),
                  progress: bool = True, draft_ids: Any = None) -> M.Manifest:
    """Export `config.parts` of `loaded` (hat_split.models.loading.LoadedModel; its tokenizer may be None) in
    `config.precisions` into the bundle directory `config.out`, validate each artifact on `prompts` (token ids) and
    write the manifest. `adapter`: the draft module loaded from `config.adapter`, Λ (hat_split.models.adapter) for
    the hat parts or the feature drafter (hat_split.models.feature_drafter) for hat-feature; draft_ids: the feature
    part's head over these token ids (ascending), None: the whole head. Returns the manifest; artifacts that failed
    are in it, marked."""
    import onnx
    import onnxruntime
    from tqdm import tqdm

    parts, precisions, m, tail = config.part_kinds, config.precisions, config.m, config.tail
    model = loaded.model
    n = model.config.num_hidden_layers
    specs = part_specs(list(parts), n, m, tail)
    if any(s.adapter or s.drafter for s in specs) and adapter is None:
        raise ValueError(f"the {'feature' if any(s.drafter for s in specs) else 'adapter'} part needs a hat-distill "
                         "output (--adapter)")
    if any(s.drafter for s in specs) and getattr(adapter, "token_input", "shallow") != "shallow":
        raise ValueError(f"the feature part takes the tokens' shallow states; this drafter pairs features with token "
                         f"{adapter.token_input}s, which would need the embedding table in the feature part as well "
                         "(not exported): train one with hat-distill --token-input shallow")
    if draft_ids is not None and not any(s.drafter for s in specs):
        raise ValueError("a draft vocabulary is the feature part's head: export --parts hat-feature")
    if not prompts:
        raise ValueError("validation needs prompts")
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    fingerprint = model_fingerprint(model)
    man = M.read(out) if (out / M.MANIFEST).exists() else None
    if man is not None and man.model.get("fingerprint") != fingerprint:
        raise M.BundleError(f"{out} holds a bundle of {man.model.get('name')!r} with other weights: export into a new "
                            "directory")
    vocab = output_size(model)
    if man is None:
        tok = loaded.tokenizer
        man = M.Manifest(
            model={"name": loaded.name, "fingerprint": fingerprint,
                   "vocab_fingerprint": vocab_fingerprint(tok) if tok is not None else "",
                   "family": model.config.model_type, "layers": n, "hidden": model.config.hidden_size,
                   "vocab": vocab, "m": m, "tail": tail, "eos_ids": eos_ids(model, tok) if tok is not None else [],
                   "sliding_window": getattr(model.config, "sliding_window", None) or 0},
            device_profile=config.device_profile, hatspec_version=hatspec_version(),
            protocol_version=PROTOCOL_VERSION, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            tools={"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__})
    split_parts = any(s.name != "draft" for s in specs)
    if split_parts and any(a.part != "draft" for a in man.artifacts) and \
            (man.model.get("m"), man.model.get("tail")) != (m, tail):
        raise M.BundleError(f"{out} holds parts cut at m={man.model.get('m')}, tail={man.model.get('tail')}: export "
                            "this cut into a new directory")
    if split_parts:
        man.model["m"], man.model["tail"] = m, tail
    if adapter is not None:
        man.model["adapter"] = os.path.basename(os.path.normpath(config.adapter)) if config.adapter else "given"
    vocab_file: Dict[str, str] = {}
    if any(s.drafter for s in specs):
        man.model["draft_vocab"] = 0 if draft_ids is None else int(len(draft_ids))
        (out / M.DRAFT_VOCAB).unlink(missing_ok=True)
        if draft_ids is not None:
            np.save(out / M.DRAFT_VOCAB, np.asarray(draft_ids, dtype=np.int64))
            vocab_file = {M.DRAFT_VOCAB: M.sha256(out / M.DRAFT_VOCAB)}

    def rows(src: Any, s: PartSpec) -> Any:
        return head_rows(src, draft_ids) if s.drafter and draft_ids is not None else None
    if loaded.tokenizer is not None:  # a device needs no model directory: the bundle brings its tokenizer
        loaded.tokenizer.save_pretrained(str(out / "tokenizer"))
        man.tokenizer = {str(p.relative_to(out)): M.sha256(p) for p in sorted((out / "tokenizer").rglob("*"))
                         if p.is_file()}

    window = man.model["sliding_window"] or None
    reference = validation_chain([TorchPart(model, s, adapter, rows(model, s)) for s in specs], vocab, window)
    todo = [(prec, s) for prec in precisions for s in specs]
    bar = tqdm(total=len(todo) * 2, desc="hat-export onnx", unit="step", disable=not progress)
    scratch = out / ".fp32-for-quantization"
    done: List[str] = []  # precisions exported so far in this run
    try:
        for prec in precisions:
            paths = []
            for s in specs:
                path = out / f"{s.name}.{prec}.onnx"
                for old in out.glob(path.name + "*"):
                    old.unlink()
                bar.set_postfix_str(f"{s.name} {prec}: export")
                quant: Dict[str, Any] = {}
                if prec in ("fp32", "fp16"):
                    src_model, src_adapter = model, adapter
                    if prec == "fp16":
                        src_model = copy.deepcopy(model).half()
                        src_adapter = copy.deepcopy(adapter).half() if adapter is not None else None
                    export_graph(src_model, s, src_adapter, path, config.opset, rows=rows(src_model, s))
                else:  # from an fp32 graph with an untied head, shared by int8 and int4
                    src = _quantization_source(model, s, adapter, out, scratch, config.opset, "fp32" in done,
                                               rows(model, s))
                    quant = quantize_graph(src, path, int(prec[3:]), config.int4_embeddings)
                paths.append(path)
                bar.update()
            bar.set_postfix_str(f"{prec}: validate")
            chain = validation_chain([OrtPart(p, ["CPUExecutionProvider"], config.threads) for p in paths], vocab,
                                     window)
            figures = compare(reference, chain, prompts, Schedule())
            bar.update(len(specs))
            for s, path, part, fig in zip(specs, paths, chain.parts, figures):
                ok, reason = verdict(fig, prec, part.io.logits_out)
                inputs, outputs, graph_opset = _io(path)
                files = {**_files(out, path), **(vocab_file if s.drafter else {})}
                man.replace(M.Artifact(
                    part=s.name, precision=prec, backend="onnx", files=files,
                    sizes={f: (out / f).stat().st_size for f in files}, path=path.name, inputs=inputs,
                    outputs=outputs, layers=[s.start, s.stop], adapter=s.adapter, opset=graph_opset,
                    quantization=quant if prec in ("int8", "int4") else {},
                    validation={"regimes": fig, "thresholds": THRESHOLDS[prec], "prompts": len(prompts),
                                "providers": part.providers, "reason": reason, "reference": "torch float32"},
                    status="validated" if ok else "failed"))
            M.write(out, man)
            done.append(prec)
    finally:
        bar.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return man


def _quantization_source(model: Any, spec: PartSpec, adapter: Any, out: Path, scratch: Path, opset: int,
                         have_fp32: bool, rows: Any = None) -> Path:
    """The fp32 graph of `spec` with an untied head that int8 / int4 quantize: this run's fp32 artifact when it made
    one (itself when its head is not tied, else `untie_graph` of it), else a fresh export; kept in `scratch` for the
    next precision."""
    untied = scratch / f"{spec.name}.fp32.onnx"
    if untied.exists():
        return untied
    scratch.mkdir(exist_ok=True)
    exported = out / f"{spec.name}.fp32.onnx"
    if have_fp32:
        return untied if untie_graph(exported, untied) else exported
    export_graph(model, spec, adapter, untied, opset, untie=True, rows=rows)
    return untied


def hatspec_version() -> str:
    try:
        return version("hatspec")
    except PackageNotFoundError:
        return "unknown"
