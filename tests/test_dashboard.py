"""The live fleet view (issue 27): the cloud's dashboard (`hat-cloud serve --dashboard-port`: GET / and GET
/fleet.json over real HTTP, the page rendered in headless Chromium against a real cloud with reporting devices) and
`hat-fleet top` (its pure table formatting, `--once`, and the curses view driven under tmux).

`python -m tests.test_dashboard` rewrites docs/dashboard.png (the page of a small local fleet)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, List

import numpy as np
import pytest

from cloud_runtime.config import CloudConfig
from cloud_runtime.dashboard import Dashboard
from cloud_runtime.process import free_port
from tests.conftest import refusing_port
from export.deploy import top
from hat_split.net.security import LinkSecurity

PLAIN = LinkSecurity.plaintext()
ROOT = Path(__file__).parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TMUX = shutil.which("tmux")
# LINES / COLUMNS left out: pytest-xdist's workers set them to 24 x 80, and curses would take them over tmux's window
UTF8 = {**{k: v for k, v in os.environ.items() if k not in ("LINES", "COLUMNS")}, "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8"}


def device(name: str, **over) -> dict:
    d = {"device": name, "connected": True, "state": "ready", "model": "smollm2-135m", "bundle": "orin-int4",
         "profile": "agx-orin-64gb", "power_mode": "MAXN", "watts": 23.46, "requests": 8,
         "protocols": {"sd": 6, "hat": 2}, "tokens_per_s": 41.27, "ttft_p50_s": 0.0853, "tbt_p50_s": 0.0042,
         "acceptance": 0.784, "up_bps": 12_345_678.0,
         "down_bps": 850.0, "link_drops": 1, "sessions": 1, "kv_bytes": 4096, "usage": 12.5, "last_report_s": 3.2}
    d.update(over)
    return d


NEW = dict(state="unknown", bundle="", power_mode="", watts=None, requests=0, protocols={}, tokens_per_s=None,
           ttft_p50_s=None, tbt_p50_s=None, acceptance=None, up_bps=0.0, down_bps=0.0, link_drops=0,
           last_report_s=None)
DOC = {"time": 1.7e9,
       "cloud": {"model": "qwen2.5-coder-1.5b", "engine": "torch", "sessions": 3, "max_sessions": 64,
                 "kv_bytes": 3 << 29, "kv_budget_bytes": 6 << 30, "steps": 1234, "step_tokens": 56789, "devices": 3},
       "devices": [device("jetson-a"), device("jetson-b", **NEW),
                   device("jetson-c", connected=False, ttft_p50_s=1.5, last_report_s=185.0, up_bps=2.5e9)]}


# -- the table (pure) -----------------------------------------------------------------------------------------------
def test_the_table_has_one_row_per_device_with_nulls_as_dashes():
    lines = top.table_lines(DOC)
    assert lines[0] == ("cloud: qwen2.5-coder-1.5b (torch)  sessions 3/64  KV 1.5 GiB / 6.0 GiB (25%)  devices 3  "
                        "steps 1234")
    assert lines[1].startswith("device  ") and "TTFT p50" in lines[1] and lines[1].endswith("report")
    a, b, c = (re.split(r"\s{2,}", x.strip()) for x in lines[2:])
    assert a == ["jetson-a", "ready", "sd 75% hat 25%", "41.3", "85 ms", "4.2 ms", "78%", "12.3M/850", "1", "MAXN",
                 "23.5 W", "orin-int4", "3 s"]
    assert b == ["jetson-b", "unknown", "–", "–", "–", "–", "–", "–/–", "0", "–", "–", "–", "–"]
    assert c[:2] == ["jetson-c", "ready (offline)"] and c[4] == "1.50 s" and c[7] == "2.5G/850" and c[-1] == "3 min"
    at = lines[1].index("state")  # a column's cells line up: a left-aligned one starts where its title does,
    assert [x[at:].split("  ")[0] for x in lines[2:]] == ["ready", "unknown", "ready (offline)"]
    end = lines[1].index("tok/s") + len("tok/s")  # a number ends where its title does
    assert [x[:end].split()[-1] for x in lines[2:]] == ["41.3", "–", "41.3"]
    assert top.table_lines({**DOC, "devices": []})[-1] == "(no device has connected)"


def test_a_narrow_terminal_drops_the_rightmost_columns():
    wide = top.table_lines(DOC)
    for width in (150, 100, 60, 30, 12, 5):
        lines = top.table_lines(DOC, width)
        assert all(len(x) <= width for x in lines), width
        titles = re.split(r"\s{2,}", lines[1].strip())
        assert titles == [t for t, _, _ in top.COLUMNS][:len(titles)] or width < len("device")  # the right ones go
        assert [x.split()[0] for x in lines[2:]] == [n[:width] for n in ("jetson-a", "jetson-b", "jetson-c")]
        assert all(w.startswith(x) for w, x in zip(wide, lines))  # the same cells, cut
    assert len(re.split(r"\s{2,}", top.table_lines(DOC, 60)[1].strip())) < len(top.COLUMNS)
    assert top.table_lines(DOC, max(len(x) for x in wide)) == wide


def test_the_cells_format_each_unit():
    assert [top.fmt_seconds(x) for x in (None, 0.0042, 0.25, 2.0)] == ["–", "4.2 ms", "250 ms", "2.00 s"]
    assert [top.fmt_rate(x) for x in (0, 999, 1500, 250e6, 3.2e9, "x")] == ["–", "999", "1.5k", "250M", "3.2G", "–"]
    assert [top.fmt_bytes(x) for x in (512, 3072, 1.5 * (1 << 30))] == ["512 B", "3.0 KiB", "1.5 GiB"]
    assert [top.fmt_age(x) for x in (None, 0.4, 125, 7200)] == ["–", "0 s", "2 min", "2.0 h"]
    assert top.fmt_protocols({"sd": 1, "hat": 3, "llm": 0}) == "hat 75% sd 25%" and top.fmt_protocols(None) == "–"
    assert top.fmt_protocols({"sd": True}) == "–"  # a malformed count is not a count


def test_a_document_of_the_wrong_shape_is_refused_by_name():
    for doc, why in ((None, "not a fleet view"), ({"devices": []}, "no `cloud` object"),
                     ({"cloud": {}, "devices": {}}, "`devices` is not a list of objects"),
                     ({"cloud": {}, "devices": [1]}, "`devices` is not a list of objects")):
        with pytest.raises(ValueError, match=why):
            top.table_lines(doc)
    with pytest.raises(ValueError, match="--url must be the dashboard's http://HOST:PORT, got 'cloud:8080'"):
        top.view_url("cloud:8080")
    assert top.view_url("http://cloud:8080/") == "http://cloud:8080/fleet.json" == top.view_url(
        "http://cloud:8080/fleet.json")


def test_the_inventory_names_the_dashboard():
    from export.deploy.fleet import Host

    assert top.inventory_url(Host("gpu", {"ansible_host": "10.0.0.1", "hatspec_dashboard_port": 8080})) == \
        "http://10.0.0.1:8080"
    assert top.inventory_url(Host("gpu", {"ansible_connection": "local", "hatspec_dashboard_port": "9"})) == \
        "http://127.0.0.1:9"
    assert top.inventory_url(Host("gpu", {"ansible_host": "fd00::1", "hatspec_dashboard_port": 80})) == \
        "http://[fd00::1]:80"
    with pytest.raises(ValueError, match="the cloud host gpu has no hatspec_dashboard_port"):
        top.inventory_url(Host("gpu", {"ansible_host": "10.0.0.1"}))


# -- the config -----------------------------------------------------------------------------------------------------
def test_a_bad_dashboard_port_is_refused_when_the_config_is_made(capsys):
    for port in (-1, 65536):
        with pytest.raises(ValueError, match=rf"dashboard_port must be a TCP port in 1..65535 \(0: off\), got {port}"):
            CloudConfig(model="m", security=PLAIN, dashboard_port=port)
    with pytest.raises(ValueError, match="dashboard_port 5555 is the port of the ZeroMQ socket"):
        CloudConfig(model="m", security=PLAIN, bind="tcp://0.0.0.0:5555", dashboard_port=5555)
    with pytest.raises(ValueError, match="dashboard_port 9100 is metrics_port too: give each its own port"):
        CloudConfig(model="m", security=PLAIN, metrics_port=9100, dashboard_port=9100)
    assert CloudConfig(model="m", security=PLAIN).dashboard_port == 0  # off by default
    from cloud_runtime.cli import main

    assert main(["serve", "--model", "m", "--plaintext", "--dashboard-port", "70000"]) == 2
    err = capsys.readouterr().err
    assert err == "hat-cloud: the command line: dashboard_port must be a TCP port in 1..65535 (0: off), got 70000\n"


# -- the HTTP endpoint ----------------------------------------------------------------------------------------------
def get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def test_the_dashboard_serves_the_page_the_view_and_404():
    calls: List[int] = []

    def view() -> dict:
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("boom")
        return DOC

    with Dashboard(view) as dash:
        host, port = dash.serve("127.0.0.1", 0)
        base = f"http://{host}:{port}"
        status, kind, page = get(base + "/")
        assert status == 200 and kind == "text/html; charset=utf-8"
        assert b"fetch(\"fleet.json\"" in page and b"<tr" not in page.split(b"<tbody")[1].split(b"</tbody>")[0]
        assert not re.search(rb"(src|href)=\"?(https?:)?//", page)  # nothing from elsewhere: works offline
        status, kind, body = get(base + "/fleet.json?t=1")
        assert (status, kind, json.loads(body)) == (200, "application/json", DOC)
        status, kind, body = get(base + "/fleet.json")  # the view failed: said, not an empty fleet
        assert status == 500 and json.loads(body) == {"error": "KeyError: 'boom'"}
        status, _, body = get(base + "/metrics")
        assert status == 404 and body == b"not found: /metrics (try / or /fleet.json)\n"
        assert top.fetch_view(base + "/fleet.json") == DOC
        with pytest.raises(top.FetchError, match=rf"^http://127.0.0.1:{port}/nope: HTTP 404 Not Found$"):
            top.fetch_view(base + "/nope")
        with pytest.raises(top.FetchError, match=r"/: not JSON: "):
            top.fetch_view(base + "/")
    with pytest.raises(top.FetchError, match=rf"^cannot reach {base}/fleet.json: Connection refused$"):
        top.fetch_view(base + "/fleet.json")  # closed with the dashboard


def test_a_dashboard_port_in_use_is_refused_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"^dashboard_port {port}: cannot listen on 127.0.0.1:{port}: Address "
                                          "already in use$"):
            Dashboard(lambda: DOC).serve("127.0.0.1", port)


def test_the_cloud_serves_its_fleet_view_and_stops_on_a_port_in_use(tiny_pair):
    from tests.conftest import serving

    port = free_port()
    with serving(tiny_pair[1], dashboard_port=port) as server:
        view = top.fetch_view(f"http://127.0.0.1:{port}/fleet.json")
        assert view["cloud"]["model"] == "tiny-target" and view["devices"] == []
        assert view["cloud"]["kv_budget_bytes"] == server.kv_bytes > 0
        with pytest.raises(OSError, match=rf"^dashboard_port {port}: cannot listen on 127.0.0.1:{port}: Address "
                                          "already in use$"):
            with serving(tiny_pair[1], dashboard_port=port) as server:
                pytest.fail(f"served on a busy port: {server.endpoint}")
    with pytest.raises(top.FetchError, match="Connection refused"):  # closed with the server
        top.fetch_view(f"http://127.0.0.1:{port}/fleet.json")


def test_hat_fleet_top_once_prints_the_table_or_one_line(capsys):
    from export.deploy.fleet import main

    with Dashboard(lambda: DOC) as dash:
        host, port = dash.serve("127.0.0.1", 0)
        assert main(["top", "--once", "--url", f"http://{host}:{port}"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == top.table_lines(DOC)
    assert main(["top", "--once", "--url", f"http://{host}:{port}"]) == 1  # closed now
    err = capsys.readouterr().err
    assert err == f"hat-fleet top: cannot reach http://{host}:{port}/fleet.json: Connection refused\n"
    assert main(["top", "--once"]) == 2
    assert "give --url http://HOST:PORT" in capsys.readouterr().err
    assert main(["top", "--once", "--url", "http://x:1", "--interval", "0"]) == 2
    assert capsys.readouterr().err == "hat-fleet top: --interval must be > 0 s, got 0.0\n"


def test_hat_fleet_top_finds_the_dashboard_in_the_inventory(tmp_path, capsys):
    yaml = pytest.importorskip("yaml")
    from export.deploy.fleet import main

    cloud = {"ansible_connection": "local", "hatspec_model": "qwen"}
    inv = {"all": {"vars": {"hatspec_plaintext": True}, "children": {
        "cloud": {"hosts": {"gpu-box": cloud}},
        "edge": {"hosts": {"orin-1": {"hatspec_server": "tcp://127.0.0.1:5555", "hatspec_model": "smollm2-135m"}}}}}}
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inv))
    assert main(["top", "--once", str(path)]) == 2
    assert "the cloud host gpu-box has no hatspec_dashboard_port" in capsys.readouterr().err
    with Dashboard(lambda: DOC) as dash:
        cloud["hatspec_dashboard_port"] = dash.serve("127.0.0.1", 0)[1]
        path.write_text(yaml.safe_dump(inv))
        assert main(["top", "--once", str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == top.table_lines(DOC)


# -- a real fleet: the page in Chromium, the terminal view under tmux -------------------------------------------------
@contextlib.contextmanager
def reporting_fleet(target, names=("jetson-a", "jetson-b", "jetson-c")) -> Iterator[str]:
    """A tiny cloud serving its dashboard, and devices that said Hello and sent Reports (the first with an agent's
    stats, one with a session open, the last only Hello); yields the dashboard's URL."""
    from edge_runtime.client import CloudClient
    from edge_runtime.config import LinkConfig
    from hat_split.wire import messages as P
    from tests.conftest import serving

    port = free_port()
    with serving(target, dashboard_port=port) as server, contextlib.ExitStack() as stack:
        for i, name in enumerate(names):
            client = stack.enter_context(CloudClient(LinkConfig(server.endpoint, security=PLAIN),
                                                     P.Hello(name, "tiny", 512, "tiny-vocab")))
            if i == len(names) - 1:
                continue  # connected, never reported
            stats = P.DeviceStats(state="ready", bundle="tiny-fp32", model="tiny", requests=4,
                                  protocols={"sd": 3, "hat": 1}, tokens_per_s=35.5, ttft_p50_s=0.09, tbt_p50_s=0.021,
                                  acceptance=0.81, link_drops=2, watts=7.5) if i == 0 else None
            client.request(P.Report(P.DeviceState(2e7, 4e6, 0.004, "MAXN" if i == 0 else "15W", "agx-orin-64gb"),
                                    stats))
            if i == 1:
                client.request(P.OpenSession(1, "sd", np.arange(1, 7, dtype=np.int32)))
        yield f"http://127.0.0.1:{port}"


def chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium on `args` with a fresh profile (two runs never share one)."""
    with tempfile.TemporaryDirectory(prefix="hatspec-chromium-") as profile:
        return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                               f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args],
                              capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/bootstrap.sh installs it as root)")
def test_the_page_shows_one_row_per_device_in_chromium(tiny_pair, tmp_path):
    names = ("jetson-a", "jetson-b", "jetson-c")
    with reporting_fleet(tiny_pair[1], names) as url:
        dom = chromium("--dump-dom", url + "/")
        shot = tmp_path / "dashboard.png"
        chromium(f"--screenshot={shot}", "--window-size=1400,500", url + "/")
    assert dom.returncode == 0, dom.stderr[-2000:]
    rows = dict(re.findall(r'<tr data-device="([^"]+)"[^>]*>(.*?)</tr>', dom.stdout))
    assert sorted(rows) == list(names), dom.stdout[-3000:]
    cells = {n: re.findall(r"<td[^>]*>(.*?)</td>", r) for n, r in rows.items()}
    assert cells["jetson-a"][:4] == ["jetson-a", "ready", "sd 75% hat 25%", "35.5"]
    assert cells["jetson-a"][9:12] == ["MAXN", "7.5 W", "tiny-fp32"] and cells["jetson-a"][7] == "20.0M/4.0M"
    assert cells["jetson-b"][1:3] == ["unknown", "–"] and cells["jetson-b"][9] == "15W"
    assert cells["jetson-c"][1] == "unknown" and cells["jetson-c"][-1] == "–"  # never reported
    assert re.search(r'<div id="cloud">cloud: tiny-target \(torch\)  sessions 1/64  KV [^<]+  devices 3', dom.stdout)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def tmux(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TMUX, "-L", f"hatspec-test-{os.getpid()}", *args], capture_output=True, text=True,
                          env=UTF8, timeout=30)


def wait_for(pred, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    return pred()


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed")
def test_hat_fleet_top_under_tmux(tiny_pair):
    fleet = shutil.which("hat-fleet")
    cmd = [fleet] if fleet else [sys.executable, "-c", "import sys; from export.deploy.fleet import main; "
                                                       "sys.exit(main())"]
    names = ("jetson-a", "jetson-b", "jetson-c")
    with refusing_port() as port:
        _top_under_tmux(cmd, names, f"http://127.0.0.1:{port}", tiny_pair)


def _top_under_tmux(cmd, names, dead, tiny_pair):
    try:
        with reporting_fleet(tiny_pair[1], names) as url:
            for session, where in (("live", url), ("dead", dead)):
                argv = " ".join([*cmd, "top", "--url", where, "--interval", "0.5"])
                assert tmux("new-session", "-d", "-s", session, "-x", "160", "-y", "30", f"exec {argv}").returncode == 0

            def screen(session: str) -> str:
                return tmux("capture-pane", "-p", "-t", session).stdout

            shown = wait_for(lambda: all(n in screen("live") for n in names) and screen("live"))
            assert shown, screen("live")
            lines = shown.splitlines()
            for name in names:
                assert [x.split()[0] for x in lines if name in x] == [name], shown
            assert any(x.startswith("cloud: tiny-target (torch)") for x in lines)
            assert re.search(r"updated \d\d:\d\d:\d\d", shown)
            error = wait_for(lambda: "cannot reach" in screen("dead") and screen("dead"))
            assert f"cannot reach {dead}/fleet.json: Connection refused  (retrying every 0.5 s)" in error, error
            for session in ("live", "dead"):
                tmux("send-keys", "-t", session, "q")
                assert wait_for(lambda: tmux("has-session", "-t", session).returncode != 0, 10), session
    finally:
        tmux("kill-server")


def _real_fleet_screenshot(out: Path) -> None:
    """docs/dashboard.png from a real local fleet on this machine: Qwen2.5-Coder-1.5B served by a cloud, three agents
    with the 0.5B as their draft that each answered OpenAI requests over different protocols and reported; every
    figure measured (no power monitor here: no watts)."""
    import threading

    from edge_runtime.api.agent import Agent, AgentConfig
    from edge_runtime.config import EdgeConfig, EngineConfig, LinkConfig
    from hat_split.models.lm import CausalLM
    from hat_split.models.loading import load_model, vocab_fingerprint
    from tests.conftest import serving

    target, draft = load_model("qwen2.5-coder-1.5b"), load_model("qwen2.5-coder-0.5b")
    port = free_port()
    with serving(CausalLM(target.model), vocab=vocab_fingerprint(target.tokenizer), dashboard_port=port,
                 name="qwen2.5-coder-1.5b") as server:
        agents = []
        for name, protocols in (("cpu-agent-1", ("sd", "sd", "llm")), ("cpu-agent-2", ("cuhlm", "sd")),
                                ("cpu-agent-3", ("hlm", "uhlm"))):
            link = LinkConfig(server.endpoint, security=LinkSecurity.plaintext(), device_id=name)
            agent = Agent(AgentConfig(EdgeConfig(model="qwen2.5-coder-0.5b", link=link,
                                                 engine=EngineConfig(threads=1)),
                                      port=0, report_interval_s=600.0), loaded=draft)
            threading.Thread(target=agent.serve_forever, daemon=True).start()
            agents.append((agent, protocols))
        prompts = iter(["def fibonacci(n):", "The three laws of thermodynamics say that", "class LRUCache:",
                        "A short poem about the sea:\n", "# parse an ISO date in Python\n", "Dear team, about the"
                        " outage last night,", "SELECT name FROM users WHERE"])
        for agent, protocols in agents:
            for protocol in protocols:
                body = {"model": "m", "prompt": next(prompts), "max_tokens": 24, "temperature": 0,
                        "hatspec": {"protocol": protocol}}
                req = urllib.request.Request(agent.address + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
                urllib.request.urlopen(req, timeout=300).read()
            agent.report()
        print(chromium(f"--screenshot={out}", "--window-size=1400,400",
                       f"http://127.0.0.1:{port}/").stderr[-500:])
        for agent, _ in agents:
            agent.stop()


if __name__ == "__main__":  # docs/dashboard.png
    assert CHROMIUM, "chromium is not installed"
    _real_fleet_screenshot(ROOT / "docs" / "dashboard.png")
    print(ROOT / "docs" / "dashboard.png", (ROOT / "docs" / "dashboard.png").stat().st_size)
