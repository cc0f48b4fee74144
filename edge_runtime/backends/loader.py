"""Opening a hat-export bundle on the device: its tokenizer, the manifest it was checked against, and the part runners
(onnxruntime or TensorRT) the protocols need, each opened once and shared — the token protocols' draft chain, and the
split protocols' input part, Λ and output part (edge_runtime.backends.split_parts)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

from edge_runtime.backends.onnx_backend import OrtPart
from edge_runtime.backends.part_lm import PartChainLM, PartRunner
from edge_runtime.backends.split_parts import BundleSplitParts
from edge_runtime.backends.trt_backend import TrtPart
from edge_runtime.config import EdgeConfig
from hat_split.extras import need
from hat_split.files import bundle as M
from hat_split.models.loading import vocab_fingerprint
from hat_split.models.tokenizer import BundleTokenizer, TokenizerError

log = logging.getLogger(__name__)


@dataclass
class Bundle:
    manifest: M.Manifest
    tokenizer: Any
    root: Path
    config: EdgeConfig
    runners: Dict[str, PartRunner] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "onnx" if self.config.engine.backend == "onnxruntime" else "tensorrt"

    def part(self, name: str) -> PartRunner:
        """The runner of one part at the configured precision; refuses a failed or unvalidated artifact."""
        if name not in self.runners:
            c = self.config.engine
            path = self.root / self.manifest.usable(name, c.precision, self.kind).path
            if self.kind == "onnx":
                self.runners[name] = OrtPart(path, c.providers or None, c.threads, spin=not self.config.link.is_local)
            else:
                self.runners[name] = TrtPart(path)
        return self.runners[name]

    @property
    def window(self):
        return self.manifest.model.get("sliding_window") or None

    def draft_lm(self) -> PartChainLM:
        """The token protocols' draft: the whole draft model (token_draft "model") or input part → Λ → output part."""
        names = ["draft"] if self.config.engine.token_draft == "model" else ["input", "adapter", "output"]
        return PartChainLM([self.part(n) for n in names], self.manifest.model["vocab"], self.window,
                           self.config.split.slowdown)

    def drafters(self) -> List[str]:
        """The draft parts the bundle holds: "feature" (hat-export onnx --parts hat-feature), "adapter" (Λ, --parts
        hat), best first."""
        held = {a.part for a in self.manifest.artifacts}
        return [k for k in ("feature", "adapter") if k in held]

    def split_parts(self, drafter: str = "") -> BundleSplitParts:
        """The split protocols' parts: input and output, and for `hat` its draft part, "adapter" (Λ) or "feature"
        (the feature drafter, its draft vocabulary read from the bundle); "": U-shape."""
        precision = self.config.engine.precision
        if precision in ("int8", "int4"):
            log.warning("split protocols on %s parts: the input and output parts are part of the target, so its "
                        "tokens are the quantized model's, not the original's (fp32 / fp16 keep them)",
                        precision)
        if drafter not in ("", "adapter", "feature"):
            raise ValueError(f"unknown draft part {drafter!r}")
        feature = self.part("feature") if drafter == "feature" else None
        return BundleSplitParts(self.part("input"), self.part("output"),
                                self.part("adapter") if drafter == "adapter" else None, self.manifest.model,
                                self.window, feature,
                                M.read_draft_vocab(self.root, self.manifest.model) if feature else None)


def open_bundle(config: EdgeConfig) -> Bundle:
    """Verify the bundle (checksums, protocol version, vocabulary) and load its tokenizer (tokenizers + jinja2, no
    transformers: hat_split.models.tokenizer); parts open on first use."""
    if config.engine.backend == "onnxruntime":  # before the bundle: a missing engine is said first
        need("onnxruntime", "hat-edge --backend onnxruntime")
    root = Path(config.engine.bundle)
    man = M.load(root)
    if not man.tokenizer:
        raise M.BundleError(f"{root} has no tokenizer: it was exported from a model without one")
    try:
        tokenizer = BundleTokenizer(root / "tokenizer")
    except TokenizerError as exc:
        raise M.BundleError(str(exc)) from None
    if vocab_fingerprint(tokenizer) != man.model["vocab_fingerprint"]:
        raise M.BundleError(f"{root}: the tokenizer does not match the manifest's vocabulary fingerprint")
    return Bundle(man, tokenizer, root, config)
