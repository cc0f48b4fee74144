"""`hat-bench auto`'s cloud load (profiles.bench.load): other devices decoding on a real cloud from a process of
their own, on the cores asked for, and a load that cannot reach the cloud refused with what failed."""
from __future__ import annotations

import os
import time

import pytest

from tests.conftest import refusing_port


def _link(endpoint: str):
    from edge_runtime.config import LinkConfig
    from hat_split.net.security import LinkSecurity

    return LinkConfig(endpoint, security=LinkSecurity.plaintext(), request_timeout_s=5.0, connect_timeout_s=1.0,
                      connect_retries=1)


def test_the_load_decodes_on_the_cloud_from_a_process_on_the_cores_asked_for(tiny_server):
    """Two load devices in a process of their own, pinned to one core: warm (LOAD_WARM requests each) before entering
    returns (the cloud answered each of them), they go on while the phase runs, and leaving stops the process."""
    from profiles.bench.load import Load

    core = sorted(os.sched_getaffinity(0))[:1]
    with Load(_link(tiny_server.endpoint), 2, [5, 17, 99, 3], core, timeout_s=120.0) as load:
        assert load.process.is_alive() and load.process.pid != os.getpid()
        assert sorted(os.sched_getaffinity(load.process.pid)) == core
        time.sleep(0.5)
        assert load.process.is_alive()
    assert not load.process.is_alive() and load.process.exitcode == 0


def test_a_load_that_cannot_reach_the_cloud_is_refused_naming_what_failed():
    from profiles.bench.load import Load

    with refusing_port() as port:
        with pytest.raises(RuntimeError, match="did not all start decoding: load-0: "):
            with Load(_link(f"tcp://127.0.0.1:{port}"), 1, [5, 17], timeout_s=120.0):
                pytest.fail("a load that reached no cloud was entered")
    with pytest.raises(ValueError, match="at least one device"):
        Load(_link("tcp://127.0.0.1:1"), 0, [5])
