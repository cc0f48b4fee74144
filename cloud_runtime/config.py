"""The cloud server's one typed configuration: `hat-cloud serve` flags, or a TOML file (`--config FILE`, read by
hat_split.files.config_file: keys as the fields below, `[security]` a table; unknown keys and wrong types are
refused with the key's name), checked here."""
from __future__ import annotations

import math
from dataclasses import dataclass

from cloud_runtime.quotas import parse_bytes
from hat_split.models.llamacpp_rpc import parse_endpoints
from hat_split.models.placement import check_device
from hat_split.models.registry import MODEL_DTYPES
from hat_split.files.settings import setting
from hat_split.net.security import LinkSecurity
from hat_split.wire.messages import DEFAULT_MAX_MESSAGE_BYTES, MAX_PACE

ENGINES = ("torch", "llamacpp")
KV_LAYOUTS = ("auto", "slots", "dynamic")
GRAPHS = ("auto", "on", "off")


@dataclass(frozen=True)
class CloudConfig:
    model: str = setting(help="registry short name, HF directory or .gguf path of the target (large) model")
    bind: str = setting("tcp://127.0.0.1:5555", "ZeroMQ endpoint the ROUTER socket binds (loopback: a lab by "
                        "default)")
    session_timeout_s: float = setting(120.0, "seconds: a session silent this long is dropped and its KV cache "
                                       "freed")
    max_sessions: int = setting(64, "concurrent sessions; more are refused with an Error(\"busy\")")
    max_draft_len: int = setting(16, "tokens: longest draft accepted in one Verify (bounds verify latency and "
                                 "memory)")
    max_tree_nodes: int = setting(64, "nodes: largest draft tree accepted in one Verify (hat_split.math.tree; "
                                  "verified in one forward; at most token_budget - 1; llama.cpp: also within the "
                                  "sequence ids its sessions leave free); 0: chains only")
    max_tree_depth: int = setting(8, "levels: deepest draft tree accepted in one Verify")
    max_context: int = setting(8192, "tokens (positions) per session, prompt + generated (bounds KV memory)")
    max_generate: int = setting(256, "tokens one Generate request may ask for (bounds one request's time)")
    max_message_bytes: int = setting(DEFAULT_MAX_MESSAGE_BYTES, "bytes: larger requests are refused unread")
    threads: int = setting(0, "torch intra-op threads, or llama.cpp's; 0 keeps their default (all cores)")
    device: str = setting("auto", "torch engine: where the model runs: auto (the first CUDA GPU when present, else "
                          "the CPU) | cpu | cuda | cuda:N (hat_split.models.placement); pipeline stages on CUDA "
                          "take the GPU of their local rank", metavar="auto|cpu|cuda|cuda:N")
    dtype: str = setting("auto", "model dtype; \"auto\": bfloat16 where the device multiplies it in hardware (CPU: "
                         "AMX / AVX512-BF16; CUDA: Ampere and later), float16 on older GPUs (Volta), else float32 "
                         "(hat_split.models.loading)", choices=MODEL_DTYPES)
    kv_layout: str = setting("auto", "slots: every session's KV in preallocated slots of max_context positions (as "
                             "many as kv_positions holds; later sessions get growing caches) | dynamic: growing "
                             "caches | auto: slots on CUDA", choices=KV_LAYOUTS)
    graphs: str = setting("auto", "on: decode / verify steps on slots run as captured CUDA graphs (bucketed "
                          "shapes, cloud_runtime.buckets; other shapes eager) | off | auto: on where the device is "
                          "CUDA", choices=GRAPHS)
    poll_ms: int = setting(200, "milliseconds: how often the idle loop wakes to expire sessions and write the "
                           "status file")
    heap_trim_s: float = setting(60.0, "seconds between two returns of the C heap's free pages to the system while "
                                 "sessions are open; also done once when the last session closes (hat_split.heap); "
                                 "0: never")
    token_budget: int = setting(512, "positions per batched step, all sessions (cloud_runtime.scheduler): bounds "
                                "step latency")
    prefill_floor: int = setting(64, "positions of each step kept for waiting prompt work, so decoding cannot "
                                 "starve it")
    usage_half_life: int = setting(4096, "positions computed over which a device's recent usage halves; a device "
                                   "well over the mean of those with work waits for theirs, its prompts at most "
                                   "prefill_floor a step meanwhile (0: off)")
    kv_positions: int = setting(1 << 18, "KV cache positions of the batched steps, all sessions together (memory "
                                "bound)")
    kv_memory: str = setting("auto", "bytes of KV cache all sessions together may hold, each position at its "
                             "session's cost (a size: 8GiB, 512MiB; or auto: the KV slots plus half the memory "
                             "free on the model's device at start, logged)", metavar="SIZE")
    device_sessions: int = setting(16, "quota: sessions one device may hold at once (0: only max_sessions)")
    device_kv_memory: str = setting("100%", "quota: KV cache one device may hold: a size, or a percentage of "
                                    "kv_memory (by default none below the cloud's own: fair-share eviction keeps "
                                    "room for the others)", metavar="SIZE|PCT")
    device_in_flight: int = setting(16, "quota: requests of one device being computed at once (0: no quota)")
    fleet_pace_tokens_per_s: float = setting(0.0, "tokens/s asked of each device whose auto request names no SLA "
                                             "of its own, while other devices use the cloud: such a device keeps "
                                             "this pace at the least cloud compute a token instead of running its "
                                             "fastest (docs/AUTO.md); 0: off",
                                             flag="--fleet-pace-tokens-per-s")
    device_prompt_tokens_per_min: int = setting(0, "quota: prompt positions one device may send per minute (0: no "
                                                "quota) (a device's allow-list entry may carry its own: "
                                                "NAME.quota.toml beside NAME.key, docs/SECURITY.md)")
    security: LinkSecurity = LinkSecurity()  # CurveZMQ with an allow-list unless mode = "plaintext" (a lab only)
    stats_json: str = setting("", "path: on exit, write the server's counters and per-step log here (benchmarks); "
                              "\"\" none", metavar="PATH")
    status_file: str = setting("", "path: while serving, rewrite the same report here (hat-fleet status); \"\" "
                               "none", metavar="PATH")
    status_interval_s: float = setting(5.0, "seconds between two status files (each costs a report and a write)")
    metrics_port: int = setting(0, "TCP port of the Prometheus endpoint (GET /metrics, docs/METRICS.md) on the "
                                "host `bind` names (0.0.0.0 for *, loopback for ipc / inproc); 0: off")
    dashboard_port: int = setting(0, "TCP port of the fleet dashboard (GET /: the page, GET /fleet.json; "
                                  "docs/DASHBOARD.md) on the same host as the metrics; 0: off")
    pipeline: int = setting(1, "stages of the layers, one torch.distributed process each (cloud_runtime.pipeline)")
    engine: str = setting("torch", "what runs the target: torch (every protocol) | llamacpp (the model's GGUF file "
                          "on llama.cpp, quantised as shipped: the token protocols, every session's work in one "
                          "llama_decode per step)", choices=ENGINES)
    n_ctx: int = setting(16384, "llamacpp: KV positions of all sessions together (the llama.cpp context's size: "
                         "memory)")
    n_batch: int = setting(512, "llamacpp: positions per llama_decode; a step's token budget is at most this (one "
                           "llama_decode per step)")
    n_gpu_layers: int = setting(-1, "llamacpp: layers on the offload devices (a CUDA build's GPUs, the rpc "
                                "servers); -1 all")
    rpc: str = setting("", "llamacpp: HOST:PORT,... of RPC servers (hat-cloud rpc-server on each host) the model's "
                       "layers are spread over, instead of this machine; \"\" none", metavar="HOST:PORT,...")

    @property
    def tree_nodes(self) -> int:
        """The largest draft tree one Verify may carry: max_tree_nodes, within one step's token_budget (its verify
        is one segment of nodes + 1 positions)."""
        return min(self.max_tree_nodes, self.token_budget - 1)

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model must name a model (registry name, HF directory or .gguf file)")
        self.security.check("cloud")
        if not self.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"bind must be a ZeroMQ endpoint like tcp://0.0.0.0:5555, got {self.bind!r}")
        for name in ("session_timeout_s", "status_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 s, got {getattr(self, name)}")
        for name in ("max_sessions", "max_draft_len", "max_context", "max_generate", "max_message_bytes", "poll_ms",
                     "token_budget", "kv_positions", "pipeline"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.token_budget < self.max_draft_len + 1:
            raise ValueError(f"token_budget={self.token_budget} cannot hold a verify of max_draft_len + 1 = "
                             f"{self.max_draft_len + 1} positions")
        if not 0 <= self.max_tree_nodes <= 1024 or not 1 <= self.max_tree_depth <= 64:
            raise ValueError(f"max_tree_nodes must be in 0..1024 and max_tree_depth in 1..64, got "
                             f"{self.max_tree_nodes}, {self.max_tree_depth}")
        if not 0 <= self.prefill_floor <= self.token_budget:
            raise ValueError(f"prefill_floor must be in [0, token_budget={self.token_budget}], "
                             f"got {self.prefill_floor}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if not (math.isfinite(self.fleet_pace_tokens_per_s) and 0 <= self.fleet_pace_tokens_per_s <= MAX_PACE):
            raise ValueError(f"fleet_pace_tokens_per_s must be tokens/s in [0, {MAX_PACE:g}] (0: off), got "
                             f"{self.fleet_pace_tokens_per_s}")
        if self.heap_trim_s < 0:
            raise ValueError(f"heap_trim_s must be >= 0 s (0: never), got {self.heap_trim_s}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a TCP port in 1..65535 (0: off), got {self.metrics_port}")
        if self.metrics_port and self.bind.startswith("tcp://") and self.bind.rpartition(":")[2] == str(
                self.metrics_port):
            raise ValueError(f"metrics_port {self.metrics_port} is the port of the ZeroMQ socket ({self.bind}): "
                             "give the metrics another")
        if not 0 <= self.dashboard_port <= 65535:
            raise ValueError(f"dashboard_port must be a TCP port in 1..65535 (0: off), got {self.dashboard_port}")
        if self.dashboard_port and self.bind.startswith("tcp://") and self.bind.rpartition(":")[2] == str(
                self.dashboard_port):
            raise ValueError(f"dashboard_port {self.dashboard_port} is the port of the ZeroMQ socket ({self.bind}): "
                             "give the dashboard another")
        if self.dashboard_port and self.dashboard_port == self.metrics_port:
            raise ValueError(f"dashboard_port {self.dashboard_port} is metrics_port too: give each its own port")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "llamacpp" and self.pipeline > 1:
            raise ValueError("pipeline stages run on the torch engine; a llama.cpp cloud runs in one process")
        if self.n_ctx < 8 or self.n_batch < 1:
            raise ValueError(f"n_ctx must be >= 8 positions and n_batch >= 1, got {self.n_ctx}, {self.n_batch}")
        if self.n_gpu_layers < -1:
            raise ValueError(f"n_gpu_layers must be >= 0, or -1 for every layer, got {self.n_gpu_layers}")
        parse_endpoints(self.rpc)  # names a bad endpoint
        if self.rpc and self.engine != "llamacpp":
            raise ValueError("rpc servers run the llamacpp engine (engine = llamacpp); the torch engine's cloud larger "
                             "than one machine is its pipeline stages (pipeline)")
        if self.engine == "llamacpp" and self.n_batch < self.max_draft_len + 1:
            raise ValueError(f"n_batch={self.n_batch} cannot hold a verify of max_draft_len + 1 = "
                             f"{self.max_draft_len + 1} positions in one llama_decode")
        check_device(self.device)
        if self.kv_memory != "auto":
            parse_bytes(self.kv_memory, "kv_memory")
        device_kv_share(self.device_kv_memory, 1)  # names a bad value
        for name in ("device_sessions", "device_in_flight", "device_prompt_tokens_per_min", "usage_half_life"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: off), got {getattr(self, name)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {', '.join(KV_LAYOUTS)}, got {self.kv_layout!r}")
        if self.graphs not in GRAPHS:
            raise ValueError(f"graphs must be one of {', '.join(GRAPHS)}, got {self.graphs!r}")
        if self.graphs == "on" and self.kv_layout == "dynamic":
            raise ValueError("graphs = on replays steps on the slot layout: kv_layout must be slots or auto")
        if self.engine == "llamacpp" and self.device != "auto":
            raise ValueError("device places the torch engine; llama.cpp offloads layers with n_gpu_layers")
        if self.pipeline > 1 and self.device.startswith("cuda:"):
            raise ValueError("pipeline stages on CUDA take the GPU of their local rank: give device = cuda (or auto)")
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(MODEL_DTYPES)}, got {self.dtype!r}")


def device_kv_share(text: str, kv_bytes: int) -> int:
    """A device's KV quota in bytes: a size, or a percentage of the cloud's `kv_bytes` ("0" or "0%": no quota)."""
    if isinstance(text, str) and text.strip().endswith("%"):
        try:
            pct = float(text.strip()[:-1])
        except ValueError:
            pct = -1.0
        if not 0 <= pct <= 100:
            raise ValueError(f"device_kv_memory must be a size or a percentage in 0..100%, got {text!r}")
        return int(kv_bytes * pct / 100)
    return parse_bytes(text, "device_kv_memory")
