"""The benchmarks' rig (profiles.bench.rig): a real cloud process, a link emulator and CurveZMQ keys on
loopback with a tiny random model; every process, port and file it started is gone after the `with`, also when the
body raises."""
from __future__ import annotations

import os
import socket
import time

import pytest

from edge_runtime.config import EdgeConfig
from hat_split.math.sampling import SamplingParams
from profiles.bench.fuzz import tiny_target
from profiles.bench import rig


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("rig") / "tiny")
    tiny_target(path, seed=3)
    return path


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _assert_gone(bed: rig.Rig, ports, threads) -> None:
    assert bed.cloud.proc.poll() is not None, "the cloud process outlived the rig"
    assert not [p for p in ports if _listening(p)], "a port is still listening"
    assert not [t for t in threads if t.is_alive()], "a link emulator's thread is still running"
    assert not os.path.exists(bed.dir), "the run's directory (keys, log) is still there"


def test_devices_generate_through_the_link_and_everything_is_gone_after(tiny_dir):
    with rig.Rig(tiny_dir, cloud_args=["--dtype", "float32"], threads=1, link="loopback", devices=["dev-a"],
                 secure=True, status_interval_s=0.2) as bed:
        assert bed.cloud.proc.poll() is None and bed.endpoint == bed.link.address
        security = bed.security("dev-a")
        assert security.curve and os.path.exists(security.secret_key)
        with pytest.raises(KeyError, match="dev-b"):
            bed.security("dev-b")
        rt = bed.runtime(EdgeConfig(model=tiny_dir, link=bed.link_config("dev-a")))
        assert rt.config.link.server == bed.endpoint and rt.config.link.security == security
        result = rt.generate([5, 6, 7, 8], "sd", SamplingParams(0.0), 6, seed=0)
        assert result.n == 6 and bed.link.stats()["up"]["bytes"] > 0
        # a second rig reaching the same cloud, as a device process of a fleet holds: its own link and device
        with rig.Rig(upstream=bed.upstream, keys=bed.keys) as remote:
            assert remote.cloud is None and remote.endpoint == bed.cloud.endpoint
            own = remote.add_link("wifi-near", control=True)
            remote_rt = remote.runtime(EdgeConfig(model=tiny_dir, link=remote.link_config("dev-a", own.address)),
                                       loaded=rt.engine.loaded)
            assert remote_rt.generate([5, 6, 7, 8], "sd", SamplingParams(0.0), 6, seed=0).tokens == result.tokens
        assert not _listening(own.port) and not _listening(own.control_address[1]) and bed.cloud.proc.poll() is None
        deadline = time.monotonic() + 10.0  # the cloud sweeps (and rewrites its status) once a second
        while not os.path.exists(bed.status_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.exists(bed.status_path)
        ports, threads = [bed.cloud.port, bed.link.port], [bed.link._thread]
    _assert_gone(bed, ports, threads)


def test_everything_is_gone_when_the_body_raises(tiny_dir):
    with pytest.raises(RuntimeError, match="the body failed"):
        with rig.Rig(tiny_dir, cloud_args=["--dtype", "float32"], threads=1, link="wifi-far") as bed:
            extra = bed.add_link("lte")
            ports, threads = [bed.cloud.port, bed.link.port, extra.port], [bed.link._thread, extra._thread]
            assert all(_listening(p) for p in ports)
            raise RuntimeError("the body failed")
    _assert_gone(bed, ports, threads)


def test_a_cloud_that_cannot_start_leaves_nothing_behind(tmp_path):
    bed = rig.Rig(str(tmp_path / "no-such-model"), link="loopback", ready_timeout_s=120)
    with pytest.raises(RuntimeError, match="did not become ready"):
        bed.__enter__()
    assert bed.link is None and not os.path.exists(bed.dir)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="model of a cloud to start, or the upstream"):
        rig.Rig()
    with pytest.raises(ValueError, match="model of a cloud to start, or the upstream"):
        rig.Rig("m", upstream=("127.0.0.1", 1))
    with pytest.raises(ValueError, match="named devices"):
        rig.Rig("m", secure=True)
    with pytest.raises(RuntimeError, match="not running"):
        rig.Rig("m").add_link("loopback")
