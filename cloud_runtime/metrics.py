"""The cloud's Prometheus metrics: `GET /metrics` on `CloudConfig.metrics_port` (docs/METRICS.md lists them).

Most of them are read at scrape time from what the server counts anyway (CloudServer.stats, the work runner's
StepStats, the scheduler's sessions, the quota book, each device's self-report). A scrape runs on the HTTP server's
thread while the serving loop changes those tables, so `snapshot` copies each dict or list in one step (a C-level
copy the loop cannot interleave) before reading it, and touches nothing but plain Python values (never torch).
`families` turns the copy into metric families (pure). What the server does not count already is kept here, written
by the loop only: histograms of the batched steps (from StepStats' step log), requests by message type, and the
verifications' draft tokens verified and accepted. Every metric lives in this server's own registry, never
prometheus_client's global one.
"""
from __future__ import annotations

import collections
from typing import Any, Dict, Iterator, Optional, Tuple

from prometheus_client import Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from hat_split.wire import messages as P

STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # a step's compute
BATCH_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)  # positions of one batched step
BATCH_SEGMENTS = (1, 2, 4, 8, 16, 32, 64, 128)  # sessions' segments in one batched step
DEVICE_RATES = (("up_bps", "uplink"), ("down_bps", "downlink"))  # a device's reported link rates, bits per second
DEVICE_STATS = (  # an agent's reported figures over its recent requests (hat_split.wire.messages.DeviceStats)
    ("requests", "recent_requests", "requests of the agent's recent window (its last 64, 5 minutes at most)"),
    ("tokens_per_s", "tokens_per_second", "generated tokens per second of generation, over the recent window"),
    ("ttft_p50_s", "ttft_p50_seconds", "median time to first token, over the recent window"),
    ("tbt_p50_s", "tbt_p50_seconds", "median time between tokens, over the recent window"),
    ("acceptance", "acceptance_ratio", "accepted / drafted tokens, over the recent window"),
    ("link_drops", "recent_link_drops", "link drops (resumed, or failed requests), over the recent window"),
    ("watts", "power_watts", "the device's power at its last report"),
)
DEVICE_TIMES = (("draft_s", "draft", "drafting delay γ: seconds per draft token"),
                ("input_s", "prefill_input", "prefill: seconds per prompt position of the device's input layers"),
                ("adapter_s", "prefill_adapter", "prefill: seconds per prompt position of the device's adapter Λ"))


def listen_host(bind: str) -> str:
    """The address the metrics endpoint listens on: the host of the ZeroMQ endpoint `bind` (tcp://HOST:PORT; `*`
    is every interface), loopback for an ipc:// or inproc:// socket (local only, like the socket)."""
    if not bind.startswith("tcp://"):
        return "127.0.0.1"
    host = bind[len("tcp://"):].rpartition(":")[0]
    host = host.split(";")[-1]  # tcp://SOURCE;HOST:PORT binds HOST
    if host in ("*", ""):
        return "0.0.0.0"
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def cannot_listen(key: str, host: str, port: int, exc: OSError) -> OSError:
    """The one-line error of an HTTP endpoint (`key`: its config key) that cannot listen on host:port."""
    return OSError(f"{key} {port}: cannot listen on {host}:{port}: {exc.strerror or exc}")


def stop_http(httpd: Any) -> None:
    """Stop an http.server serving from its thread and free its socket."""
    httpd.shutdown()
    httpd.server_close()


def label(device: Any) -> str:
    """A device as the `device` label shows it (an identity without a name is bytes)."""
    return device.decode(errors="replace") if isinstance(device, bytes) else str(device)


def snapshot(server: Any, metrics: "CloudMetrics") -> Dict[str, Any]:
    """The server's counters and tables now, copied into plain values (see the module's docstring)."""
    stats, steps, sched = server.stats, server.work.stats, server.work.scheduler
    registry, admission = server.tables.registry, server.admission
    held = list(sched.sessions.values())
    users = dict(registry.users)
    kv_by_device: Dict[str, int] = collections.Counter()
    for s in held:
        kv_by_device[label(s.owner)] += s.held_bytes
    devices: Dict[str, dict] = {}
    for identity, entry in list(registry.devices.items()):
        entry = dict(entry)
        name = label(users.get(identity) or entry.get("device_id") or identity)
        if entry.get("reported_at", 0) >= devices.get(name, {}).get("reported_at", 0):
            devices[name] = entry
    zap = server.zap
    return {
        "model": server.model_name, "engine": server.config.engine, "security": server.config.security.mode,
        "server": {k: getattr(stats, k) for k in ("bytes_in", "bytes_out", "sessions_opened", "sessions_expired",
                                                  "busy_s", "heap_trim_s")},
        "errors_by_code": dict(stats.errors_by_code),
        "requests_by_type": dict(metrics.requests),
        "verify": dict(metrics.verify),
        "sessions": collections.Counter(label(s.device) for s in list(server.tables.sessions.values())),
        "max_sessions": server.config.max_sessions, "peers": len(registry.peers),
        "kv_positions": sum(s.context + s.queued for s in held), "kv_capacity": sched.config.kv_capacity,
        "kv_bytes": sum(kv_by_device.values()), "kv_budget_bytes": server.kv_bytes, "kv_by_device": kv_by_device,
        "evicted": admission.evicted, "quota_refusals": dict(admission.quotas.refusals),
        "usage": {label(d): u for d, u in sched.usage.items()},
        "steps": {k: getattr(steps, k) for k in ("steps", "tokens", "segments", "forward_s", "head_s")},
        "load": (server.load.mu or 0.0, server.load.g_mu()), "devices": devices,
        "zap": (zap.accepted, len(zap.refused)) if zap is not None else None,
        "connected": sorted({label(registry.device_of(i)) for i in list(registry.peers)}),
    }


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled(kind: type, name: str, doc: str, key: str, values: Dict[str, float]) -> Metric:
    family = kind(name, doc, labels=[key])
    for k in sorted(values):
        family.add_metric([str(k)], values[k])
    return family


def families(s: Dict[str, Any]) -> Iterator[Metric]:
    """The metric families of a `snapshot` (names without `_total`: prometheus_client adds it to counters)."""
    info = GaugeMetricFamily("hatspec_cloud_info", "the cloud's model, engine and link security",
                             labels=["model", "engine", "security"])
    info.add_metric([s["model"], s["engine"], s["security"]], 1)
    yield info
    srv, st = s["server"], s["steps"]
    yield _gauge("hatspec_cloud_sessions", "sessions open", sum(s["sessions"].values()))
    yield _gauge("hatspec_cloud_sessions_max", "sessions the cloud holds at most (max_sessions)", s["max_sessions"])
    yield _gauge("hatspec_cloud_peers", "devices connected (said Hello, not yet forgotten)", s["peers"])
    yield _gauge("hatspec_cloud_kv_bytes", "bytes of KV cache the sessions hold (context and queued work)",
                 s["kv_bytes"])
    yield _gauge("hatspec_cloud_kv_budget_bytes", "bytes of KV cache all sessions together may hold",
                 s["kv_budget_bytes"])
    yield _gauge("hatspec_cloud_kv_positions", "KV cache positions the sessions hold", s["kv_positions"])
    yield _gauge("hatspec_cloud_kv_positions_capacity", "KV cache positions of the batched steps, all sessions",
                 s["kv_capacity"])
    yield _gauge("hatspec_cloud_load_batch_tokens", "μ: moving average of positions per batched step (HAT eq. 1)",
                 s["load"][0])
    yield _gauge("hatspec_cloud_load_step_seconds", "g(μ): predicted compute seconds of a step of μ positions "
                 "(HAT eq. 2; 0 before any step)", s["load"][1])
    yield _labelled(CounterMetricFamily, "hatspec_cloud_requests", "requests received, by message type "
                    "(undecodable: refused before its type was known)", "type", s["requests_by_type"])
    yield _labelled(CounterMetricFamily, "hatspec_cloud_errors", "Error replies, by code (quota, busy, memory_full, "
                    "desync, invalid, ...)", "code", s["errors_by_code"])
    yield _labelled(CounterMetricFamily, "hatspec_cloud_quota_refusals", "requests refused for a device quota, by "
                    "quota", "quota", s["quota_refusals"])
    yield _counter("hatspec_cloud_received_bytes", "bytes of request frames received", srv["bytes_in"])
    yield _counter("hatspec_cloud_sent_bytes", "bytes of reply frames sent", srv["bytes_out"])
    yield _counter("hatspec_cloud_busy_seconds", "serving loop time spent handling messages and computing steps",
                   srv["busy_s"])
    yield _counter("hatspec_cloud_heap_trim_seconds", "serving loop time spent giving the C heap's free pages back "
                   "to the system", srv["heap_trim_s"])
    yield _counter("hatspec_cloud_sessions_opened", "sessions opened (token and split)", srv["sessions_opened"])
    yield _counter("hatspec_cloud_sessions_expired", "sessions freed after session_timeout_s of silence",
                   srv["sessions_expired"])
    yield _counter("hatspec_cloud_sessions_evicted", "idle sessions evicted to make room for another device's work",
                   s["evicted"])
    yield _counter("hatspec_cloud_steps", "batched steps computed", st["steps"])
    yield _counter("hatspec_cloud_step_tokens", "positions computed in batched steps", st["tokens"])
    yield _counter("hatspec_cloud_step_segments", "sessions' segments computed in batched steps", st["segments"])
    yield _counter("hatspec_cloud_forward_seconds", "model time of the batched steps", st["forward_s"])
    yield _counter("hatspec_cloud_head_seconds", "model time outside the batched steps (final norm and head)",
                   st["head_s"])
    v = s["verify"]
    yield _counter("hatspec_cloud_verifications", "Verify requests answered (rounds of the token protocols)",
                   v.get("rounds", 0))
    yield _counter("hatspec_cloud_draft_tokens_verified", "draft tokens the cloud verified", v.get("drafted", 0))
    yield _counter("hatspec_cloud_draft_tokens_accepted", "of those, accepted", v.get("accepted", 0))
    yield _counter("hatspec_cloud_sampled_tokens", "tokens the cloud sampled for Generate requests (llm)",
                   v.get("sampled", 0))
    if s["zap"] is not None:  # CurveZMQ
        yield _counter("hatspec_cloud_handshakes_accepted", "CurveZMQ handshakes of allow-listed devices", s["zap"][0])
        yield _gauge("hatspec_cloud_handshakes_refused_recent", "CurveZMQ handshakes refused (not in the allow-list) "
                     "among the last 100 the cloud keeps", s["zap"][1])
    yield from device_families(s)


def device_families(s: Dict[str, Any]) -> Iterator[Metric]:
    """Per device (label `device`: its allow-list name over CurveZMQ, else the device id of its Hello)."""
    yield _labelled(GaugeMetricFamily, "hatspec_cloud_device_sessions", "sessions a device holds", "device",
                    s["sessions"])
    yield _labelled(GaugeMetricFamily, "hatspec_cloud_device_kv_bytes", "bytes of KV cache a device's sessions hold",
                    "device", s["kv_by_device"])
    yield _labelled(GaugeMetricFamily, "hatspec_cloud_device_usage_positions", "a device's recent usage: positions "
                    "planned for it, halving every usage_half_life positions computed", "device", s["usage"])
    devices = s["devices"]
    info = GaugeMetricFamily("hatspec_cloud_device_info", "a device's model, profile and power mode as it reported "
                             "them (1)", labels=["device", "model", "profile", "power_mode"])
    for name, e in sorted(devices.items()):
        info.add_metric([name, str(e.get("model", "")), str(e.get("profile", "")), str(e.get("power_mode", ""))], 1)
    yield info
    for key, what in DEVICE_RATES:
        yield _labelled(GaugeMetricFamily, f"hatspec_cloud_device_{what}_bytes_per_second",
                        f"{what} rate the device measured and reported", "device",
                        {n: e[key] / 8 for n, e in devices.items() if key in e})
    for key, what, doc in DEVICE_TIMES:
        yield _labelled(GaugeMetricFamily, f"hatspec_cloud_device_{what}_seconds", f"as the device reported it: {doc}",
                        "device", {n: e[key] for n, e in devices.items() if key in e})
    yield _labelled(GaugeMetricFamily, "hatspec_cloud_device_last_report_timestamp_seconds", "when the device's last "
                    "state report arrived (Unix time)", "device",
                    {n: e["reported_at"] for n, e in devices.items() if "reported_at" in e})
    stats = {n: e["stats"] for n, e in devices.items() if e.get("stats") is not None}
    agent = GaugeMetricFamily("hatspec_cloud_device_agent_info", "a device agent's state and what runs its draft, "
                              "as it last reported them (1)", labels=["device", "state", "bundle"])
    by_protocol = GaugeMetricFamily("hatspec_cloud_device_recent_protocol_requests", "requests of the agent's recent "
                                    "window, by protocol", labels=["device", "protocol"])
    for name, st in sorted(stats.items()):
        agent.add_metric([name, st["state"], st["bundle"]], 1)
        for protocol, n in sorted(st["protocols"].items()):
            by_protocol.add_metric([name, protocol], n)
    yield agent
    yield by_protocol
    for key, what, doc in DEVICE_STATS:
        yield _labelled(GaugeMetricFamily, f"hatspec_cloud_device_{what}", f"as the device agent reported it: {doc}",
                        "device", {n: st[key] for n, st in stats.items() if st.get(key) is not None})


class _Collector(Collector):
    def __init__(self, server: Any, metrics: "CloudMetrics"):
        self.server, self.metrics = server, metrics

    def collect(self) -> Iterator[Metric]:
        return families(snapshot(self.server, self.metrics))


class CloudMetrics:
    """A CloudServer's registry: the collector over its state, the histograms and counters the loop writes, and the
    HTTP endpoint (`serve`, `close`)."""

    def __init__(self, server: Any):
        self.registry = CollectorRegistry()
        self.step_seconds = Histogram("hatspec_cloud_step_seconds", "compute time of one batched step (a pipeline: "
                                      "launch to return)", buckets=STEP_SECONDS, registry=self.registry)
        self.batch_tokens = Histogram("hatspec_cloud_batch_tokens", "positions computed in one batched step",
                                      buckets=BATCH_TOKENS, registry=self.registry)
        self.batch_segments = Histogram("hatspec_cloud_batch_segments", "sessions' segments in one batched step",
                                        buckets=BATCH_SEGMENTS, registry=self.registry)
        self.requests: Dict[str, int] = collections.Counter()  # message type → requests
        self.verify: Dict[str, int] = collections.Counter()  # rounds, drafted, accepted, sampled
        self.registry.register(_Collector(server, self))
        self._httpd: Any = None
        self.address: Optional[Tuple[str, int]] = None  # where the endpoint listens, once serving

    def request(self, msg: Any) -> None:
        """One request received (`msg`: its decoded message; None when it could not be decoded)."""
        self.requests["undecodable" if msg is None else type(msg).__name__] += 1

    def replied(self, draft: Any, reply: Any) -> None:
        """A reply built from finished work: a Verdict counts the drafts it verified, Generated its tokens."""
        if isinstance(reply, P.Verdict):
            self.verify["rounds"] += 1
            self.verify["drafted"] += len(draft)
            self.verify["accepted"] += reply.n_accepted
        elif isinstance(reply, P.Generated):
            self.verify["sampled"] += len(reply.tokens)

    def observe_steps(self, stats: Any, before: int) -> None:
        """The batched steps StepStats logged since it counted `before` steps."""
        new = stats.steps - before
        for tokens, segments, compute_s in (stats.step_log[-new:] if new > 0 else ()):
            self.step_seconds.observe(compute_s)
            self.batch_tokens.observe(tokens)
            self.batch_segments.observe(segments)

    def serve(self, host: str, port: int) -> Tuple[str, int]:
        """Serve `GET /metrics` on host:port from a thread; OSError in one line when it cannot listen there."""
        try:
            self._httpd, _ = start_http_server(port, host, self.registry)
        except OSError as exc:
            raise cannot_listen("metrics_port", host, port, exc) from None
        self.address = self._httpd.server_address[:2]
        return self.address

    def close(self) -> None:
        if self._httpd is not None:
            stop_http(self._httpd)
            self._httpd = None
