"""onnxruntime part runners: execution providers chosen TensorRT → CUDA → CPU, and the ones actually used reported.

onnxruntime drops a provider it cannot start without an error (onnxruntime-gpu on a machine without CUDA runs on the
CPU); the providers a session really has come from `session.get_providers()` after it is created, and a fallback is
logged and kept on the runner (`providers`, `fallback`) so a benchmark records what it measured.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Sequence

import numpy as np

from edge_runtime.backends.part_lm import PartIO, PartRunner
from hat_split.extras import need

log = logging.getLogger(__name__)
PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
               "tensor(int32)": np.int32}


def choose_providers(requested: Optional[Sequence[str]] = None) -> List[str]:
    """The providers to ask for: `requested` (each must be available), or every available one in PREFERENCE order."""
    ort = need("onnxruntime", "the onnxruntime backend")

    available = ort.get_available_providers()
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise ValueError(f"execution provider(s) {', '.join(missing)} are not in this onnxruntime build "
                             f"(available: {', '.join(available)})")
        return list(requested)
    return [p for p in PREFERENCE if p in available]


def cannot_load(path, error: str, version: str) -> str:
    """One line: why this onnxruntime cannot open the artifact, and what to do."""
    first = " ".join(error.split())[-300:]
    hint = ""
    if "is not a registered function/op" in error:
        hint = (f"; the artifact uses an operator newer than onnxruntime {version} (int4 artifacts use "
                "GatherBlockQuantized, onnxruntime >= 1.20; Python 3.8 / JetPack 5 stops at 1.19): export int4 "
                "for it with hat-export onnx --no-int4-embeddings, run another precision, or a newer onnxruntime")
    return f"onnxruntime {version} cannot open {os.path.basename(str(path))}: {first}{hint}"


class OrtPart(PartRunner):
    def __init__(self, path: str | os.PathLike, providers: Optional[Sequence[str]] = None, threads: int = 0,
                 spin: bool = True):
        """spin: let idle worker threads spin between calls (lower latency on a device of its own; on a host shared
        with the cloud they would take its cores)."""
        ort = need("onnxruntime", "the onnxruntime backend")
        opts = ort.SessionOptions()
        if not spin:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        self.requested = choose_providers(providers)
        try:
            self.session = ort.InferenceSession(str(path), sess_options=opts, providers=self.requested)
        except Exception as exc:  # onnxruntime's own Fail / InvalidGraph / NotImplemented
            if not type(exc).__module__.startswith("onnxruntime"):
                raise
            raise ValueError(cannot_load(path, str(exc), ort.__version__)) from None
        self.providers = list(self.session.get_providers())
        self.fallback = [p for p in self.requested if p not in self.providers]
        if self.fallback:
            log.warning("onnxruntime could not start %s for %s; running on %s", ", ".join(self.fallback),
                        os.path.basename(str(path)), ", ".join(self.providers))
        inputs = []
        for i in self.session.get_inputs():
            if i.type not in _ORT_DTYPES:
                raise ValueError(f"{path}: input {i.name} has unsupported type {i.type}")
            inputs.append((i.name, _ORT_DTYPES[i.type], i.shape))
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.io = PartIO.from_inputs(inputs, self.output_names)

    def run(self, feed: Dict[str, np.ndarray]) -> List[np.ndarray]:
        return self.session.run(self.output_names, feed)
