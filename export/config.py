"""`ExportConfig`: what `hat-export onnx` and `hat-export tensorrt` build, as one typed config (a TOML file per bundle,
docs/CONFIG.md).

No torch, onnx or TensorRT: a config file is checked before any of them is loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

from hat_split.files.bundle import PRECISIONS
from hat_split.files.settings import setting

# The part sets a bundle is exported as (`parts`), each the parts of export.graphs.PartSpec it holds, in chain order.
PART_SETS: Dict[str, Tuple[str, ...]] = {"draft": ("draft",), "hat": ("input", "adapter", "output"),
                                         "hat-feature": ("input", "feature", "output"),
                                         "ushape": ("input", "output")}
# TensorRT parses fp32 and fp16 graphs only: int8 / int4 use onnxruntime's MatMulNBits.
TENSORRT_PRECISIONS = ("fp32", "fp16")
# ONNX opsets of the default domain the fp32 / fp16 graphs can be written in. torch's exporter (torch.onnx,
# dynamo=True) writes OPSET natively and converts up to 23 (onnxscript); 17, for TensorRT before 10 (8.5 on JetPack 5),
# is the opset-18 graph down-converted by export.onnx_export.convert_opset.
OPSET = 18
OPSETS = range(17, 24)


def _check_precisions(key: str, precisions: Tuple[str, ...], known: Tuple[str, ...], why: str = "") -> None:
    if not precisions:
        raise ValueError(f"{key} must name at least one precision of {', '.join(known)}")
    bad = [p for p in precisions if p not in known]
    if bad:
        raise ValueError(f"unknown precision(s) {', '.join(bad)} in {key}; known: {', '.join(known)}{why}")


@dataclass(frozen=True)
class TensorRTConfig:
    """`hat-export tensorrt`: engines built on the device from the bundle's ONNX artifacts (export.tensorrt_build)."""

    precisions: Tuple[str, ...] = setting(("fp16",), "fp32 | fp16: the ONNX artifacts engines are built from (fp16 "
                                          "halves memory and doubles tensor-core throughput on a Jetson)",
                                          flag="--precision", metavar="LIST")
    max_context: int = setting(2048, "positions: the longest cache + new positions an engine accepts (its profiles' "
                               "top)", metavar="N")
    max_chunk: int = setting(256, "positions: most new positions in one call (a prompt chunk); the \"prefill\" "
                             "profile's top", metavar="N")
    workspace_gb: float = setting(4.0, "GiB of scratch memory the builder may use per engine (TensorRT's WORKSPACE "
                                  "pool)", metavar="GIB")

    def __post_init__(self) -> None:
        _check_precisions("tensorrt.precisions", self.precisions, TENSORRT_PRECISIONS,
                          " (int8 / int4 use onnxruntime's MatMulNBits, which TensorRT cannot parse)")
        if not 1 <= self.max_chunk <= self.max_context:
            raise ValueError(f"tensorrt: max_chunk must be in 1..max_context={self.max_context} positions, got "
                             f"{self.max_chunk}")
        if not self.workspace_gb > 0:
            raise ValueError(f"tensorrt: workspace_gb must be > 0 GiB, got {self.workspace_gb}")


@dataclass(frozen=True)
class ExportConfig:
    """One bundle: which model, which parts in which precisions, validated how; `[tensorrt]` for its engines."""

    model: str = setting(help="registry name, HF directory or .gguf file: the weights exported and the torch "
                         "reference", metavar="NAME")
    out: str = setting(help="the bundle directory (created; an existing bundle of the same model gains or replaces "
                       "artifacts)", metavar="DIR")
    parts: str = setting("draft", "draft: the whole model as a draft; hat: input part, Λ and output part; "
                         "hat-feature: input part, the feature drafter and an output part that also gives the "
                         "features; ushape: input and output parts (PART_SETS)", choices=tuple(PART_SETS))
    m: int = setting(2, "layers in the input part (hat / ushape): HAT's cut; 2 keeps the device's share of the model "
                     "small", metavar="M")
    tail: int = setting(0, "layers kept beside the head in the output part (hat / ushape); 0: final norm and head "
                        "only", metavar="N")
    adapter: str = setting("", "hat / hat-feature: the hat-distill output directory Λ or the feature drafter is "
                           "loaded from (\"\" for draft / ushape)", metavar="DIR")
    draft_vocab: int = setting(0, "hat-feature: the feature part's head over the N most frequent tokens of the "
                               "drafter's training data (its draft_vocab.npy); 0: the whole head", metavar="N")
    precisions: Tuple[str, ...] = setting(("fp32", "int8", "int4"), "weights of the ONNX artifacts: fp32 | fp16 | "
                                          "int8 | int4 (int8 / int4 weight-only: smaller, faster drafts)",
                                          flag="--precision", metavar="LIST")
    opset: int = setting(OPSET, "ONNX opset of the fp32 / fp16 graphs, 17..23; 17 for TensorRT before 10 (8.5 on "
                         "JetPack 5), which misreads opset 18's ReduceMean; int4 graphs are lifted to 21 by the "
                         "quantizer", metavar="N")
    int4_embeddings: bool = setting(True, "int4 quantizes the embedding table too (GatherBlockQuantized: onnxruntime "
                                    ">= 1.20); false: its MatMuls only, which onnxruntime 1.17+ runs (Python 3.8 / "
                                    "JetPack 5 stops at 1.19)")
    device_profile: str = setting("any", "the device profile the bundle targets (hardware/devices); any: every "
                                  "device", metavar="NAME")
    prompts: int = setting(4, "real prompts every artifact is validated on (half HumanEval, half ShareGPT); more: "
                           "slower", metavar="N")
    threads: int = setting(0, "onnxruntime intra-op threads while validating; 0: onnxruntime's default (every core)",
                           metavar="N")
    tensorrt: TensorRTConfig = setting(help="`hat-export tensorrt` of this bundle", factory=TensorRTConfig)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must be given: the model to export (a registry name, HF directory or .gguf file)")
        if not self.out:
            raise ValueError("out must be given: the bundle directory")
        if self.parts not in PART_SETS:
            raise ValueError(f"parts must be one of {', '.join(PART_SETS)}, got {self.parts!r}")
        _check_precisions("precisions", self.precisions, PRECISIONS)
        if self.opset not in OPSETS:
            raise ValueError(f"opset must be in {OPSETS[0]}..{OPSETS[-1]} (torch's exporter writes {OPSET} and "
                             f"converts up to {OPSETS[-1]}; 17 is converted down from {OPSET}), got {self.opset}")
        quantized = [p for p in self.precisions if p not in TENSORRT_PRECISIONS]
        if self.opset < OPSET and quantized:
            raise ValueError(f"opset {self.opset} is for TensorRT 8.x bundles, which use fp32 / fp16 only; "
                             f"{', '.join(quantized)} use onnxruntime's MatMulNBits, which TensorRT cannot parse: "
                             f"give --precision fp16 (or fp32,fp16) and export {', '.join(quantized)} at the default "
                             f"opset in a run of their own")
        if self.parts != "draft" and self.m < 1:
            raise ValueError(f"m must be >= 1 layer for the {self.parts} parts (layer 0 stays on the device), got "
                             f"{self.m}")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be >= 0 tokens (0: the whole head), got {self.draft_vocab}")
        if self.draft_vocab and self.parts != "hat-feature":
            raise ValueError(f"draft_vocab is the feature part's head: it needs parts hat-feature, not {self.parts}")
        if self.tail < 0:
            raise ValueError(f"tail must be >= 0 layers, got {self.tail}")
        if self.prompts < 1:
            raise ValueError(f"prompts must be >= 1 (every artifact is validated), got {self.prompts}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: onnxruntime's default), got {self.threads}")

    @property
    def part_kinds(self) -> Tuple[str, ...]:
        """The export.graphs part kinds of `parts`, in chain order."""
        return PART_SETS[self.parts]
