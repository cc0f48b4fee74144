"""The cloud's ZeroMQ ROUTER server: the socket loop and the lifetime of what it serves.

The loop drains every waiting message, answers each through the handlers (cloud_runtime.handlers: decode, validate,
queue model work), then runs one step of many sessions' work on the work runner (`work`, cloud_runtime.work.ModelWork;
cloud_runtime.batching: token protocols' tokens through every layer, split protocols' hidden states through the
middle ones, in this process or pipeline stages) and sends the replies the handlers build from what came back.
Anything wrong in a request is answered with an `Error` naming the problem and the loop carries on with the next
message. Sessions keep their KV caches between rounds and are dropped after `session_timeout_s` of silence, freeing
their memory. The sessions, the devices and the counters have one owner, `tables` (cloud_runtime.state.CloudTables).
A model whose layout the partition does not know (hat_split.models.partition.check_family), and a llama.cpp target,
serve the token protocols on the model's own caches, planned by the same scheduler (cloud_runtime.cache_runner).

Flow control is request/response: a device has at most one request in flight, so the ROUTER never queues more than
one reply per device. ROUTER_MANDATORY makes a reply to a vanished device fail loudly (it is then dropped) rather
than silently. With CurveZMQ only devices in the allow-list get through (cloud_runtime.zap). The public socket
belongs to a thread of its own (cloud_runtime.intake), which stamps each request as it arrives while the loop
computes, so a reply's `held_s` includes the queueing and the device can time the link under any load.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import zmq

from cloud_runtime.batching import Batcher, Finished
from cloud_runtime.cache_runner import CacheRunner, tree_capacity
from cloud_runtime.config import CloudConfig, device_kv_share
from cloud_runtime.dashboard import Dashboard
from cloud_runtime.fleet import fleet_view
from cloud_runtime.devices import DeviceRegistry
from cloud_runtime.handlers import Handlers
from cloud_runtime.intake import Intake, unpack
from cloud_runtime.metrics import CloudMetrics, listen_host
from cloud_runtime.runner import LocalExecutor, ModelEnds, kv_layout
from cloud_runtime.quotas import Admission, Quota, QuotaBook, allow_list_quotas, format_bytes, parse_bytes
from cloud_runtime.scheduler import SchedulerConfig
from cloud_runtime.sessions import SessionTable
from cloud_runtime.state import CloudTables, ServerStats
from cloud_runtime.work import ModelFacts, ModelWork, Pending
from cloud_runtime.zap import DOMAIN, ZapAllowList
from hat_split import heap
from hat_split.files.atomic import write_json
from hat_split.math.chunking import DelayModel
from hat_split.models.llamacpp_lm import LlamaCppLM
from hat_split.models.lm import CausalLM
from hat_split.models.partition import check_family, model_fingerprint
from hat_split.models.placement import available_bytes, model_device
from hat_split.net.security import load_secret
from hat_split.wire import messages as P

log = logging.getLogger("hatspec.cloud")


def model_facts(lm: CausalLM, model_name: str, vocab_fingerprint: str, max_sessions: int = 1) -> ModelFacts:
    """What the handlers need to know of the target; a model without layers (tests' Markov chains) or of an unknown
    family gets a reason the split protocols and draft trees are refused. A llama.cpp target takes trees of as many
    nodes as the sequence ids its `max_sessions` sessions leave free (cloud_runtime.cache_runner.tree_capacity)."""
    model = getattr(lm, "model", None)
    if isinstance(lm, LlamaCppLM):  # a GGUF file, no layers here
        nodes = tree_capacity(lm.settings.n_seq_max, max_sessions)
        return ModelFacts(model_name, vocab_fingerprint, lm.vocab_size, 0, 0,
                          split_refusal="the split protocols (ushape, hat) run on the torch engine; this cloud runs "
                                        "llama.cpp (hat-cloud serve --engine torch)",
                          tree_refusal="" if nodes else (
                              f"this llama.cpp cloud's {lm.settings.n_seq_max} sequence ids are all its "
                              f"{max_sessions} sessions': it verifies no draft trees (fewer --max-sessions)"),
                          max_tree_nodes=nodes)
    try:
        check_family(model)
    except ValueError as exc:
        return ModelFacts(model_name, vocab_fingerprint, lm.vocab_size, 0, 0, split_refusal=str(exc),
                          tree_refusal="draft trees are verified as masked forwards of the layers the partition "
                                       f"knows: {exc}; send chains")
    return ModelFacts(model_name, vocab_fingerprint, lm.vocab_size, model.config.num_hidden_layers,
                      int(model.config.hidden_size), model_fingerprint(model))


def kv_budget(config: CloudConfig, lm: Any, executor: Any = None) -> Tuple[int, str]:
    """The cloud's KV memory in bytes (CloudConfig.kv_memory) and how it was chosen, for the log. auto: a llama.cpp
    context's own (n_ctx positions); otherwise the KV slots already allocated plus half the memory free on the
    model's device now (after loading the model)."""
    if config.kv_memory != "auto":
        return parse_bytes(config.kv_memory, "kv_memory"), "set"
    if isinstance(lm, LlamaCppLM):
        return lm.settings.n_ctx * lm.kv_bytes_per_position(), f"llama.cpp's context of {lm.settings.n_ctx} positions"
    model = getattr(lm, "model", None)
    device = model_device(model) if model is not None and hasattr(model, "parameters") else "cpu"
    runner = getattr(executor, "runner", None)
    slots = runner.slots.nbytes() if getattr(runner, "slots", None) is not None else 0
    free = available_bytes(device)
    return slots + free // 2, (f"auto: {format_bytes(slots)} of slots + half of {format_bytes(free)} free on "
                               f"{device}")


def scheduler_config(config: CloudConfig, lm: Any, in_flight: int = 1, kv_bytes: int = 0) -> SchedulerConfig:
    """The scheduler's bounds: the config's, within what a llama.cpp context holds (n_ctx positions of every session
    together, n_seq_max sequences, n_batch positions per llama_decode: one llama_decode per step)."""
    budget, kv, context, sessions = config.token_budget, config.kv_positions, config.max_context, config.max_sessions
    if isinstance(lm, LlamaCppLM):
        s = lm.settings
        budget, kv, context, sessions = (min(budget, s.n_batch), min(kv, s.n_ctx), min(context, s.n_ctx),
                                         min(sessions, s.n_seq_max))
    return SchedulerConfig(budget, min(config.prefill_floor, budget), kv, context, sessions, in_flight, kv_bytes,
                           config.usage_half_life)


class CloudServer:
    """Serves token-protocol and split-protocol sessions for many devices over one ROUTER socket."""

    def __init__(self, config: CloudConfig, lm: CausalLM, model_name: str, vocab_fingerprint: str,
                 executor: Any = None):
        """executor: where the layers of the batched steps run (cloud_runtime.runner.LocalExecutor by default,
        cloud_runtime.pipeline.PipelineExecutor for pipeline stages)."""
        self.config = config
        self.model_name = model_name
        facts = model_facts(lm, model_name, vocab_fingerprint, config.max_sessions)
        self.load = DelayModel()  # HAT state monitoring of the batched steps (eq. 1-2)
        if facts.split_refusal:  # a layout the batched steps do not know
            if executor is not None:
                raise ValueError(f"pipeline stages need a model the partition knows: {facts.split_refusal}")
            self.kv_bytes, how = kv_budget(config, lm)
            self.work: ModelWork = CacheRunner(lm, scheduler_config(config, lm, 1, self.kv_bytes),
                                               config.max_draft_len + 1, self.load)
        else:
            executor = LocalExecutor(lm.model, kv_layout(config, lm.model)) if executor is None else executor
            self.kv_bytes, how = kv_budget(config, lm, executor)
            self.work = Batcher(scheduler_config(config, lm, executor.depth, self.kv_bytes), executor,
                                ModelEnds(lm.model), self.load, config.max_draft_len + 1)
        log.info("KV memory %s (%s); a device may hold %s of it", format_bytes(self.kv_bytes), how,
                 config.device_kv_memory)
        self.tables = CloudTables(SessionTable(self.work), DeviceRegistry(config, facts))
        kv_quota = device_kv_share(config.device_kv_memory, self.kv_bytes)
        kv_quota = 0 if kv_quota >= self.kv_bytes else kv_quota  # all of it: the cloud's own limits say it first
        self.quota = Quota(config.device_sessions, kv_quota, config.device_in_flight,
                           config.device_prompt_tokens_per_min)  # a device's, by default
        self.admission = Admission(self.tables.sessions, QuotaBook(self.quota, self._allow_list_quotas()),
                                   self.tables.registry.device_of, config.max_sessions, self.kv_bytes)
        self.handlers = Handlers(config, facts, self.work, self.tables, self.admission)
        self.zap: Optional[ZapAllowList] = None  # when the link is CurveZMQ
        self.metrics = CloudMetrics(self)  # Prometheus, served on config.metrics_port (cloud_runtime.metrics)
        self.dashboard: Optional[Dashboard] = None  # the fleet page, while served on config.dashboard_port
        self._status_at = -1e9  # monotonic time of the last status file
        self._trimmed = (time.monotonic(), (0, 0, 0))  # the last heap trim: (monotonic time, (steps, opened, open))
        self._ctx = zmq.Context.instance()
        self._intake: Optional[Intake] = None  # the thread that owns the public socket (cloud_runtime.intake) ...
        self._sock: Optional[zmq.Socket] = None  # ... and the loop's end of its pair: requests in, replies out
        self._stopping = False  # stop() asked: kept until serving ends, even when asked before serving began

    @property
    def stats(self) -> ServerStats:
        """The server's counters (kept with its tables)."""
        return self.tables.stats

    def _allow_list_quotas(self) -> Dict[str, Quota]:
        """Per-device quotas of the allow-list entries (NAME.quota.toml), over CurveZMQ; none on plaintext."""
        security = self.config.security
        if not security.curve:
            return {}
        self._allow_mtime = os.stat(security.allow_dir).st_mtime_ns
        return allow_list_quotas(security.allow_dir, self.quota)

    def _reload_quotas(self) -> None:
        """Read the allow-list's quotas again when the directory changed (as the ZAP handler does its keys); a bad
        file is logged and the quotas in force are kept."""
        security = self.config.security
        if not security.curve or os.stat(security.allow_dir).st_mtime_ns == self._allow_mtime:
            return
        try:
            self.admission.quotas.overrides = self._allow_list_quotas()
            log.info("allow-list quotas reloaded: %d devices with their own", len(self.admission.quotas.overrides))
        except (OSError, ValueError) as exc:
            log.error("allow-list quotas not reloaded: %s", exc)

    # -- lifetime -------------------------------------------------------------------------------------------------
    def __enter__(self) -> "CloudServer":
        sock = self._ctx.socket(zmq.ROUTER)
        security = self.config.security
        if security.curve:  # CurveZMQ: encrypted, and only devices in the allow-list get through (ZAP)
            public, secret = load_secret(security.secret_key)
            self.zap = ZapAllowList(self._ctx, security.allow_dir)
            sock.curve_server = True
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.zap_domain = DOMAIN.encode()
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 0)
        # ZeroMQ drops a peer whose single frame exceeds this; the application check answers smaller excess.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.config.max_message_bytes)
        try:
            sock.bind(self.config.bind)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._intake = Intake(self._ctx, sock, security.curve)  # requests seen as they arrive, computing or not
        self._sock = self._intake.sock
        try:
            if self.config.metrics_port:
                self.metrics.serve(listen_host(self.config.bind), self.config.metrics_port)
            if self.config.dashboard_port:
                self.dashboard = Dashboard(lambda: fleet_view(self))
                self.dashboard.serve(listen_host(self.config.bind), self.config.dashboard_port)
        except OSError:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the socket before anything else, then the ZAP handler; free every session; stop the stages."""
        if self._intake is not None:
            self._intake.close()
            self._intake, self._sock = None, None
        if self.zap is not None:
            self.zap.close()
            self.zap = None
        self.metrics.close()
        if self.dashboard is not None:
            self.dashboard.close()
            self.dashboard = None
        self.tables.sessions.clear()
        self.work.shutdown()

    @property
    def endpoint(self) -> str:
        return self._intake.endpoint

    def stop(self) -> None:
        """End serve_forever (from a signal handler too); asked before it began, it returns at once."""
        self._stopping = True

    def serve_forever(self, until: Optional[Callable[[], bool]] = None) -> None:
        """Serve until stop() is called or `until()` returns True (checked every poll_ms)."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        wake = self.work.wake_socket  # readable when a pipeline batch is back
        if wake is not None:
            poller.register(wake, zmq.POLLIN)
        last_sweep = time.monotonic()
        while not self._stopping and not (until and until()):
            # launchable work: do not wait; batches in pipeline stages: until one is back (wake socket) or, without
            # one, look again soon; idle: wake to expire sessions
            waiting = self.work.busy and wake is None
            wait_ms = 0 if self.work.can_launch else 1 if waiting else self.config.poll_ms
            ready = any(sock is self._sock for sock, _ in poller.poll(wait_ms))
            if not self._intake.alive:  # a cloud that reads no more requests must not look as if it served
                raise RuntimeError("the intake thread stopped (its error is logged above): no request can arrive")
            t0, progress = time.perf_counter(), (self.work.stats.steps, self.work.launches)
            if ready:
                self.drain()
            self.step()
            if ready or (self.work.stats.steps, self.work.launches) != progress:
                self.stats.busy_s += time.perf_counter() - t0
            now = time.monotonic()
            if now - last_sweep >= 1.0:
                self.expire_idle(now)
                self.trim_heap(now)
                self.admission.quotas.prune(now)
                self._reload_quotas()
                last_sweep = now
                if self.config.status_file and now - self._status_at >= self.config.status_interval_s:
                    self.write_status()
                    self._status_at = now

    def expire_idle(self, now: float) -> None:
        """Free sessions silent for session_timeout_s since their last reply (never one the cloud still owes an
        answer: under load a request can wait longer than the timeout), and forget peers with no session left."""
        self.tables.expire(now, self.config.session_timeout_s)

    def trim_heap(self, now: float) -> None:
        """Give the C heap's free pages back to the system (hat_split.heap) once the last session has closed, and at
        most every heap_trim_s while sessions stay open, when steps ran or sessions came or went since the last time.
        Freed activations and caches otherwise stay mapped to this process in its threads' malloc arenas: its RSS
        would keep the peak of its busiest minute."""
        state = (self.work.stats.steps, self.stats.sessions_opened, len(self.tables.sessions))
        if not self.config.heap_trim_s or state == self._trimmed[1]:
            return
        if self.tables.sessions and now - self._trimmed[0] < self.config.heap_trim_s:
            return
        self.stats.heap_trim_s += heap.trim()
        self.stats.heap_trims += 1
        self._trimmed = (now, state)

    # -- stats ----------------------------------------------------------------------------------------------------
    def report(self) -> dict:
        """Counters of the server and of its batched steps (`hat-cloud serve --stats-json`). The overhead is
        1 − this process's model time (its stage of the batched steps, a pipeline: stage 0's, plus the token
        protocols' embeddings and head outside them) / the loop's busy time."""
        b = self.work.stats
        own = (b.stage_s[0] if b.stage_s else 0.0) + b.head_s
        return {"server": dataclasses.asdict(self.stats), "stages": self.work.stages,
                "sessions": {"open": len(self.tables.sessions), "kv_positions": self.work.kv_used,
                             "kv_bytes": self.work.scheduler.kv_bytes_used, "kv_budget_bytes": self.kv_bytes,
                             "evicted": self.admission.evicted},
                "quotas": {"default": dataclasses.asdict(self.quota),
                           "refusals": dict(self.admission.quotas.refusals),
                           "usage": {str(d): round(u) for d, u in self.work.scheduler.usage.items()}},
                "steps": dataclasses.asdict(b), "devices": list(self.tables.registry.devices.values()),
                "security": {"mode": self.config.security.mode, **({"accepted": self.zap.accepted,
                                                                     "refused": self.zap.refused} if self.zap else {})},
                "overhead": 1.0 - own / self.stats.busy_s if self.stats.busy_s > 0 and b.steps else None}

    def write_status(self) -> None:
        """The report, written atomically to config.status_file (a reader never sees half a file)."""
        write_json(self.config.status_file,
                   {"time": time.time(), "model": self.model_name, "endpoint": self.endpoint, **self.report()})

    # -- messages -------------------------------------------------------------------------------------------------
    def drain(self) -> None:
        """Handle every message already waiting, so that one batched step sees all of them."""
        while True:
            try:
                raw = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.handle_one(raw)

    def handle_one(self, raw: List[Any]) -> None:
        """Decode and answer one request (or queue its work: answered by `step`)."""
        received_at, unseen, user, envelope = unpack(raw)  # stamped by the intake as it arrived (the allow-list
        # name ZAP gave its connection, under CurveZMQ)
        frames = [f.buffer if hasattr(f, "buffer") else f for f in envelope]
        identity, body = P.split_envelope(frames)
        size = P.frame_bytes(body)
        self.stats.requests += 1
        self.stats.bytes_in += size
        msg: Any = None
        try:
            msg = P.decode(body, self.config.max_message_bytes)
            reply = self.handlers.handle(identity, msg, received_at, size, user, unseen)
        except P.ProtocolError as exc:
            reply = self._error(exc.code, exc.message, msg)
        except Exception as exc:  # a bug or a compute failure must not take the server down
            log.exception("internal error while serving %s", type(msg).__name__)
            reply = self._error("internal", f"{type(exc).__name__}: {exc}", msg)
        self.metrics.request(msg)
        if reply is not None:
            self._send(identity, reply, msg, received_at, unseen)

    def step(self) -> None:
        """Launch and collect batched steps of every session's queued work; sends the replies of what finished."""
        before = self.work.stats.steps
        try:
            finished: Finished = self.work.step()
        except Exception:  # a bug here must not take the server down; the batch's devices time out and retry
            log.exception("batched step failed")
            return
        finally:  # the histograms count every step StepStats counted
            self.metrics.observe_steps(self.work.stats, before)
        for key in finished.dropped:
            self.tables.sessions.forget(key)
        for pending, why in finished.failed:
            self._send(pending.identity, self._error("internal", why, pending.msg), pending.msg)
        for pending, rows in finished.done:
            reply = self._finish(pending, rows)
            self.metrics.replied(pending.draft, reply)
            if reply is not None:
                self._send(pending.identity, reply, pending.msg, pending.received_at, pending.unseen_s)

    def _finish(self, pending: Pending, rows: Any) -> Optional[P.Message]:
        try:
            return self.handlers.finish(pending, rows)
        except P.ProtocolError as exc:  # e.g. the next token's work does not fit any more
            return self._error(exc.code, exc.message, pending.msg)
        except Exception as exc:
            log.exception("finishing a %s failed", type(pending.msg).__name__)
            return self._error("internal", f"{type(exc).__name__}: {exc}", pending.msg)

    def _send(self, identity: bytes, reply: P.Message, msg: Any, received_at: Optional[float] = None,
              unseen_s: float = 0.0) -> None:
        """Encode and send `reply` to `identity`; a reply that has `held_s` gets the seconds since its request
        arrived at `received_at` (the intake's stamp: queueing behind a step included) and `unseen_s`, how long
        before that it may have arrived, so that the device can time the link without this cloud's queueing."""
        if received_at is not None and hasattr(reply, "held_s"):
            reply.held_s = max(0.0, time.perf_counter() - received_at)
            reply.unseen_s = unseen_s
        out = P.encode(reply)
        self.stats.bytes_out += P.frame_bytes(out)
        self._sock.send_multipart([identity, *out], copy=False)  # the intake sends it on (or logs a vanished peer)
        session = self.tables.sessions.get((identity, getattr(msg, "session_id", None)))
        if session is not None:
            session.replied_at = time.perf_counter()

    def _error(self, code: str, message: str, msg: Any) -> P.Error:
        self.stats.errors += 1
        self.stats.errors_by_code[code] = self.stats.errors_by_code.get(code, 0) + 1
        log.info("error %s: %s", code, message)
        return P.Error(code, message, getattr(msg, "session_id", None), getattr(msg, "step", None))
