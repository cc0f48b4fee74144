"""The cloud server's one typed configuration."""
from __future__ import annotations

from dataclasses import dataclass

from hat_split.wire.messages import DEFAULT_MAX_MESSAGE_BYTES
from hat_split.models.registry import MODEL_DTYPES
from hat_split.net.security import LinkSecurity


@dataclass(frozen=True)
class CloudConfig:
    model: str  # registry short name, HF directory or .gguf path of the target (large) model
    bind: str = "tcp://127.0.0.1:5555"  # ZeroMQ endpoint the ROUTER socket binds
    session_timeout_s: float = 120.0  # a session silent this long is dropped and its KV cache freed
    max_sessions: int = 64  # concurrent sessions; more are refused with an Error("busy")
    max_draft_len: int = 16  # longest draft accepted in one Verify (bounds verify latency and memory)
    max_context: int = 8192  # prompt + generated tokens per session (bounds KV memory)
    max_generate: int = 256  # tokens one Generate request may ask for
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # larger requests are refused unread
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default (all cores)
    dtype: str = "auto"  # model dtype; "auto": bfloat16 where matmuls have it in hardware (hat_split.models.loading.resolve_dtype)
    poll_ms: int = 200  # how often the loop wakes to expire idle sessions when no message arrives
    token_budget: int = 512  # split protocols: positions per batched step, all sessions (cloud_runtime.scheduler)
    prefill_floor: int = 64  # of each step, kept for waiting prompt work
    kv_positions: int = 1 << 18  # middle-part KV cache positions, all sessions together
    security: LinkSecurity = LinkSecurity()  # CurveZMQ with an allow-list unless plaintext is asked for
    stats_json: str = ""  # on exit, write the server's counters and per-step log here (benchmarks)
    status_file: str = ""  # while serving, rewrite the same report here every status_interval_s (hat-fleet status)
    status_interval_s: float = 5.0
    pipeline: int = 1  # stages of the middle layers, one torch.distributed process each (cloud_runtime.pipeline)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("CloudConfig.model must name a model")
        self.security.check("cloud")
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"bind must be a ZeroMQ endpoint like tcp://0.0.0.0:5555, got {self.bind!r}")
        for name in ("session_timeout_s", "status_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        for name in ("max_sessions", "max_draft_len", "max_context", "max_generate", "max_message_bytes", "poll_ms",
                     "token_budget", "kv_positions", "pipeline"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.token_budget < self.max_draft_len + 1:
            raise ValueError(f"token_budget={self.token_budget} cannot hold a verify of max_draft_len + 1 = "
                             f"{self.max_draft_len + 1} positions")
        if not 0 <= self.prefill_floor <= self.token_budget:
            raise ValueError(f"prefill_floor must be in [0, token_budget={self.token_budget}]")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")
