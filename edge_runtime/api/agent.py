"""The long-running edge agent (`hat-edge serve`): one EdgeRuntime held ready, its state reported, requests served.

What it does:
- holds the draft (torch model or hat-export bundle) and the cloud connection of one EdgeRuntime;
- every `report_interval_s` it reads the board's power mode and sends the device's state — profile, power mode,
  drafting delay γ, link estimates — to the cloud (protocol Report; HAT §3.2), and rewrites `status_file` (JSON,
  atomically) with what `hat-fleet status` shows: state, pid, model, backend, requests served, last report, cloud load;
- serves HTTP on a device-local address: the OpenAI API (edge_runtime.api.openai_api: `/v1/models`, `/v1/completions`,
  `/v1/chat/completions`, streamed or not, stop sequences, cancellation when the client goes away, the protocol per
  request in the `hatspec` field), `GET /metrics` (Prometheus: edge_runtime.api.metrics, docs/METRICS.md),
  `GET /hatspec/status` (the status JSON) and `POST /hatspec/generate` (JSON
  {"prompt", "protocol", "max_tokens", "temperature", "top_p", "top_k", "seed", "chat"} → the generation's summary);
  what a request leaves out comes from the agent's request defaults (`[request]`, `hat-edge serve --temperature`
  ...: edge_runtime.request), the same for both APIs;
  generations run one at a time (a device has one draft model);
- sheds load as OpenAI-compatible servers do, so clients back off and retry by themselves: with `max_queue` requests
  already waiting, a new one is answered 429 with Retry-After (the expected wait); a request the cloud refuses for
  load (busy, memory full, a quota of this device) is answered 503 with Retry-After;
- SIGTERM / SIGINT stop it cleanly: the server closes, the status file says "stopped".
"""
from __future__ import annotations

import json
import logging
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, List, Optional

from hat_split import heap
from edge_runtime.api import openai_api as O
from edge_runtime.api.metrics import EdgeMetrics, bundle_label
from edge_runtime.client import CloudError
from edge_runtime.config import EdgeConfig
from edge_runtime.request import MAX_NEW_TOKENS_LIMIT, GenerationRequest, RequestDefaults
from edge_runtime.runtime import EdgeRuntime
from hat_split import protocols
from hat_split.files.atomic import write_json
from hat_split.files.settings import setting
from hat_split.models.chat import encode_chat
from hardware.device_profiles import get_profile
from hardware.jetson_control import ModeCycler
from hat_split.files import strict_json

MAX_BODY_BYTES = 1 << 20
SHED_RETRY_S = {"busy": 2, "memory_full": 2, "quota": 5}  # cloud refusals for load → 503, with Retry-After (s)
SHED_CODES = tuple(SHED_RETRY_S)
GENERATE_KEYS = frozenset({"prompt", "protocol", "max_tokens", "temperature", "top_p", "top_k", "seed", "chat",
                           "private", "allow_lossy", "sla_tokens_per_s"})
log = logging.getLogger("hatspec.agent")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that resets its connection (common after a streamed answer) is not an error of the agent."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("client %s went away: %r", client_address, sys.exc_info()[1])
            return
        super().handle_error(request, client_address)


@dataclass(frozen=True)
class AgentConfig:
    """`hat-edge serve`'s config; as TOML (`--config FILE`), the device's EdgeConfig is its [edge] table."""

    edge: EdgeConfig  # the device: draft, link, engine, protocols (the [edge] table)
    host: str = setting("127.0.0.1", "apps on the device talk to it; not the network")
    port: int = setting(8642, "HTTP port (0: any free one, e.g. many emulated devices in one process)")
    report_interval_s: float = setting(10.0, "seconds between state reports to the cloud (power mode, drafting "
                                       "delay)")
    status_file: str = setting("", "rewrite the agent's status JSON here (hat-fleet status reads it); \"\" = none",
                               metavar="PATH")
    request: RequestDefaults = RequestDefaults()  # what a request gets for what it does not name: protocol,
    # sampling, length, seed (edge_runtime.request; hat-edge serve's --protocol, --temperature, ... set it)
    mode_cycle: tuple = setting((), "nvpmodel modes (ids or names of the device profile) to switch among ...",
                                metavar="MODES")
    mode_every: int = setting(0, "... every this many requests (HAT's testbed); () / 0: never switch", metavar="N")
    max_queue: int = setting(8, "requests that may wait for the draft model behind the one running; more get 429")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.report_interval_s > 0:
            raise ValueError("report_interval_s must be > 0")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if bool(self.mode_cycle) != (self.mode_every > 0):
            raise ValueError("a mode cycle needs both the modes and how many requests between switches")
        if self.mode_cycle and not self.edge.device_profile:
            raise ValueError("a mode cycle names modes of a device profile: give the device profile")


class Agent:
    def __init__(self, config: AgentConfig, loaded=None):
        """loaded: a model already in memory (hat_split.models.loading.load_model) for EdgeRuntime, e.g. one shared by
        several emulated devices in one process (`hat-bench soak`); None loads config.edge.model."""
        self.config = config
        self.started = time.time()
        self.state = "starting"
        self.error = ""
        self.requests = 0
        self.failures = 0
        self.last: dict = {}  # the last request: protocol, finish reason (eos, length, stop, cancelled), tokens
        self.last_report: dict = {}
        self._lock = threading.Lock()  # one generation at a time; reports wait for it
        self.max_queue = config.max_queue
        self._admitted = 0  # requests running or waiting for the lock
        self.heap_trim_s = 0.0  # time spent giving freed heap pages back after requests
        self._admit_lock = threading.Lock()
        self._generation_s = 1.0  # a recent generation's wall time (moving average): the Retry-After estimate
        self.shed = {"queue_full": 0, "cloud": 0}  # requests answered 429 / 503
        self.metrics = EdgeMetrics(self, SHED_CODES)  # Prometheus, GET /metrics (edge_runtime.api.metrics)
        self._stop = threading.Event()
        self._status_lock = threading.Lock()  # the report loop and request threads both rewrite the status file
        self.cycle = None
        if config.mode_cycle:
            profile = get_profile(config.edge.device_profile)
            self.cycle = ModeCycler([profile.mode(str(m)).id for m in config.mode_cycle], config.mode_every)
        self._write_status()
        self.runtime = EdgeRuntime(config.edge, loaded)
        self.httpd = _Server((config.host, config.port), _handler(self))

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def status(self) -> dict:
        c = self.config.edge
        m = self.runtime.monitor if hasattr(self, "runtime") else None
        return {"state": self.state, "error": self.error, "pid": os.getpid(), "device_id": c.link.device_id,
                "profile": c.device_profile, "power_mode": m.power_mode if m else "",
                "power_mode_error": m.mode_error if m else "", "draft_s": m.draft_s if m else 0.0,
                "model": c.model, "backend": c.engine.backend,
                "precision": c.engine.precision if c.engine.backend != "torch" else c.engine.dtype,
                "server": c.link.server, "http": self.address if hasattr(self, "httpd") else "",
                "requests": self.requests, "failures": self.failures, "shed": dict(self.shed),
                "last_request": self.last, "heap_trim_s": self.heap_trim_s,
                "last_report": self.last_report,
                "mode_cycle": None if self.cycle is None else {"switches": self.cycle.switches,
                                                               "error": self.cycle.error},
                "started": self.started, "time": time.time()}

    def _write_status(self) -> None:
        path = self.config.status_file
        if not path:
            return
        with self._status_lock:
            write_json(path, self.status())

    def report(self) -> None:
        """Send the device's state, and what it served lately (EdgeMetrics.stats), to the cloud now; the outcome goes
        into the status."""
        with self._lock:
            try:
                # a report the cloud receives finds it reachable: the agent is ready then, unless stopping
                stats = self.metrics.stats("stopped" if self._stop.is_set() else "ready",
                                           bundle_label(self.config.edge.engine), self.runtime.engine.model_name)
                cloud = self.runtime.report(stats)
                self.last_report = {"time": time.time(), "ok": True, "cloud_batch_tokens": cloud.batch_tokens,
                                    "cloud_step_s": cloud.step_s, "cloud_pipeline": cloud.pipeline}
                self.state, self.error = "ready", ""
            except Exception as exc:  # the cloud is away: keep serving what can be served, say why
                self.last_report = {"time": time.time(), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
                self.state, self.error = "degraded", self.last_report["error"]
                self.runtime.close()  # reconnect on the next attempt
        self._write_status()

    def _run(self, request: GenerationRequest):
        """One generation, one at a time, counted; the mode cycle advances. Returns (result, seconds spent waiting
        for the generation before it, if any). Refused with 429 when max_queue requests already wait, with 503 when
        the cloud refuses it for load (both with Retry-After)."""
        self._admit(request.protocol)
        t0 = time.perf_counter()
        try:
            with self._lock:
                queued = time.perf_counter() - t0
                result = self._generate(request)
                self.requests += 1
                if self.cycle is not None and self.cycle.after_request():
                    self.runtime.monitor.refresh_mode(max_age_s=0.0)  # the next request reports the new mode
                self.last = {"protocol": result.protocol, "finish": result.finish_reason, "tokens": result.n}
                self.metrics.completed(result, queued)
                self.heap_trim_s += heap.trim()  # this request's arena pages back to the system (hat_split.heap)
        finally:
            with self._admit_lock:
                self._admitted -= 1
        self._write_status()
        return result, queued

    def _admit(self, protocol: str) -> None:
        with self._admit_lock:
            if self._admitted > self.max_queue:
                self.shed["queue_full"] += 1
                self.metrics.failed(protocol, "refused")
                wait = self._generation_s * self._admitted
                raise O.ApiError(f"the device is busy: {self._admitted - 1} requests wait behind the one running "
                                 f"(max_queue {self.max_queue}); retry in {wait:.0f} s", status=429,
                                 kind="rate_limit_exceeded", retry_after_s=max(1, math.ceil(wait)))
            self._admitted += 1

    def _generate(self, request: GenerationRequest):
        """runtime.run, timed for the Retry-After estimate; the cloud's refusals for load become 503."""
        started = time.perf_counter()
        try:
            result = self.runtime.run(request)
        except CloudError as exc:
            self.failures += 1
            self.metrics.failed(request.protocol, exc)
            if exc.error.code not in SHED_CODES:
                raise
            self.shed["cloud"] += 1
            raise O.ApiError(f"the cloud sheds load: {exc.error.code}: {exc.error.message}", status=503,
                             kind="server_error", retry_after_s=SHED_RETRY_S[exc.error.code]) from None
        except Exception as exc:
            self.failures += 1
            self.metrics.failed(request.protocol, exc)
            raise
        self._generation_s = 0.7 * self._generation_s + 0.3 * (time.perf_counter() - started)
        return result

    def _request(self, prompt, protocol: Optional[str], **named) -> GenerationRequest:
        """The request, from what it names and the agent's defaults; one that cannot be built is counted as failed
        (its protocol, or "unknown") before the ValueError becomes a 400."""
        try:
            return self.config.request.request(prompt, protocol=protocol, **named)
        except ValueError as exc:
            self.failures += 1
            self.metrics.failed(protocol, exc)
            raise

    def generate(self, body: dict) -> dict:
        """`POST /hatspec/generate`: {"prompt", "protocol", "max_tokens", "temperature", "top_p", "top_k", "seed",
        "chat", "private", "allow_lossy", "sla_tokens_per_s"}; what it leaves out comes from the agent's request
        defaults (config.request)."""
        if not isinstance(body, dict):
            raise ValueError("the request body must be a JSON object")
        unknown = sorted(set(body) - GENERATE_KEYS)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(map(repr, unknown))}: a request takes "
                             f"{', '.join(sorted(GENERATE_KEYS))}")
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("'prompt' must be a non-empty string")
        max_tokens = body.get("max_tokens")
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or not 1 <= max_tokens <= MAX_NEW_TOKENS_LIMIT):
            raise ValueError(f"'max_tokens' must be an integer in 1..{MAX_NEW_TOKENS_LIMIT}")
        sampling = {key: body.get(key) for key in ("temperature", "top_p", "top_k", "seed")}
        request = self._request(prompt, body.get("protocol"), max_new_tokens=max_tokens, **sampling,
                                chat=bool(body.get("chat")), private=body.get("private"),
                                allow_lossy=body.get("allow_lossy"), sla_tokens_per_s=body.get("sla_tokens_per_s"))
        result, queued = self._run(request)
        return {"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
                "protocol": result.protocol, "auto": result.auto, "queue_s": queued, **result.summary()}

    def completion(self, body: Any, chat: bool, send: Optional[Callable[[dict], None]] = None,
                   client_gone: Callable[[], bool] = lambda: False) -> Optional[dict]:
        """An OpenAI completion or chat completion. With `send`, the response is streamed as events through it
        (a failing send, like a client that went away, cancels the generation); without, it is returned."""
        req = O.parse_request(body, chat, protocols.REQUESTABLE, self.config.request)
        if req.stream != (send is not None):
            raise O.ApiError("internal: stream flag and transport disagree", status=500, kind="server_error")
        tok = self.runtime.engine.tokenizer
        if chat:
            if getattr(tok, "chat_template", None) is None:
                raise O.ApiError(f"model {self.runtime.engine.model_name} has no chat template: use /v1/completions",
                                 "messages")
            ids = encode_chat(tok, O.chat_messages(req.messages), add_generation_prompt=True)
        elif isinstance(req.prompt, list):
            ids = list(req.prompt)
            vocab = self.runtime.engine.vocab_size
            if max(ids) >= vocab:
                raise O.ApiError(f"prompt token id {max(ids)} is outside the vocabulary of {vocab}", "prompt")
        else:
            ids = self.runtime.encode_prompt(req.prompt)
        rid, model = O.new_id(chat), self.runtime.engine.model_name
        matcher = O.StopMatcher(req.stop)
        cancelled, opened = [], []
        entries: List[O.TokenLogprob] = []  # each token's log-probabilities, when asked
        streamed = [0]  # of entries, those already sent

        def on_tokens(tokens: List[int], lp) -> None:
            for i, t in enumerate(tokens if lp is not None else ()):
                offset = entries[-1].offset + len(entries[-1].token) if entries else 0
                top = [(tok.decode([int(j)]), float(v)) for j, v in zip(lp.top_ids[i], lp.top_values[i])]
                entries.append(O.TokenLogprob(tok.decode([t]), float(lp.values[i]), top, lp.source, offset))

        def unsent() -> Optional[dict]:
            out, streamed[0] = entries[streamed[0]:], len(entries)
            return O.logprobs_body(req, out)

        def emit(event: dict) -> None:
            if send is not None and not cancelled:
                try:
                    send(event)
                except OSError:
                    cancelled.append(True)

        def on_text(delta: str) -> None:
            out = matcher.feed(delta)
            if out:
                opening()
                emit(O.chunk(req, rid, model, out, logprobs=unsent()))

        def opening() -> None:  # a chat stream's role chunk, once the cloud took the request (else a 429 / 503)
            if chat and not opened:
                opened.append(True)
                emit(O.chunk(req, rid, model, None, role=True))

        def should_stop() -> str:
            if matcher.stopped:
                return "stop"
            return "cancelled" if cancelled or client_gone() else ""

        request = self._request(ids, req.protocol, temperature=req.temperature, top_p=req.top_p,
                                max_new_tokens=req.max_tokens, seed=req.seed, logprobs=req.logprobs, on_text=on_text,
                                on_tokens=on_tokens, should_stop=should_stop, private=req.private,
                                allow_lossy=req.allow_lossy, sla_tokens_per_s=req.sla_tokens_per_s)
        result, queued = self._run(request)
        text, stopped = O.cut_at_stop(result.text, req.stop)
        reason = "stop" if stopped else result.finish_reason
        extra = {"protocol": result.protocol, "finish": result.finish_reason, "rounds": result.rounds,
                 "drafted": result.drafted, "accepted": result.accepted, "ttft_s": result.ttft_s, "queue_s": queued,
                 "up_bytes": result.up_bytes, "down_bytes": result.down_bytes,
                 "interruptions": result.interruptions, "degraded": result.degraded,  # degraded: token indices the
                 # device made alone while the link was down (link_policy degrade): not from the cloud's model
                 "auto": result.auto}  # protocol auto: what ran, for how many tokens, and why
        if req.return_tokens:
            extra["tokens"] = list(result.tokens)
        if send is None:
            kept = [e for e in entries if e.offset < len(text)] if stopped else entries  # none past a stop sequence
            return O.response(req, rid, model, text, reason, len(ids), result.n, extra, O.logprobs_body(req, kept))
        opening()
        if len(text) > matcher.emitted:
            emit(O.chunk(req, rid, model, text[matcher.emitted:], logprobs=unsent()))
        emit({**O.chunk(req, rid, model, None, reason, logprobs=unsent() if len(entries) > streamed[0] else None),
              "hatspec": extra})
        if req.include_usage:
            emit(O.usage_chunk(req, rid, model, len(ids), result.n))
        return None

    def serve_forever(self) -> None:
        """Serve HTTP on a thread; report on this one until stopped (SIGTERM / SIGINT when it is the main thread)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self._stop.set())
            signal.signal(signal.SIGINT, lambda *_: self._stop.set())
        thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        thread.start()
        try:
            while not self._stop.is_set():
                self.report()
                self._stop.wait(self.config.report_interval_s)
        finally:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.runtime.close()
            self.metrics.close()
            self.state = "stopped"
            self._write_status()

    def stop(self) -> None:
        self._stop.set()


def _handler(agent: Agent):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # chunked streams; every response says its length or ends its chunks

        def log_message(self, fmt, *args):  # the agent's log is for the agent, not for every request line
            pass

        def _json(self, code: int, payload: dict, retry_after_s: int = 0) -> None:
            body = strict_json.dumps(payload).encode()
            agent.metrics.responded(self.path, code)
            self.send_response(code)
            if retry_after_s:
                self.send_header("Retry-After", str(retry_after_s))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> Any:
            n = int(self.headers.get("Content-Length") or 0)
            if not 0 < n <= MAX_BODY_BYTES:
                raise O.ApiError(f"a JSON body of 1..{MAX_BODY_BYTES} bytes is required", status=413 if n else 400)
            try:
                return json.loads(self.rfile.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise O.ApiError(f"the body is not JSON: {exc}") from None

        def _client_gone(self) -> bool:
            """True when the client closed its connection (it sends nothing else while it waits)."""
            try:
                readable, _, _ = select.select([self.connection], [], [], 0)
                return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def do_GET(self):
            if self.path == "/hatspec/status":
                self._json(200, agent.status())
            elif self.path == "/v1/models":
                self._json(200, O.models(agent.runtime.engine.model_name))
            elif self.path.split("?")[0] == "/metrics":  # Prometheus text (edge_runtime.api.metrics)
                body, kind = agent.metrics.exposition()
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._json(404, O.ApiError(f"no route {self.path}", status=404).body())

        def do_POST(self):
            routes = {"/v1/completions": False, "/v1/chat/completions": True}
            try:
                if self.path == "/hatspec/generate":
                    return self._json(200, agent.generate(self._body()))
                if self.path not in routes:
                    raise O.ApiError(f"no route {self.path}", status=404)
                body = self._body()
                if isinstance(body, dict) and body.get("stream") is True:
                    return self._stream(body, routes[self.path])
                self._json(200, agent.completion(body, routes[self.path], client_gone=self._client_gone))
            except O.ApiError as exc:
                self._json(exc.status, exc.body(), exc.retry_after_s)
            except ValueError as exc:
                self._json(400, O.ApiError(str(exc)).body())
            except Exception as exc:  # the cloud or the model failed: the device says so, it does not hang
                self._json(502, O.ApiError(f"{type(exc).__name__}: {exc}", status=502, kind="server_error").body())

        def _stream(self, body: dict, chat: bool) -> None:
            started = []

            def send(event: dict) -> None:
                if not started:
                    agent.metrics.responded(self.path, 200)
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Cache-Control", "no-cache")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    started.append(True)
                self._chunk(b"data: " + strict_json.dumps(event).encode() + b"\n\n")

            try:
                agent.completion(body, chat, send, self._client_gone)  # its last event carries the finish reason
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")
            except O.ApiError as exc:
                if started:
                    self._end_with_error(exc.body())
                else:
                    self._json(exc.status, exc.body(), exc.retry_after_s)
            except OSError:
                pass  # the client went away mid-stream: the generation was cancelled
            except Exception as exc:
                error = O.ApiError(f"{type(exc).__name__}: {exc}", status=502, kind="server_error")
                if started:
                    self._end_with_error(error.body())
                else:
                    self._json(502, error.body())

        def _end_with_error(self, body: dict) -> None:
            try:
                self._chunk(b"data: " + strict_json.dumps(body).encode() + b"\n\n")
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")
            except OSError:
                pass

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


def run_agent(config: AgentConfig) -> int:
    agent = Agent(config)
    link = config.edge.link
    print(f"hat-edge serve: {link.device_id} on {agent.address}, cloud {link.server}", flush=True)
    agent.serve_forever()
    return 0
