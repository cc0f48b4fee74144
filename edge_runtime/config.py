"""The device's one typed configuration."""
from __future__ import annotations

from dataclasses import dataclass

from hat_split.dist_codec import WIRE_DTYPES

PROTOCOLS = ("sd", "hlm", "llm", "slm")  # implemented in edge_runtime.protocols


@dataclass(frozen=True)
class EdgeConfig:
    model: str  # registry short name, HF directory or .gguf path of the draft (small) model
    server: str = "tcp://127.0.0.1:5555"  # the cloud's ZeroMQ endpoint (or a link emulator in front of it)
    device_id: str = "edge-0"  # shown in the cloud's logs
    draft_len: int = 4  # γ, drafts per round for `sd` (`hlm` always drafts 1)
    dist_dtype: str = "float16"  # wire dtype of draft distributions; the draft is sampled from the rounded values
    dist_format: str = "auto"  # "dense" | "sparse" | "auto" (smaller of the two); `hlm` always sends dense
    llm_chunk: int = 8  # tokens per Generate round for `llm` (trades streaming granularity for round trips)
    connect_timeout_s: float = 5.0  # wait for the handshake reply per attempt
    connect_retries: int = 3  # handshake attempts before giving up with a clear error
    backoff_s: float = 0.5  # first retry delay, doubled per attempt
    request_timeout_s: float = 120.0  # one verify/generate round trip (a slow CPU target needs seconds)
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("EdgeConfig.model must name a model")
        if not self.server.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"server must be a ZeroMQ endpoint like tcp://host:5555, got {self.server!r}")
        if not 1 <= self.draft_len <= 64:
            raise ValueError(f"draft_len must be in 1..64, got {self.draft_len}")
        if self.dist_dtype not in WIRE_DTYPES:
            raise ValueError(f"dist_dtype must be one of {WIRE_DTYPES}, got {self.dist_dtype!r}")
        if self.dist_format not in ("dense", "sparse", "auto"):
            raise ValueError(f"dist_format must be dense, sparse or auto, got {self.dist_format!r}")
        if self.llm_chunk < 1 or self.connect_retries < 1 or self.threads < 0:
            raise ValueError("llm_chunk and connect_retries must be >= 1, threads >= 0")
        for name in ("connect_timeout_s", "backoff_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
