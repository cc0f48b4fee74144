"""The device agent's Prometheus metrics: `GET /metrics` beside its OpenAI API (`hat-edge serve`; docs/METRICS.md
lists them).

Each finished request is counted from its `GenerationResult` (edge_runtime.sessions.base: the session's own counters
and clocks, link bytes from the real frames), each refused or failed one by why; the agent's state (queue, last
report to the cloud, power mode, drafting delay γ) and the board's power and load are read at scrape time. Power
comes from the first sampler backend that works here (hardware.power: jtop, tegrastats, INA3221, else psutil
with no power), opened at the first scrape and closed with the agent; a quantity the backend cannot measure is left
out, never estimated. Every metric lives in this agent's own registry, never prometheus_client's global one. Runs on
Python 3.8 (JetPack 5), with prometheus-client < 0.22 there.

Beside the counters, the last requests are kept in a window (`Outcome`s: the last STATS_REQUESTS that ran, none older
than STATS_WINDOW_S) and summed up by `window_stats` (pure) into what the agent's reports carry to the cloud
(hat_split.wire.messages.DeviceStats, for its fleet view).
"""
from __future__ import annotations

import collections
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterator, Optional, Sequence, Tuple

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from edge_runtime.auto import SLA_REASON
from edge_runtime.client import CloudError, CloudUnavailable
from hat_split import protocols
from hat_split.wire import messages as P
from hardware.power import open_sampler

log = logging.getLogger("hatspec.agent")

TTFT_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
REQUEST_SECONDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/hatspec/generate", "/hatspec/status")
OUTCOMES = ("completed", "refused", "shed", "invalid", "cloud_error", "link_down", "error")
COUNTED = (  # GenerationResult field → (counter name, help), each by protocol
    ("n", "generated_tokens", "tokens generated (committed and sent back)"),
    ("prompt_tokens", "prompt_tokens", "prompt tokens of the requests"),
    ("rounds", "rounds", "draft/verify or generate rounds with the cloud"),
    ("drafted", "draft_tokens", "draft tokens sent for verification"),
    ("accepted", "accepted_tokens", "of those, accepted by the cloud"),
    ("rejected", "rejected_rounds", "rounds that ended in a rejected draft"),
    ("skipped", "skipped_uploads", "tokens committed without an upload (uhlm, cuhlm, randhlm)"),
    ("up_bytes", "uplink_bytes", "bytes of request frames sent to the cloud"),
    ("down_bytes", "downlink_bytes", "bytes of reply frames received from the cloud"),
    ("round_trips", "round_trips", "request/reply exchanges with the cloud"),
    ("interruptions", "link_resumes", "link drops a request survived: reconnected and resumed from its history"),
    ("degraded", "degraded_tokens", "tokens the device made alone while the link was down (link_policy degrade)"),
    ("device_compute_s", "draft_compute_seconds", "the draft model's forward time on the device"),
    ("cloud_compute_s", "cloud_compute_seconds", "model time the cloud reported for the requests"),
)
STATS_REQUESTS = 64  # the reports' window: at most this many of the last requests ...
STATS_WINDOW_S = 300.0  # ... none that ended longer ago than this (seconds)


def outcome(exc: BaseException, shed_codes: Sequence[str]) -> str:
    """A failed request's outcome label: shed (the cloud refused it for load: 503), cloud_error (another refusal),
    link_down (the cloud unreachable), invalid (a bad request), error (anything else)."""
    if isinstance(exc, CloudError):
        return "shed" if exc.error.code in shed_codes else "cloud_error"
    if isinstance(exc, CloudUnavailable):
        return "link_down"
    return "invalid" if isinstance(exc, ValueError) else "error"


def _why(reason: str) -> str:
    """A bounded label for protocol auto's reason: its first word (measuring, probing, predicted; opening: predicted
    for a request's first round), `sla` (predicted, chosen for the least cloud compute that keeps the request's
    pace), `unreachable`, `private`, `lossy`, or `other`."""
    word = reason.split(":")[0].split()[0] if reason.strip() else ""
    if word in ("predicted", "opening") and SLA_REASON in reason:
        return "sla"
    if word in ("measuring", "probing", "predicted", "opening", "private", "lossy"):
        return word
    return "unreachable" if "unreachable" in reason else "other"


def _protocol(name: Any) -> str:
    """A protocol label; what a client may send is bounded to the known names."""
    return name if name in protocols.REQUESTABLE else "unknown"


@dataclass(frozen=True)
class Outcome:
    """One request that ran, as the reports' window keeps it."""

    t: float  # time.monotonic() when it ended
    protocol: str  # its protocol label (`_protocol`)
    tokens: int = 0  # tokens generated (0: it failed)
    generation_s: float = 0.0  # its generation's wall time, queue wait excluded (0: it failed)
    ttft_s: Optional[float] = None  # arrival to first token, queue wait included (None: no token)
    tbt_s: Optional[float] = None  # mean time between its tokens (None: fewer than 2)
    drafted: int = 0  # draft tokens it sent for verification
    accepted: int = 0  # of those, accepted
    drops: int = 0  # link drops: survived (resumed) ones, or 1 for a request failed with the cloud unreachable


def window_stats(outcomes: Sequence[Outcome], now: float, window_s: float = STATS_WINDOW_S) -> Dict[str, Any]:
    """The reports' figures (DeviceStats' fields but state, bundle, model, watts) over the outcomes that ended within
    `window_s` of `now`; a figure nothing measures is None."""
    recent = [o for o in outcomes if now - o.t <= window_s]
    per_protocol: Dict[str, int] = collections.Counter(o.protocol for o in recent)
    tokens, busy_s = sum(o.tokens for o in recent), sum(o.generation_s for o in recent)
    drafted, accepted = sum(o.drafted for o in recent), sum(o.accepted for o in recent)
    ttft = [o.ttft_s for o in recent if o.ttft_s is not None]
    tbt = [o.tbt_s for o in recent if o.tbt_s is not None]
    return {"requests": len(recent), "protocols": dict(per_protocol),
            "tokens_per_s": tokens / busy_s if busy_s > 0 else None,
            "ttft_p50_s": statistics.median(ttft) if ttft else None,
            "tbt_p50_s": statistics.median(tbt) if tbt else None,
            "acceptance": min(1.0, accepted / drafted) if drafted else None,
            "link_drops": sum(o.drops for o in recent)}


def bundle_label(engine: Any) -> str:
    """What runs a draft (edge_runtime.config.EngineConfig), as the fleet view shows it: the hat-export bundle
    directory's name (with its backend and precision), else the backend (torch, llamacpp)."""
    if not engine.bundle:
        return engine.backend
    name = os.path.basename(os.path.normpath(engine.bundle))
    return f"{name} ({engine.backend} {engine.precision})"


def _gauge(name: str, doc: str, value: float, labels: Sequence[str] = (), values: Sequence[str] = ()) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(values), value)
    return family


def reading_families(sampler: Any, reading: Any) -> Iterator[Metric]:
    """Power and load of one sampler reading (hardware.power.Reading); what it lacks is left out."""
    yield _gauge("hatspec_edge_power_sampler_info", "the power sampler backend and what its power figure is (1)", 1,
                 ("backend", "power_source"), (sampler.backend.name, sampler.backend.power_source))
    if reading.power_mw is not None:
        yield _gauge("hatspec_edge_power_watts", "the module's power (input rail, or the sum of its rails)",
                     reading.power_mw / 1000.0)
    if reading.rails_mw:
        rails = GaugeMetricFamily("hatspec_edge_rail_power_watts", "power of each rail", labels=["rail"])
        for rail, mw in sorted(reading.rails_mw.items()):
            rails.add_metric([rail], mw / 1000.0)
        yield rails
    for value, name, doc, scale in ((reading.cpu_pct, "cpu_utilization_ratio", "CPU load, mean over cores", 0.01),
                                    (reading.gpu_pct, "gpu_utilization_ratio", "GPU load", 0.01),
                                    (reading.memory_used_mb, "memory_used_bytes", "memory in use", float(1 << 20))):
        if value is not None:
            yield _gauge(f"hatspec_edge_{name}", doc, value * scale)
    if reading.temperatures_c:
        temps = GaugeMetricFamily("hatspec_edge_temperature_celsius", "temperature of each sensor", labels=["sensor"])
        for sensor, c in sorted(reading.temperatures_c.items()):
            temps.add_metric([sensor], c)
        yield temps


class _Collector(Collector):
    """The agent's state at scrape time."""

    def __init__(self, agent: Any, metrics: "EdgeMetrics"):
        self.agent, self.metrics = agent, metrics

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        yield _gauge("hatspec_edge_state", "the agent's state (1): starting, ready, degraded (the cloud unreachable at "
                     "the last report), stopped", 1, ("state",), (a.state,))
        yield _gauge("hatspec_edge_requests_admitted", "requests running or waiting for the draft model",
                     a._admitted)
        yield _gauge("hatspec_edge_max_queue", "requests that may wait behind the one running (more get 429)",
                     a.max_queue)
        report = dict(a.last_report)
        if report:
            yield _gauge("hatspec_edge_cloud_reachable", "1 when the last state report reached the cloud",
                         float(bool(report.get("ok"))))
            yield _gauge("hatspec_edge_last_report_timestamp_seconds", "when the last state report was sent (Unix "
                         "time)", report["time"])
        if report.get("ok"):
            yield _gauge("hatspec_edge_cloud_batch_tokens", "the cloud's μ (positions per batched step) at the last "
                         "report", report["cloud_batch_tokens"])
            yield _gauge("hatspec_edge_cloud_step_seconds", "the cloud's g(μ) (predicted step seconds) at the last "
                         "report", report["cloud_step_s"])
        monitor = getattr(getattr(a, "runtime", None), "monitor", None)
        if monitor is not None:
            if monitor.power_mode:
                yield _gauge("hatspec_edge_power_mode_info", "the board's nvpmodel power mode (1)", 1, ("mode",),
                             (monitor.power_mode,))
            yield _gauge("hatspec_edge_draft_seconds", "drafting delay γ: seconds per draft token (moving average; 0 "
                         "before a request)", monitor.draft_s)
        yield from self.metrics.power()


class EdgeMetrics:
    """An agent's registry: counters and histograms of its requests, the collector of its state, the power sampler."""

    def __init__(self, agent: Any, shed_codes: Sequence[str] = ()):
        self.shed_codes = tuple(shed_codes)
        self.registry = r = CollectorRegistry()
        self.requests = Counter("hatspec_edge_requests", "generation requests by protocol and outcome: completed, "
                                "refused (429, queue full), shed (503, the cloud refused for load), invalid, "
                                "cloud_error, link_down, error", ["protocol", "outcome"], registry=r)
        self.finished = Counter("hatspec_edge_finished", "completed requests by finish reason (eos, length, stop, "
                                "cancelled)", ["protocol", "reason"], registry=r)
        self.counters = {field: Counter(f"hatspec_edge_{name}", doc, ["protocol"], registry=r)
                         for field, name, doc in COUNTED}
        self.ttft = Histogram("hatspec_edge_time_to_first_token_seconds", "request arrival to its first token: queue "
                              "wait + the session's time to first token", ["protocol"], buckets=TTFT_SECONDS,
                              registry=r)
        self.tpot = Histogram("hatspec_edge_time_per_output_token_seconds", "time between tokens of a request: its "
                              "first to last token over the tokens after the first (requests of >= 2 tokens)",
                              ["protocol"], buckets=TPOT_SECONDS, registry=r)
        self.latency = Histogram("hatspec_edge_request_seconds", "request arrival to its last token (queue wait "
                                 "included)", ["protocol"], buckets=REQUEST_SECONDS, registry=r)
        self.queue = Histogram("hatspec_edge_queue_seconds", "time a request waited for the draft model",
                               buckets=REQUEST_SECONDS, registry=r)
        self.http = Counter("hatspec_edge_http_responses", "HTTP responses by route and status code",
                            ["route", "code"], registry=r)
        self.auto_tokens = Counter("hatspec_edge_auto_tokens", "protocol auto: tokens generated under each protocol "
                                   "it chose, by why (measuring, probing, predicted, or the cloud unreachable...)",
                                   ["chosen", "why"], registry=r)
        r.register(_Collector(agent, self))
        self._sampler: Any = None
        self._sampler_error = ""  # why no sampler could be opened (then none is tried again)
        self._sampler_lock = threading.Lock()
        self._recent: Deque[Outcome] = collections.deque(maxlen=STATS_REQUESTS)  # the reports' window
        self._recent_lock = threading.Lock()  # request threads append, the report loop reads

    # -- what the agent observes --------------------------------------------------------------------------------
    def completed(self, result: Any, queued_s: float) -> None:
        """A finished request (edge_runtime.sessions.base.GenerationResult) that waited `queued_s` for the model."""
        p = _protocol(result.protocol)
        self.requests.labels(p, "completed").inc()
        self.finished.labels(p, result.finish_reason or "unknown").inc()
        for field, _, _ in COUNTED:
            value = getattr(result, field)
            self.counters[field].labels(p).inc(len(value) if isinstance(value, list) else value)
        for seg in result.auto:  # protocol auto: what it chose, why
            self.auto_tokens.labels(_protocol(seg["protocol"]), _why(seg["reason"])).inc(seg["tokens"])
        self.queue.observe(queued_s)
        if result.n:
            self.ttft.labels(p).observe(queued_s + result.ttft_s)
        if result.n > 1:
            self.tpot.labels(p).observe(max(0.0, result.total_s - result.ttft_s) / (result.n - 1))
        self.latency.labels(p).observe(queued_s + result.total_s)
        self._keep(Outcome(time.monotonic(), p, result.n, result.total_s,
                           queued_s + result.ttft_s if result.n else None,
                           max(0.0, result.total_s - result.ttft_s) / (result.n - 1) if result.n > 1 else None,
                           result.drafted, result.accepted, result.interruptions))

    def failed(self, protocol: Any, why: Any) -> None:
        """A request that did not finish: `why` an outcome label or the exception (see `outcome`)."""
        label = why if isinstance(why, str) else outcome(why, self.shed_codes)
        self.requests.labels(_protocol(protocol), label).inc()
        if label != "refused":  # a 429 never ran: it stays out of the reports' window
            self._keep(Outcome(time.monotonic(), _protocol(protocol), drops=int(label == "link_down")))

    def _keep(self, o: Outcome) -> None:
        with self._recent_lock:
            self._recent.append(o)

    def stats(self, state: str, bundle: str, model: str, now: Optional[float] = None) -> P.DeviceStats:
        """What the agent's next report carries: its state, what runs its draft, the window's figures (at `now`,
        time.monotonic() by default), the board's power now (None without a power monitor)."""
        with self._recent_lock:
            recent = list(self._recent)
        figures = window_stats(recent, time.monotonic() if now is None else now)
        return P.DeviceStats(state=state, bundle=bundle, model=model, watts=self.watts(), **figures)

    def responded(self, path: str, code: int) -> None:
        route = path.split("?")[0]
        self.http.labels(route if route in ROUTES else "other", str(code)).inc()

    # -- scrape ---------------------------------------------------------------------------------------------------
    def exposition(self) -> Tuple[bytes, str]:
        """The Prometheus text of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def power(self) -> Iterator[Metric]:
        """The board's power and load now, from the sampler (opened on the first call)."""
        sampler, reading = self._read()
        if reading is not None:
            yield from reading_families(sampler, reading)

    def watts(self) -> Optional[float]:
        """The module's power now (the sampler's figure), None where the board has no power monitor."""
        reading = self._read()[1]
        return None if reading is None or reading.power_mw is None else reading.power_mw / 1000.0

    def _read(self) -> Tuple[Any, Any]:
        """(the sampler, a reading now), opening the sampler on the first call; (sampler or None, None) when none can
        be opened here or its reading failed."""
        with self._sampler_lock:
            if self._sampler is None and not self._sampler_error:
                try:
                    self._sampler = open_sampler(interval_s=1.0)
                    log.info("power sampling (metrics, reports): %s", self._sampler.backend.name)
                except Exception as exc:  # no backend at all: the metrics go on without power
                    self._sampler_error = f"{type(exc).__name__}: {exc}"
                    log.warning("no power sampler (metrics, reports): %s", self._sampler_error)
            sampler = self._sampler
            if sampler is None:
                return None, None
            try:
                return sampler, sampler.backend.read()
            except Exception as exc:
                log.warning("power sampler %s failed: %s", sampler.backend.name, exc)
                return sampler, None

    def close(self) -> None:
        with self._sampler_lock:
            if self._sampler is not None:
                self._sampler.close()
                self._sampler = None
