"""Prometheus metrics (issue 27): the cloud's `GET /metrics` on --metrics-port and the device agent's beside its
OpenAI API, scraped over real HTTP and parsed with prometheus_client's own parser while real requests run; a bad port
refused when the config is made, a port in use refused in one line when the cloud starts."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, FrozenSet, Tuple

import numpy as np
import pytest

from cloud_runtime.config import CloudConfig
from cloud_runtime.metrics import listen_host
from cloud_runtime.process import CloudProcess, free_port
from hat_split.net.security import LinkSecurity
from hat_split.wire import messages as P

prometheus = pytest.importorskip("prometheus_client.parser")

Samples = Dict[Tuple[str, FrozenSet[Tuple[str, str]]], float]
PROMPT = [5, 17, 99, 3, 250, 7]
PLAIN = LinkSecurity.plaintext()
DOCUMENTED = set(re.findall(r"^\| `(hatspec_\w+)` \|", (Path(__file__).parents[1] / "docs" / "METRICS.md").read_text(),
                            re.M))


def scrape(url: str) -> Samples:
    """Every sample of a /metrics page, by (name, labels); the page must parse and hold only hatspec's metrics (its
    own registry: no process_ or python_ metrics of prometheus_client's global one), each listed in docs/METRICS.md."""
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out: Samples = {}
    for family in prometheus.text_string_to_metric_families(text):
        if not family.name.endswith("_created"):  # prometheus_client's start time of each counter and histogram
            assert family.name + ("_total" if family.type == "counter" else "") in DOCUMENTED, family.name
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_a_bad_metrics_port_is_refused_when_the_config_is_made(capsys):
    for port in (-1, 65536):
        with pytest.raises(ValueError, match=rf"metrics_port must be a TCP port in 1..65535 \(0: off\), got {port}"):
            CloudConfig(model="m", security=PLAIN, metrics_port=port)
    with pytest.raises(ValueError, match="metrics_port 5555 is the port of the ZeroMQ socket"):
        CloudConfig(model="m", security=PLAIN, bind="tcp://0.0.0.0:5555", metrics_port=5555)
    assert CloudConfig(model="m", security=PLAIN).metrics_port == 0  # off by default
    from cloud_runtime.cli import main

    assert main(["serve", "--model", "m", "--plaintext", "--metrics-port", "70000"]) == 2
    err = capsys.readouterr().err
    assert err == "hat-cloud: the command line: metrics_port must be a TCP port in 1..65535 (0: off), got 70000\n"
    assert (listen_host("tcp://*:5555"), listen_host("tcp://10.0.0.2:5555"), listen_host("tcp://[::1]:5555"),
            listen_host("ipc:///tmp/cloud")) == ("0.0.0.0", "10.0.0.2", "::1", "127.0.0.1")


def test_a_failed_request_is_counted_by_why():
    from edge_runtime.api.metrics import outcome
    from edge_runtime.client import CloudError, CloudUnavailable, LinkDown

    shed = ("busy", "memory_full", "quota")
    assert [outcome(CloudError(P.Error(code, "x")), shed) for code in ("busy", "quota", "desync")] == [
        "shed", "shed", "cloud_error"]
    assert [outcome(e, shed) for e in (LinkDown("reset"), CloudUnavailable("no answer"), ValueError("bad seed"),
                                       RuntimeError("boom"))] == ["link_down", "link_down", "invalid", "error"]


def test_what_auto_chose_is_counted_by_protocol_and_why():
    from edge_runtime.api.metrics import EdgeMetrics
    from edge_runtime.sessions.base import GenerationResult

    m = EdgeMetrics(agent=None)
    res = GenerationResult(protocol="auto", tokens=[1] * 19, total_s=1.0, ttft_s=0.1, auto=[
        {"protocol": "sd", "knob": 4, "tokens": 3, "rounds": 1, "reason": "measuring sd: 0 of 3 rounds"},
        {"protocol": "sd", "knob": 8, "tokens": 2, "rounds": 1, "reason": "opening: predicted sd γ=8 3 tok/s"},
        {"protocol": "llm", "knob": 8, "tokens": 8, "rounds": 1, "reason": "predicted llm 9 tok/s"},
        {"protocol": "slm", "knob": 0, "tokens": 1, "rounds": 0, "reason": "the cloud unreachable: ..."},
        {"protocol": "sd", "knob": 6, "tokens": 5, "rounds": 1, "reason": "predicted llm 9 tok/s; sd γ=6 keeps 4 tok/s "
         "(4.7) at the least cloud compute a token: 25 ms (llm 100 ms)"}])
    m.completed(res, 0.0)
    got = {(s.labels["chosen"], s.labels["why"]): s.value for f in m.auto_tokens.collect()
           for s in f.samples if s.name.endswith("_total")}
    assert got == {("sd", "measuring"): 3, ("sd", "opening"): 2, ("llm", "predicted"): 8, ("slm", "unreachable"): 1,
                   ("sd", "sla"): 5}
    assert m.requests.labels("auto", "completed")._value.get() == 1


def test_the_cloud_metrics_move_as_a_device_is_served(tiny_pair):
    """A tiny target served in this process: a session open, a quota refusal, then an sd generation; the scraped
    counters equal what the server and the device counted."""
    from edge_runtime.client import CloudClient, CloudError
    from edge_runtime.config import EdgeConfig, LinkConfig
    from edge_runtime.drafter import Drafter
    from edge_runtime.protocols import new_session
    from edge_runtime.request import GenerationRequest
    from hat_split.math.sampling import SamplingParams
    from tests.conftest import serving

    draft, target = tiny_pair
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with serving(target, device_sessions=1, metrics_port=port) as server:
        idle = scrape(url)
        assert get(idle, "hatspec_cloud_sessions") == 0 and get(idle, "hatspec_cloud_steps_total") == 0
        assert get(idle, "hatspec_cloud_kv_budget_bytes") == server.kv_bytes > 0
        link = LinkConfig(server.endpoint, security=PLAIN)
        with CloudClient(link, P.Hello("dev-A", "tiny", 512, "tiny-vocab")) as client:
            assert isinstance(client.request(P.OpenSession(1, "sd", np.asarray(PROMPT, np.int32))), P.SessionOpened)
            held = scrape(url)
            assert get(held, "hatspec_cloud_sessions") == 1 == get(held, "hatspec_cloud_device_sessions",
                                                                       device="dev-A")
            assert get(held, "hatspec_cloud_kv_positions") == len(PROMPT) - 1  # the last token comes with drafts
            assert get(held, "hatspec_cloud_kv_bytes") == server.work.held_bytes((client_id(server), 1)) > 0
            with pytest.raises(CloudError, match="sessions quota"):
                client.request(P.OpenSession(2, "sd", np.asarray(PROMPT, np.int32)))
            client.request(P.CloseSession(1))
            request = GenerationRequest(PROMPT, "sd", SamplingParams(0.0), 12, seed=0)
            result = new_session(EdgeConfig(model="tiny"), request, Drafter(draft, SamplingParams(0.0)), client,
                                 frozenset(), 3).run(PROMPT, lambda t: "")
        after = scrape(url)
    steps = get(after, "hatspec_cloud_steps_total")
    assert steps > 0 and get(after, "hatspec_cloud_batch_tokens_count") == steps == get(
        after, "hatspec_cloud_step_seconds_count") == get(after, "hatspec_cloud_batch_segments_count")
    assert get(after, "hatspec_cloud_batch_tokens_sum") == get(after, "hatspec_cloud_step_tokens_total") > 0
    assert get(after, "hatspec_cloud_step_seconds_sum") == pytest.approx(server.work.stats.forward_s)
    assert get(after, "hatspec_cloud_sessions_opened_total") == 2 and get(after, "hatspec_cloud_sessions") == 0
    assert get(after, "hatspec_cloud_kv_bytes") == 0
    assert get(after, "hatspec_cloud_errors_total", code="quota") == 1
    assert get(after, "hatspec_cloud_quota_refusals_total", quota="sessions") == 1
    assert get(after, "hatspec_cloud_requests_total", type="OpenSession") == 3  # 2 opened, 1 refused
    assert get(after, "hatspec_cloud_requests_total", type="Verify") == result.rounds > 0
    assert get(after, "hatspec_cloud_verifications_total") == result.rounds
    assert get(after, "hatspec_cloud_draft_tokens_verified_total") == result.drafted > 0
    assert get(after, "hatspec_cloud_draft_tokens_accepted_total") == result.accepted
    assert get(after, "hatspec_cloud_received_bytes_total") == server.stats.bytes_in > 0
    assert get(after, "hatspec_cloud_sent_bytes_total") == server.stats.bytes_out > 0
    assert get(after, "hatspec_cloud_device_usage_positions", device="dev-A") > 0
    assert get(after, "hatspec_cloud_device_info", device="dev-A", model="tiny", profile="", power_mode="") == 1
    with pytest.raises(urllib.error.URLError):  # the endpoint closed with the server
        urllib.request.urlopen(url, timeout=5)


def client_id(server) -> bytes:
    """The ROUTER identity of the one device connected."""
    (identity,) = server.tables.registry.peers
    return identity


def test_a_metrics_port_in_use_is_refused_when_the_cloud_starts(tiny_pair):
    from tests.conftest import serving

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"^metrics_port {port}: cannot listen on 127.0.0.1:{port}: Address already "
                                          "in use$"):
            with serving(tiny_pair[1], metrics_port=port) as server:
                pytest.fail(f"served on a busy port: {server.endpoint}")


@pytest.mark.real_models
def test_the_agent_and_cloud_metrics_move_with_a_completion(smollm2):
    """A `hat-cloud serve --metrics-port` process and an agent (smollm2-135m both sides): one completion moves the
    agent's tokens, link bytes, TTFT and acceptance counters by what its answer reports, and the cloud's steps; a
    second cloud on the same metrics port stops with a one-line error."""
    from edge_runtime.api.agent import Agent, AgentConfig
    from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig

    port = free_port()
    cloud_url = f"http://127.0.0.1:{port}/metrics"
    with CloudProcess("smollm2-135m", extra_args=["--dtype", "float32", "--metrics-port", str(port)],
                      threads=1) as cloud:
        link = LinkConfig(cloud.endpoint, security=PLAIN, device_id="metrics-test")
        agent = Agent(AgentConfig(EdgeConfig(model="smollm2-135m", link=link, engine=EngineConfig(threads=1)),
                                  port=0, report_interval_s=600.0), loaded=smollm2)
        thread = threading.Thread(target=agent.serve_forever, daemon=True)
        thread.start()
        try:
            before = scrape(cloud_url)
            status, body = _post(agent.address + "/v1/completions",
                                 {"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0})
            assert status == 200, body
            status, refused = _post(agent.address + "/hatspec/generate", {"prompt": "x", "protocol": "telepathy"})
            assert status == 400 and "unknown protocol" in refused["error"]["message"]
            agent.report()  # the device's state, γ measured by the completion, reaches the cloud now
            edge, after = scrape(agent.address + "/metrics"), scrape(cloud_url)
            gamma = agent.runtime.monitor.draft_s
            agent.max_queue = 0  # one request waits for the draft model (held here); the next is refused with 429
            with agent._lock:
                waiting = threading.Thread(target=_post, args=(agent.address + "/hatspec/generate",
                                                               {"prompt": "x", "max_tokens": 2}))
                waiting.start()
                while agent._admitted == 0:
                    waiting.join(0.01)
                assert _post(agent.address + "/hatspec/generate", {"prompt": "x", "max_tokens": 2})[0] == 429
            waiting.join(timeout=60)
            busy = scrape(agent.address + "/metrics")
        finally:
            agent.stop()
            thread.join(timeout=30)
        second = subprocess.run([sys.executable, "-m", "cloud_runtime.cli", "serve", "--model", "smollm2-135m",
                                 "--dtype", "float32", "--threads", "1", "--plaintext", "--bind",
                                 f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(port)],
                                capture_output=True, text=True, timeout=300)
    assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr
    assert second.stderr.strip().splitlines()[-1] == (f"hat-cloud: metrics_port {port}: cannot listen on "
                                                      f"127.0.0.1:{port}: Address already in use")

    h, n = body["hatspec"], body["usage"]["completion_tokens"]
    assert get(edge, "hatspec_edge_requests_total", protocol="sd", outcome="completed") == 1
    assert get(edge, "hatspec_edge_requests_total", protocol="unknown", outcome="invalid") == 1
    assert get(edge, "hatspec_edge_finished_total", protocol="sd", reason=body["choices"][0]["finish_reason"]) == 1
    assert get(edge, "hatspec_edge_generated_tokens_total", protocol="sd") == n == 12
    assert get(edge, "hatspec_edge_uplink_bytes_total", protocol="sd") == h["up_bytes"] > 0
    assert get(edge, "hatspec_edge_downlink_bytes_total", protocol="sd") == h["down_bytes"] > 0
    assert get(edge, "hatspec_edge_draft_tokens_total", protocol="sd") == h["drafted"] > 0
    assert get(edge, "hatspec_edge_accepted_tokens_total", protocol="sd") == h["accepted"]
    assert get(edge, "hatspec_edge_rounds_total", protocol="sd") == h["rounds"]
    assert get(edge, "hatspec_edge_time_to_first_token_seconds_count", protocol="sd") == 1
    assert get(edge, "hatspec_edge_time_to_first_token_seconds_sum", protocol="sd") == pytest.approx(
        h["ttft_s"] + h["queue_s"])
    assert get(edge, "hatspec_edge_time_per_output_token_seconds_count", protocol="sd") == 1
    assert get(edge, "hatspec_edge_http_responses_total", route="/v1/completions", code="200") == 1
    assert get(edge, "hatspec_edge_http_responses_total", route="/hatspec/generate", code="400") == 1
    assert get(edge, "hatspec_edge_state", state="ready") == 1 and get(edge, "hatspec_edge_cloud_reachable") == 1
    assert get(edge, "hatspec_edge_draft_seconds") == gamma > 0
    assert any(name == "hatspec_edge_power_sampler_info" for name, _ in edge)  # psutil at least: load, no power
    assert get(busy, "hatspec_edge_requests_total", protocol="sd", outcome="refused") == 1
    assert get(busy, "hatspec_edge_requests_total", protocol="sd", outcome="completed") == 2
    assert get(busy, "hatspec_edge_http_responses_total", route="/hatspec/generate", code="429") == 1
    assert get(busy, "hatspec_edge_queue_seconds_count") == 2 and get(busy, "hatspec_edge_queue_seconds_sum") > 0

    assert get(after, "hatspec_cloud_steps_total") > get(before, "hatspec_cloud_steps_total")
    assert get(after, "hatspec_cloud_verifications_total") == h["rounds"]
    assert get(after, "hatspec_cloud_draft_tokens_verified_total") == h["drafted"]
    assert get(after, "hatspec_cloud_draft_tokens_accepted_total") == h["accepted"]
    assert get(after, "hatspec_cloud_requests_total", type="Report") >= 1
    assert get(after, "hatspec_cloud_device_draft_seconds", device="metrics-test") == pytest.approx(gamma)


def _post(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
