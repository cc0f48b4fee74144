"""A link profile imposed by the kernel: the device in its own network namespace behind a veth link shaped with tc tbf.

The rate of each direction is a token-bucket filter on the sending side of the veth pair (up: the namespace's eth0,
down: the host side), so the device's TCP meets a real bottleneck queue and its congestion control reacts as on a
real link. This kernel has no netem, so delay, jitter, loss and cuts come from the user-space relay
(testbed/link_emulator.py) in front of the server, run with the profile's rates removed.

    with NetnsLink("lte", upstream=("127.0.0.1", 5555)) as link:
        subprocess.run(link.exec(["hat-edge", "generate", "--server", link.address, ...]))

Needs root, `ip` and `tc` (sch_tbf). `hat-link --netns NAME --profile P --upstream HOST:PORT` runs one from the shell.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import subprocess
from typing import List, Optional, Sequence, Tuple

from testbed.link_emulator import LinkEmulator
from testbed.links import LinkProfile, get_link_profile

ETH_FRAME_BYTES = 1514
KERNEL_HZ = 250  # timer ticks per second the burst must cover at high rates (CONFIG_HZ on common kernels)
QUEUE_LATENCY_MS = 50  # how long a packet may wait in the bucket's queue before tbf drops it (a router's buffer)


def unavailable() -> Optional[str]:
    """Why a shaped namespace link cannot start here, or None."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2)"
    return None


def tbf_args(rate_bytes_s: float) -> List[str]:
    """`tc qdisc ... tbf` arguments for a rate in bytes/s: the burst covers two frames and one timer tick."""
    if not rate_bytes_s > 0 or math.isinf(rate_bytes_s):
        raise ValueError(f"tbf needs a finite positive rate, got {rate_bytes_s}")
    burst = max(2 * ETH_FRAME_BYTES, int(rate_bytes_s / KERNEL_HZ))
    return ["rate", f"{int(rate_bytes_s * 8)}bit", "burst", str(burst), "latency", f"{QUEUE_LATENCY_MS}ms"]


def _run(cmd: Sequence[str]) -> None:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


class NetnsLink:
    """One device namespace `name` at 10.<net>.1.2 behind a tbf-shaped veth; the relay listens at 10.<net>.1.1."""

    def __init__(self, profile: LinkProfile | str, upstream: Tuple[str, int], name: str = "hs-link", net: int = 78):
        reason = unavailable()
        if reason:
            raise RuntimeError(f"cannot shape a namespace link: {reason}")
        self.profile = get_link_profile(profile)
        self.name, self.upstream = name, upstream
        self.host_side, self.host_ip, self.device_ip = f"{name}-h"[:15], f"10.{net}.1.1", f"10.{net}.1.2"
        self.relay: Optional[LinkEmulator] = None
        self._made = False
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        _run(["ip", "netns", "add", self.name])
        self._made = True
        _run(["ip", "link", "add", self.host_side, "type", "veth", "peer", "name", "eth0", "netns", self.name])
        _run(["ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_side])
        _run(["ip", "link", "set", self.host_side, "up"])
        for cmd in (["ip", "addr", "add", f"{self.device_ip}/24", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"],
                    ["ip", "link", "set", "lo", "up"]):
            _run(self.exec(cmd))
        self.shape(self.profile)
        relay_profile = dataclasses.replace(self.profile, up_rate_bps=None, down_rate_bps=None)
        self.relay = LinkEmulator(relay_profile, self.upstream, (self.host_ip, 0))

    def shape(self, profile: LinkProfile | str) -> None:
        """(Re)apply a profile: tbf rates on both ends now, delay / jitter / loss on the relay."""
        profile = get_link_profile(profile)
        for prefix, device, rate in ((["ip", "netns", "exec", self.name], "eth0", profile.rate("up")),
                                     ([], self.host_side, profile.rate("down"))):
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True)
            if not math.isinf(rate):
                _run([*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", *tbf_args(rate)])
        self.profile = profile
        if self.relay is not None:
            self.relay.set_profile(dataclasses.replace(profile, up_rate_bps=None, down_rate_bps=None))

    def qdiscs(self) -> str:
        """`tc qdisc show` of both ends (what the kernel enforces)."""
        inside = subprocess.run(self.exec(["tc", "qdisc", "show", "dev", "eth0"]), capture_output=True, text=True)
        outside = subprocess.run(["tc", "qdisc", "show", "dev", self.host_side], capture_output=True, text=True)
        return f"up (eth0 in {self.name}): {inside.stdout.strip()}\ndown ({self.host_side}): {outside.stdout.strip()}"

    @property
    def address(self) -> str:
        """The endpoint a device inside the namespace connects to."""
        return self.relay.address

    def exec(self, cmd: Sequence[str]) -> List[str]:
        """`cmd` run inside the device's namespace."""
        return ["ip", "netns", "exec", self.name, *cmd]

    def __enter__(self) -> "NetnsLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.relay is not None:
            self.relay.close()
            self.relay = None
        if self._made:
            pids = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True).stdout
            for pid in pids.split():
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "link", "del", self.host_side], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
            self._made = False
