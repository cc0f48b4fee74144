"""A bundle: the exported artifacts of one model for one device profile, and `manifest.json` describing them.

The manifest records the model (name, weight fingerprint, vocabulary fingerprint, shape), every artifact (part, file
and its external-data file, sha256 and size, inputs and outputs with dtypes and shapes, opset, precision,
quantization, validation figures and verdict), the hatspec and wire-protocol versions, and the device profile the
bundle targets. Loading a bundle checks all of it and refuses, with the reason, a bundle that was tampered with, is
incomplete, was made by an incompatible hatspec, or does not match what the caller expects.

The names of a part's graph inputs and outputs are part of the contract as well (below): the exporter
(export.graphs) writes graphs with them and the device's runners (edge_runtime.backends) feed and read them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from hat_split.files.atomic import write_json
from hat_split.wire.messages import PROTOCOL_VERSION

FORMAT = "hatspec-bundle/1"
MANIFEST = "manifest.json"
PARTS = ("draft", "input", "adapter", "feature", "output")  # an artifact's part (export.graphs.PartSpec), chain order
PRECISIONS = ("fp32", "fp16", "int8", "int4")  # an artifact's weights (int8 / int4: weight-only, float activations)

# A part's graph inputs, in this order (a name absent from a graph is an input the part does not take):
X = "x"  # int64 token ids `# [1, n]` (a part with the embeddings) or states `# [1, n, hidden]`
POSITION_IDS = "position_ids"  # int64 `# [1, n]`: absolute positions of the n new tokens
TOKENS = "tokens"  # the feature part's: `# [1, n, hidden]` the shallow states of the pairs' tokens (x: the features)
MASK = "mask"  # additive causal mask `# [1, 1, n, past + n]` (hat_split.math.masks)
MASK_SLIDING = "mask_sliding"  # the same within the sliding window, when a part has a sliding-window layer
LOGIT_INDEX = "logit_index"  # int64 `# [k]`: the positions whose logits a part with the head returns
PAST_KEY, PAST_VALUE = "past_key_", "past_value_"  # + layer: cache `# [1, kv_heads, past, head_dim]` per layer
# ... and its outputs: the states or the logits first, then each cached layer's grown cache (past ++ new).
HIDDEN = "hidden"  # `# [1, n, hidden]`
LOGITS = "logits"  # float32 `# [1, k, vocab]`
FEATURES = "features"  # after the logits, where a part gives them: `# [1, n, hidden]` the normed features the head
# reads (an output part exported for the feature drafter; the feature part: its predicted ones, f̂)
DRAFT_VOCAB = "feature.vocab.npy"  # the feature part's head rows' token ids (int64, ascending), when over a subset
PRESENT_KEY, PRESENT_VALUE = "present_key_", "present_value_"  # + layer: `# [1, kv_heads, past + n, head_dim]`


def read_draft_vocab(root: Path | str, model: Dict[str, Any]) -> Optional[Any]:
    """The feature part's draft-vocabulary ids (int64 numpy, ascending) of the bundle at `root` whose manifest's
    model record is `model`; None when its head is the whole vocabulary."""
    if not model.get("draft_vocab"):
        return None
    import numpy as np

    return np.load(Path(root) / DRAFT_VOCAB).astype(np.int64)


def past_names(layer: int) -> Tuple[str, str]:
    """The cache inputs of one layer: (key, value)."""
    return f"{PAST_KEY}{layer}", f"{PAST_VALUE}{layer}"


def present_names(layer: int) -> Tuple[str, str]:
    """The grown cache outputs of one layer: (key, value)."""
    return f"{PRESENT_KEY}{layer}", f"{PRESENT_VALUE}{layer}"


class BundleError(ValueError):
    """A bundle that must not be used, and why."""


@dataclass
class Artifact:
    part: str  # draft | input | adapter | output (export.graphs.PartSpec)
    precision: str  # fp32 | fp16 | int8 | int4 (weights; int8 / int4 are weight-only, activations in fp32)
    backend: str  # onnx | tensorrt
    files: Dict[str, str]  # relative path -> sha256 (the graph, its external data, an engine)
    sizes: Dict[str, int]  # relative path -> bytes
    path: str  # the file a runtime opens
    inputs: List[Dict[str, Any]]  # [{name, dtype, shape}] with symbolic dims as strings
    outputs: List[Dict[str, Any]]
    layers: List[int]  # [start, stop) of the model's layers
    adapter: bool
    opset: int = 0
    quantization: Dict[str, Any] = field(default_factory=dict)  # method, bits, block size, accuracy level
    validation: Dict[str, Any] = field(default_factory=dict)  # figures per regime, thresholds
    status: str = "unvalidated"  # validated | failed | unvalidated
    build: Dict[str, Any] = field(default_factory=dict)  # tensorrt: version, profiles, flags


@dataclass
class Manifest:
    model: Dict[str, Any]  # name, fingerprint, vocab_fingerprint, family, layers, hidden, vocab, m, tail, adapter
    device_profile: str
    hatspec_version: str
    protocol_version: int
    created: str
    tools: Dict[str, str]  # versions of torch, onnx, onnxruntime, tensorrt used
    artifacts: List[Artifact] = field(default_factory=list)
    tokenizer: Dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    format: str = FORMAT

    def find(self, part: str, precision: str, backend: str = "onnx") -> Artifact:
        for a in self.artifacts:
            if (a.part, a.precision, a.backend) == (part, precision, backend):
                return a
        have = ", ".join(sorted(f"{a.part}/{a.precision}/{a.backend}" for a in self.artifacts)) or "nothing"
        raise BundleError(f"the bundle has no {part}/{precision}/{backend} artifact (it has {have})")

    def usable(self, part: str, precision: str, backend: str = "onnx", allow_unvalidated: bool = False) -> Artifact:
        """The artifact a runtime may open: validated against torch (or explicitly allowed otherwise)."""
        a = self.find(part, precision, backend)
        if a.status != "validated" and not allow_unvalidated:
            raise BundleError(f"artifact {part}/{precision}/{backend} is {a.status}: it did not pass validation "
                              f"against torch ({a.validation.get('reason', 'not run')})")
        return a

    def replace(self, artifact: Artifact) -> None:
        self.artifacts = [a for a in self.artifacts
                          if (a.part, a.precision, a.backend) != (artifact.part, artifact.precision, artifact.backend)]
        self.artifacts.append(artifact)


def sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def write(bundle: Path, manifest: Manifest) -> Path:
    """Write manifest.json atomically (a reader never sees half a manifest)."""

    path = Path(bundle) / MANIFEST
    write_json(path, asdict(manifest), indent=1)
    return path


def read(bundle: Path) -> Manifest:
    """The manifest, structurally checked (no file checksums: `load` does those)."""
    path = Path(bundle) / MANIFEST
    if not path.is_file():
        raise BundleError(f"{bundle} is not a bundle: no {MANIFEST}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BundleError(f"{path} is unreadable: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        fmt = raw.get("format") if isinstance(raw, dict) else None
        raise BundleError(f"{path}: format {fmt!r} is not {FORMAT!r} (a newer or foreign bundle)")
    try:
        arts = [Artifact(**a) for a in raw.pop("artifacts")]
        return Manifest(artifacts=arts, **raw)
    except (TypeError, KeyError) as exc:
        raise BundleError(f"{path} is malformed: {exc}") from exc


def check_files(bundle: Path, files: Dict[str, str]) -> None:
    """Every listed file exists, stays inside the bundle and has its recorded sha256."""
    root = Path(bundle).resolve()
    for rel, digest in files.items():
        path = (root / rel).resolve()
        if root not in path.parents:
            raise BundleError(f"manifest entry {rel!r} points outside the bundle")
        if not path.is_file():
            raise BundleError(f"{rel} is missing from the bundle {bundle}")
        got = sha256(path)
        if got != digest:
            raise BundleError(f"{rel} does not match its checksum (sha256 {got[:16]}…, manifest {digest[:16]}…): "
                              "the file was modified or damaged; export or flash the bundle again")


def load(bundle: Path, model_fingerprint: Optional[str] = None, vocab_fingerprint: Optional[str] = None,
         device_profile: Optional[str] = None) -> Manifest:
    """Read and verify a bundle: format, protocol version, checksums of every file, and (when given) that it is for
    this model / vocabulary / device profile."""

    man = read(bundle)
    if man.protocol_version != PROTOCOL_VERSION:
        raise BundleError(f"the bundle was made for hatspec protocol v{man.protocol_version}; this hatspec speaks "
                          f"v{PROTOCOL_VERSION}: export it again with this version")
    if model_fingerprint is not None and man.model.get("fingerprint") != model_fingerprint:
        raise BundleError(f"the bundle holds {man.model.get('name')!r} (weights {man.model.get('fingerprint')}), not "
                          f"the expected model (weights {model_fingerprint})")
    if vocab_fingerprint is not None and man.model.get("vocab_fingerprint") != vocab_fingerprint:
        raise BundleError("the bundle's vocabulary differs from the expected one: its tokens would mean other text")
    if device_profile is not None and man.device_profile not in (device_profile, "any"):
        raise BundleError(f"the bundle targets device profile {man.device_profile!r}, not {device_profile!r}")
    check_files(bundle, man.tokenizer)
    for a in man.artifacts:
        check_files(bundle, a.files)
    return man
