"""Opening a hat-export bundle as the device's draft: the chain of parts for the token protocols on onnxruntime or
TensorRT, its tokenizer, and the manifest it was checked against."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_runtime.config import EdgeConfig, server_is_local
from edge_runtime.part_lm import PartChainLM
from export import manifest as M


@dataclass
class Bundle:
    manifest: M.Manifest
    lm: PartChainLM
    tokenizer: Any


def open_bundle(config: EdgeConfig) -> Bundle:
    """Verify the bundle (checksums, protocol version, vocabulary) and open the draft chain config asks for: the whole
    draft model (token_draft "model"), or HAT's input part → Λ → output part ("adapter")."""
    from transformers import AutoTokenizer

    from hat_split.loading import vocab_fingerprint

    root = Path(config.bundle)
    man = M.load(root)
    if not man.tokenizer:
        raise M.BundleError(f"{root} has no tokenizer: it was exported from a model without one")
    tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"))
    if vocab_fingerprint(tokenizer) != man.model["vocab_fingerprint"]:
        raise M.BundleError(f"{root}: the tokenizer does not match the manifest's vocabulary fingerprint")
    parts = ["draft"] if config.token_draft == "model" else ["input", "adapter", "output"]
    kind = "onnx" if config.backend == "onnxruntime" else "tensorrt"
    runners = []
    for part in parts:
        artifact = man.usable(part, config.precision, kind)
        path = root / artifact.path
        if kind == "onnx":
            from edge_runtime.onnx_backend import OrtPart

            runners.append(OrtPart(path, config.providers or None, config.threads,
                                   spin=not server_is_local(config.server)))
        else:
            from edge_runtime.trt_backend import TrtPart

            runners.append(TrtPart(path))
    lm = PartChainLM(runners, man.model["vocab"], man.model.get("sliding_window") or None, config.split.slowdown)
    return Bundle(man, lm, tokenizer)
