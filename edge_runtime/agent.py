"""The long-running edge agent (`hat-edge serve`): one EdgeRuntime held ready, its state reported, requests served.

What it does:
- holds the draft (torch model or hat-export bundle) and the cloud connection of one EdgeRuntime;
- every `report_interval_s` it reads the board's power mode and sends the device's state — profile, power mode,
  drafting delay γ, link estimates — to the cloud (protocol Report; HAT §3.2), and rewrites `status_file` (JSON,
  atomically) with what `hat-fleet status` shows: state, pid, model, backend, requests served, last report, cloud load;
- serves HTTP on a device-local address: `GET /hatspec/status` (the same JSON) and `POST /hatspec/generate`
  (JSON {"prompt", "protocol", "max_tokens", "temperature", "top_p", "seed", "chat"} → the generation's summary);
  generations run one at a time (a device has one draft model);
- SIGTERM / SIGINT stop it cleanly: the server closes, the status file says "stopped".
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from edge_runtime.config import EdgeConfig
from hat_split.sampling import SamplingParams

MAX_BODY_BYTES = 1 << 20


@dataclass
class AgentConfig:
    edge: EdgeConfig
    host: str = "127.0.0.1"  # apps on the device talk to it; not the network
    port: int = 8642
    report_interval_s: float = 10.0
    status_file: str = ""
    default_protocol: str = "sd"
    mode_cycle: tuple = ()  # nvpmodel modes (ids or names of the device profile) to switch among ...
    mode_every: int = 0  # ... every this many requests (HAT's testbed); () / 0: never switch
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.report_interval_s > 0:
            raise ValueError("report_interval_s must be > 0")
        if bool(self.mode_cycle) != (self.mode_every > 0):
            raise ValueError("a mode cycle needs both the modes and how many requests between switches")
        if self.mode_cycle and not self.edge.device_profile:
            raise ValueError("a mode cycle names modes of a device profile: give the device profile")


class Agent:
    def __init__(self, config: AgentConfig):
        from edge_runtime.runtime import EdgeRuntime

        self.config = config
        self.state = "starting"
        self.error = ""
        self.requests = 0
        self.failures = 0
        self.last_report: dict = {}
        self._lock = threading.Lock()  # one generation at a time; reports wait for it
        self._stop = threading.Event()
        self._status_lock = threading.Lock()  # the report loop and request threads both rewrite the status file
        self.cycle = None
        if config.mode_cycle:
            from profiles.device_profiles import get_profile
            from profiles.jetson_control import ModeCycler

            profile = get_profile(config.edge.device_profile)
            self.cycle = ModeCycler([profile.mode(str(m)).id for m in config.mode_cycle], config.mode_every)
        self._write_status()
        self.runtime = EdgeRuntime(config.edge)
        self.httpd = ThreadingHTTPServer((config.host, config.port), _handler(self))
        self.httpd.daemon_threads = True

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def status(self) -> dict:
        c = self.config.edge
        m = self.runtime.monitor if hasattr(self, "runtime") else None
        return {"state": self.state, "error": self.error, "pid": os.getpid(), "device_id": c.device_id,
                "profile": c.device_profile, "power_mode": m.power_mode if m else "",
                "power_mode_error": m.mode_error if m else "", "draft_s": m.draft_s if m else 0.0,
                "model": c.model, "backend": c.backend, "precision": c.precision if c.backend != "torch" else c.dtype,
                "server": c.server, "http": self.address if hasattr(self, "httpd") else "",
                "requests": self.requests, "failures": self.failures, "last_report": self.last_report,
                "mode_cycle": None if self.cycle is None else {"switches": self.cycle.switches, "error": self.cycle.error},
                "started": self.config.started, "time": time.time()}

    def _write_status(self) -> None:
        path = self.config.status_file
        if not path:
            return
        with self._status_lock:
            tmp = f"{path}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.status(), f)
            os.replace(tmp, path)

    def report(self) -> None:
        """Send the device's state to the cloud now; the outcome goes into the status."""
        with self._lock:
            try:
                cloud = self.runtime.report()
                self.last_report = {"time": time.time(), "ok": True, "cloud_batch_tokens": cloud.batch_tokens,
                                    "cloud_step_s": cloud.step_s, "cloud_pipeline": cloud.pipeline}
                self.state, self.error = "ready", ""
            except Exception as exc:  # the cloud is away: keep serving what can be served, say why
                self.last_report = {"time": time.time(), "ok": False, "error": f"{type(exc).__name__}: {exc}"}
                self.state, self.error = "degraded", self.last_report["error"]
                self.runtime.close()  # reconnect on the next attempt
        self._write_status()

    def generate(self, body: dict) -> dict:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("'prompt' must be a non-empty string")
        protocol = body.get("protocol", self.config.default_protocol)
        max_tokens = body.get("max_tokens", 64)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= 4096:
            raise ValueError("'max_tokens' must be an integer in 1..4096")
        params = SamplingParams(float(body.get("temperature", 0.0)), 0, float(body.get("top_p", 1.0)))
        seed = body.get("seed")
        if seed is not None and not isinstance(seed, int):
            raise ValueError("'seed' must be an integer")
        with self._lock:
            try:
                result = self.runtime.generate(prompt, protocol, params, max_tokens, seed, bool(body.get("chat")))
            except Exception:
                self.failures += 1
                raise
            self.requests += 1
            if self.cycle is not None and self.cycle.after_request():
                self.runtime.monitor.refresh_mode(max_age_s=0.0)  # the next request reports the new mode
        self._write_status()
        return {"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
                "protocol": result.protocol, **result.summary()}

    def serve_forever(self) -> None:
        """Serve HTTP on a thread; report on this one until stopped."""
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
            self.state = "stopped"
            self._write_status()

    def stop(self) -> None:
        self._stop.set()


def _handler(agent: Agent):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # the agent's log is for the agent, not for every request line
            pass

        def _json(self, code: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/hatspec/status":
                self._json(200, agent.status())
            else:
                self._json(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            if self.path != "/hatspec/generate":
                return self._json(404, {"error": f"no route {self.path}"})
            try:
                n = int(self.headers.get("Content-Length", "0"))
                if not 0 < n <= MAX_BODY_BYTES:
                    raise ValueError(f"a JSON body of 1..{MAX_BODY_BYTES} bytes is required")
                body = json.loads(self.rfile.read(n))
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                self._json(200, agent.generate(body))
            except (ValueError, json.JSONDecodeError) as exc:
                self._json(400, {"error": str(exc)})
            except Exception as exc:
                self._json(502, {"error": f"{type(exc).__name__}: {exc}"})

    return Handler


def run_agent(config: AgentConfig) -> int:
    agent = Agent(config)
    print(f"hat-edge serve: {config.edge.device_id} on {agent.address}, cloud {config.edge.server}", flush=True)
    agent.serve_forever()
    return 0
