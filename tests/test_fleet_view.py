"""The fleet view (issue 27): device agents' reports carry what they served lately (DeviceStats), the cloud keeps the
latest per device and renders one JSON document of the cloud and every device it knows. The rendering and the
agent's window on plain data, the wire round trip, and devices reporting through real CloudClients (and a real agent)
to an in-process cloud."""
from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import numpy as np
import pytest

from cloud_runtime.fleet import fleet_view, render
from cloud_runtime.metrics import device_families, snapshot
from edge_runtime.api.metrics import STATS_REQUESTS, EdgeMetrics, Outcome, bundle_label, window_stats
from edge_runtime.client import CloudClient, CloudError, CloudUnavailable
from edge_runtime.config import EngineConfig, LinkConfig
from edge_runtime.sessions.base import GenerationResult
from hat_split.net.security import LinkSecurity
from hat_split.wire import messages as P
from tests.conftest import serving

PLAIN = LinkSecurity.plaintext()
ROW_KEYS = ["device", "connected", "state", "model", "bundle", "profile", "power_mode", "watts", "requests",
            "protocols", "tokens_per_s", "ttft_p50_s", "tbt_p50_s", "acceptance", "up_bps", "down_bps", "link_drops",
            "sessions", "kv_bytes", "usage", "last_report_s"]
CLOUD_KEYS = ["model", "engine", "sessions", "max_sessions", "kv_bytes", "kv_budget_bytes", "steps", "step_tokens",
              "devices"]
STATS = P.DeviceStats(state="ready", bundle="smollm2-135m (onnxruntime int4)", model="smollm2-135m", requests=5,
                      protocols={"sd": 3, "hat": 2}, tokens_per_s=41.5, ttft_p50_s=0.125, tbt_p50_s=0.03125,
                      acceptance=0.75, link_drops=1, watts=7.5)


def _snapshot(**over):
    """A cloud snapshot as cloud_runtime.fleet.read makes it: plain values."""
    snap = {"model": "tiny-target", "engine": "torch", "max_sessions": 64, "kv_bytes": 3072, "kv_budget_bytes": 1 << 20,
            "steps": {"steps": 9, "tokens": 40}, "sessions": {"zeta": 2, "jetson-b": 0}, "kv_by_device": {"zeta": 3072},
            "usage": {"zeta": 12.5, "jetson-a": 4.0}, "connected": ["jetson-a", "jetson-b"],
            "devices": {"jetson-b": {"device_id": "jetson-b", "model": "tiny"},
                        "jetson-a": {"device_id": "jetson-a", "model": "tiny", "power_mode": "MAXN", "up_bps": 8e6,
                                     "profile": "orin-nano", "report_at": 990.0,
                                     "stats": msgspec.structs.asdict(STATS)}}}
    snap.update(over)
    return snap


def test_the_document_on_plain_data():
    """Rows sorted by device, one per device that said Hello or holds sessions; a device that never reported is
    "unknown" with nulls; a reported one carries its figures; the cloud's accounting per device."""
    view = render(_snapshot(), now=1000.0)
    json.dumps(view, allow_nan=False)  # a JSON document as it is
    assert list(view) == ["time", "cloud", "devices"] and view["time"] == 1000.0
    assert view["cloud"] == {"model": "tiny-target", "engine": "torch", "sessions": 2, "max_sessions": 64,
                             "kv_bytes": 3072, "kv_budget_bytes": 1 << 20, "steps": 9, "step_tokens": 40,
                             "devices": 3}
    assert list(view["cloud"]) == CLOUD_KEYS
    a, b, z = view["devices"]
    assert [r["device"] for r in (a, b, z)] == ["jetson-a", "jetson-b", "zeta"]
    assert all(list(r) == ROW_KEYS for r in (a, b, z))
    assert a == {"device": "jetson-a", "connected": True, "state": "ready", "model": "smollm2-135m",
                 "bundle": "smollm2-135m (onnxruntime int4)", "profile": "orin-nano", "power_mode": "MAXN",
                 "watts": 7.5, "requests": 5, "protocols": {"sd": 3, "hat": 2}, "tokens_per_s": 41.5,
                 "ttft_p50_s": 0.125, "tbt_p50_s": 0.03125, "acceptance": 0.75, "up_bps": 8e6, "down_bps": 0.0,
                 "link_drops": 1, "sessions": 0, "kv_bytes": 0, "usage": 4.0, "last_report_s": 10.0}
    assert b == {"device": "jetson-b", "connected": True, "state": "unknown", "model": "tiny", "bundle": "",
                 "profile": "", "power_mode": "", "watts": None, "requests": 0, "protocols": {},
                 "tokens_per_s": None, "ttft_p50_s": None, "tbt_p50_s": None, "acceptance": None, "up_bps": 0.0,
                 "down_bps": 0.0, "link_drops": 0, "sessions": 0, "kv_bytes": 0, "usage": 0.0,
                 "last_report_s": None}
    assert (z["connected"], z["state"], z["sessions"], z["kv_bytes"], z["usage"]) == (False, "unknown", 2, 3072, 12.5)
    empty = render(_snapshot(devices={}, sessions={}, connected=[], kv_by_device={}), now=5.0)
    assert empty["devices"] == [] and empty["cloud"]["devices"] == 0  # usage alone (decaying) is no device


def test_the_window_on_plain_data():
    """Exact figures of hand-made outcomes; an outcome older than the window is left out; nothing measured: None."""
    o = [Outcome(100.0, "sd", 10, 2.0, 0.5, 0.1, drafted=8, accepted=6),
         Outcome(101.0, "sd", 1, 0.5, 0.25, None, drafted=0, accepted=0, drops=2),
         Outcome(102.0, "hat", 30, 1.5, 0.125, 0.05),
         Outcome(103.0, "sd", drops=1),  # failed with the cloud unreachable
         Outcome(-500.0, "llm", 100, 0.1, 0.001, 0.001, drafted=100, accepted=0)]  # ended 600 s before: out
    assert window_stats(o, now=105.0, window_s=300.0) == {
        "requests": 4, "protocols": {"sd": 3, "hat": 1}, "tokens_per_s": 41 / 4.0, "ttft_p50_s": 0.25,
        "tbt_p50_s": (0.1 + 0.05) / 2, "acceptance": 0.75, "link_drops": 3}
    assert window_stats([Outcome(0.0, "sd", drops=1)], now=1.0) == {
        "requests": 1, "protocols": {"sd": 1}, "tokens_per_s": None, "ttft_p50_s": None, "tbt_p50_s": None,
        "acceptance": None, "link_drops": 1}
    assert window_stats([], now=0.0)["requests"] == 0
    assert bundle_label(EngineConfig()) == "torch"
    assert bundle_label(EngineConfig(backend="onnxruntime", bundle="/opt/b/smollm2-135m/", precision="int4")) == \
        "smollm2-135m (onnxruntime int4)"


def test_the_agent_metrics_keep_a_window_of_what_ran():
    """EdgeMetrics observes requests as the agent reports them: completed ones with their clocks, failed ones (the
    cloud unreachable: a drop), never a 429; the window holds the last STATS_REQUESTS; the stats are a valid
    DeviceStats (watts None where the board has no power monitor: this machine's psutil)."""
    m = EdgeMetrics(agent=None)
    try:
        m.completed(GenerationResult(protocol="sd", tokens=[1, 2, 3, 4, 5], total_s=1.0, ttft_s=0.2, drafted=8,
                                     accepted=4, interruptions=1), queued_s=0.05)
        m.failed("sd", CloudUnavailable("no answer"))
        m.failed("hat", "refused")  # 429: never ran
        s = m.stats("ready", "torch", "tiny")
        assert isinstance(s, P.DeviceStats) and s == P.decode(P.encode(P.Report(P.DeviceState(), s))).stats
        assert (s.state, s.bundle, s.model, s.requests, s.protocols, s.link_drops) == ("ready", "torch", "tiny", 2,
                                                                                        {"sd": 2}, 2)
        assert s.tokens_per_s == pytest.approx(5.0) and s.ttft_p50_s == pytest.approx(0.25)
        assert s.tbt_p50_s == pytest.approx(0.2) and s.acceptance == 0.5
        reading = m._read()[1]  # the board's power monitor, if it has one
        if reading is None or reading.power_mw is None:
            assert s.watts is None
        else:
            assert s.watts > 0
        for _ in range(STATS_REQUESTS + 10):
            m.failed("llm", ValueError("bad"))
        assert m.stats("ready", "torch", "tiny").protocols == {"llm": STATS_REQUESTS}
        assert m.stats("ready", "torch", "tiny", now=time.monotonic() + 301).requests == 0  # all ended too long ago
    finally:
        m.close()


def test_reports_with_and_without_stats_cross_the_wire():
    """A Report with stats round-trips; one without (an older peer) decodes with None; bad figures are refused by
    the decoder with the field named."""
    with_stats = P.decode(P.encode(P.Report(P.DeviceState(up_bps=1e6), STATS)))
    assert with_stats.stats == STATS and with_stats.device.up_bps == 1e6
    assert P.decode(P.encode(P.Report(P.DeviceState()))).stats is None
    old_peer = [P.MAGIC + bytes([P.PROTOCOL_VERSION]) + msgspec.msgpack.encode({"type": "Report", "device": {}})]
    assert P.decode(old_peer) == P.Report(P.DeviceState())
    newer = msgspec.msgpack.encode({"type": "Report", "device": {}, "stats": {"state": "ready", "gpu_c": 51}})
    assert P.decode([P.MAGIC + bytes([P.PROTOCOL_VERSION]) + newer]).stats == P.DeviceStats(state="ready")
    for field, value in (("acceptance", 1.5), ("requests", -1), ("watts", float("nan")), ("tokens_per_s", -2.0),
                         ("state", "x" * 300)):
        raw = msgspec.msgpack.encode({"type": "Report", "device": {}, "stats": {field: value}})
        with pytest.raises(P.ProtocolError, match=rf"invalid header: .*stats\.{field}"):
            P.decode([P.MAGIC + bytes([P.PROTOCOL_VERSION]) + raw])


def test_a_device_report_reaches_the_fleet_view(tiny_pair):
    """Two devices on a real cloud: A opens a session and reports its stats; B only says Hello. The fleet view holds
    A's figures, its session and KV bytes, B as unknown; bad stats are refused with a clear error and change nothing;
    the status file carries them; the per-device gauges carry A's figures and are documented."""
    with serving(tiny_pair[1]) as server:
        link = LinkConfig(server.endpoint, security=PLAIN)
        with CloudClient(link, P.Hello("dev-A", "tiny", 512, "tiny-vocab")) as a, \
                CloudClient(link, P.Hello("dev-B", "tiny", 512, "tiny-vocab")):  # connected: said Hello
            assert isinstance(a.request(P.OpenSession(1, "sd", np.arange(1, 9, dtype=np.int32))), P.SessionOpened)
            state = P.DeviceState(up_bps=8e6, down_bps=2e7, power_mode="15W", profile="orin-nano")
            assert isinstance(a.request(P.Report(state, STATS)), P.Reported)
            for bad, why in ((msgspec.structs.replace(STATS, tokens_per_s=float("inf")), "tokens_per_s must be finite"),
                             (msgspec.structs.replace(STATS, protocols={"sd": 3, "telepathy": 2}),
                              r"unknown protocols \['telepathy'\]"),
                             (msgspec.structs.replace(STATS, requests=4), "count 4 requests but 5 by protocol")):
                with pytest.raises(CloudError, match=why):
                    a.request(P.Report(P.DeviceState(power_mode="7W"), bad))
            view = fleet_view(server)
            kv = server.work.held_bytes(next(k for k, _ in server.tables.sessions.items()))
            status = json.loads(json.dumps(server.report()))  # the status file (--status-file) stays JSON
            assert [d.get("stats") for d in status["devices"]] == [msgspec.structs.asdict(STATS), None]
            families = {f.name: f for f in device_families(snapshot(server, server.metrics))}
    print(json.dumps(view, indent=1))
    json.dumps(view, allow_nan=False)
    assert [r["device"] for r in view["devices"]] == ["dev-A", "dev-B"]
    row, other = view["devices"]
    assert {k: row[k] for k in ("connected", "state", "model", "bundle", "profile", "power_mode", "watts", "requests",
                                "protocols", "tokens_per_s", "ttft_p50_s", "tbt_p50_s", "acceptance", "up_bps",
                                "down_bps", "link_drops", "sessions")} == {
        "connected": True, "state": "ready", "model": "smollm2-135m", "bundle": "smollm2-135m (onnxruntime int4)",
        "profile": "orin-nano", "power_mode": "15W", "watts": 7.5, "requests": 5, "protocols": {"sd": 3, "hat": 2},
        "tokens_per_s": 41.5, "ttft_p50_s": 0.125, "tbt_p50_s": 0.03125, "acceptance": 0.75, "up_bps": 8e6,
        "down_bps": 2e7, "link_drops": 1, "sessions": 1}
    assert row["kv_bytes"] == kv > 0 and row["usage"] > 0 and 0 <= row["last_report_s"] < 30
    assert (other["state"], other["connected"], other["sessions"], other["last_report_s"]) == ("unknown", True, 0,
                                                                                               None)
    c = view["cloud"]
    assert (c["model"], c["sessions"], c["devices"], c["kv_bytes"]) == ("tiny-target", 1, 2, kv)
    assert c["steps"] >= 1 and c["step_tokens"] >= 7  # the prompt's prefill
    assert time.time() - 30 < view["time"] <= time.time()

    def sample(name, **labels):
        return {tuple(sorted(s.labels.items())): s.value for s in families[name].samples}[tuple(sorted(
            {"device": "dev-A", **labels}.items()))]

    assert sample("hatspec_cloud_device_tokens_per_second") == 41.5
    assert sample("hatspec_cloud_device_acceptance_ratio") == 0.75
    assert sample("hatspec_cloud_device_power_watts") == 7.5
    assert sample("hatspec_cloud_device_recent_protocol_requests", protocol="hat") == 2
    assert sample("hatspec_cloud_device_agent_info", state="ready", bundle=STATS.bundle) == 1
    documented = set(re.findall(r"^\| `(hatspec_\w+)` \|", (Path(__file__).parents[1] / "docs" / "METRICS.md")
                                .read_text(), re.M))
    assert set(families) <= documented


@pytest.mark.real_models
def test_an_agent_report_reaches_the_fleet_view(smollm2):
    """A real agent (smollm2-135m) serving beside an in-process cloud of the same model: its first report (nothing
    served yet), one generation over its HTTP API, then report() carries that request's figures to the fleet view."""
    from edge_runtime.api.agent import Agent, AgentConfig
    from edge_runtime.config import EdgeConfig
    from hat_split.models.lm import CausalLM
    from hat_split.models.loading import vocab_fingerprint

    with serving(CausalLM(smollm2.model), vocab=vocab_fingerprint(smollm2.tokenizer)) as server:
        link = LinkConfig(server.endpoint, security=PLAIN, device_id="agent-fleet")
        agent = Agent(AgentConfig(EdgeConfig(model="smollm2-135m", link=link, engine=EngineConfig(threads=1)),
                                  port=0, report_interval_s=600.0), loaded=smollm2)
        thread = threading.Thread(target=agent.serve_forever, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 60
            while not agent.last_report and time.monotonic() < deadline:  # the loop's first report
                time.sleep(0.05)
            first = fleet_view(server)
            req = urllib.request.Request(agent.address + "/hatspec/generate", headers={"Content-Type":
                                                                                       "application/json"},
                                         data=json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 6,
                                                          "temperature": 0}).encode())
            with urllib.request.urlopen(req, timeout=300) as r:
                out = json.loads(r.read())
            agent.report()
            view = fleet_view(server)
        finally:
            agent.stop()
            thread.join(timeout=30)
    print(json.dumps(view, indent=1))
    assert agent.last_report["ok"]
    assert [(r["device"], r["state"], r["requests"]) for r in first["devices"]] == [("agent-fleet", "ready", 0)]
    (row,) = view["devices"]
    assert (row["device"], row["connected"], row["state"], row["bundle"], row["model"]) == (
        "agent-fleet", True, "ready", "torch", agent.runtime.engine.model_name)
    assert (row["requests"], row["protocols"], row["link_drops"]) == (1, {"sd": 1}, 0)
    assert row["acceptance"] == pytest.approx(out["acceptance_rate"])
    assert row["tokens_per_s"] == pytest.approx(out["tokens_per_s"])
    assert row["ttft_p50_s"] == pytest.approx(out["ttft_s"] + out["queue_s"])
    assert row["last_report_s"] < 30
