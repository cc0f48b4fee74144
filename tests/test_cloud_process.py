"""`cloud_runtime.process.CloudProcess`: the cloud server that demos, benchmarks and tests start as a process of
their own ends with them, however they end."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # ended, not reaped (no init to reap it here)
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_cloud_server_ends_when_the_process_that_started_it_is_killed(tmp_path, sig):
    """A benchmark stopped by a signal runs none of its `with` exits (SIGTERM's default action, and SIGKILL, end
    Python at once), yet its cloud server must not outlive it holding cores and a port: the server is told to end
    when its parent does."""
    model_dir = tiny_model_dir(tmp_path / "tiny")
    script = ("import time\n"
              "from cloud_runtime.process import CloudProcess\n"
              f"with CloudProcess({str(model_dir)!r}, extra_args=['--dtype', 'float32'], threads=1) as cloud:\n"
              "    print(cloud.proc.pid, flush=True)\n"
              "    time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    server = None
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"the parent ended before its cloud was ready (exit {parent.poll()})"
        server = int(line)
        assert not _gone(server)
        parent.send_signal(sig)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _gone(server) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(server), f"the cloud server {server} outlived its parent ({sig.name})"
    finally:
        parent.kill()
        parent.wait()
        if server is not None and not _gone(server):  # the failure above: leave no server behind all the same
            psutil.Process(server).kill()


def test_a_stop_asked_before_serving_begins_is_kept(tiny_pair):
    """SIGTERM can reach `hat-cloud serve` between its ready line and its serving loop (a launcher that kills it as
    soon as it is ready): the stop is kept, and serving returns at once instead of running on."""
    import threading

    from cloud_runtime.config import CloudConfig
    from cloud_runtime.server import CloudServer
    from hat_split.net.security import LinkSecurity

    cfg = CloudConfig(model="tiny", bind="tcp://127.0.0.1:0", poll_ms=20, max_context=1024,
                      security=LinkSecurity.plaintext())
    with CloudServer(cfg, tiny_pair[1], "tiny-target", "tiny-vocab") as server:
        server.stop()
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "serve_forever ran on after stop()"
