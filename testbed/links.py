"""Named link profiles for the link emulator (testbed/link_emulator.py).

Terms, used the same way in the emulator and docs/LINKS.md:
- up / uplink: device -> cloud; down / downlink: cloud -> device.
- rate: bytes per second a direction can serialize onto the link (bytes, not bits). ``None`` or ``inf`` = unlimited.
- delay: one-way propagation delay in seconds, added after serialization.
- jitter: half-width of a uniform distribution added to each chunk's delay, so a chunk's delay is
  uniform in [delay - jitter, delay + jitter]. Delivery stays in order (TCP does not reorder), so a chunk
  never arrives before the one sent ahead of it.
- loss: probability that one TCP segment is lost; TCP retransmits it, so a loss shows as a delay
  (testbed/link_emulator.py), never as missing bytes.

Two ways to impose a profile: the user-space relay (testbed/link_emulator.py: rate, delay, jitter, loss,
cuts; no root) and, as root, a network namespace whose veth link the kernel shapes with tc tbf
(testbed/netns_link.py: the rate in the kernel, with real TCP congestion control) with the relay in front
for delay, loss and cuts (this kernel has no
netem).

Sources of the figures are in the comment beside each profile. "MB" is 10**6 bytes throughout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MBYTE = 1e6          # bytes
MBIT = 1e6 / 8       # bytes per Mbit
KBIT = 1e3 / 8       # bytes per kbit


@dataclass(frozen=True)
class LinkProfile:
    name: str
    up_rate_bps: float | None = None    # bytes/s device -> cloud; None or inf = unlimited (a plain loopback)
    down_rate_bps: float | None = None  # bytes/s cloud -> device; None or inf = unlimited
    delay_s: float = 0.0                # s, one-way propagation delay, same both directions; 0 = loopback
    jitter_s: float = 0.0               # s, half-width of uniform jitter on the delay; 0 = a fixed delay
    description: str = ""               # one line for `hat-link --list`
    loss: float = 0.0                   # probability a TCP segment is lost (and retransmitted)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"link profile name must be a non-empty string, got {self.name!r}")
        for attr in ("up_rate_bps", "down_rate_bps"):
            rate = getattr(self, attr)
            if rate is not None and not (rate > 0):  # also rejects NaN
                raise ValueError(f"link profile {self.name!r}: {attr} must be > 0 bytes/s or None "
                                 f"(unlimited), got {rate!r}")
        if not (0.0 <= self.delay_s < math.inf):
            raise ValueError(f"link profile {self.name!r}: delay_s must be a finite one-way delay >= 0 s, "
                             f"got {self.delay_s!r}")
        if not (0.0 <= self.loss < 1.0):
            raise ValueError(f"link profile {self.name!r}: loss must be a probability in [0, 1), got {self.loss!r}")
        if not (0.0 <= self.jitter_s <= self.delay_s):
            raise ValueError(f"link profile {self.name!r}: jitter_s must be in [0, delay_s={self.delay_s}] "
                             f"(uniform half-width; the delay never goes negative), got {self.jitter_s!r}")

    def rate(self, direction: str) -> float:
        """Bytes/s for "up" or "down"; math.inf when unlimited."""
        if direction not in ("up", "down"):
            raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
        rate = self.up_rate_bps if direction == "up" else self.down_rate_bps
        return math.inf if rate is None else float(rate)


_PROFILES = [
    LinkProfile("loopback", None, None, 0.0, 0.0, "no shaping: the relay only forwards"),
    # HAT (Xie et al.) §4.1: devices on WiFi at 2 m, 8 m and 14 m from the routers; iperf3 measured 5-10 MB/s up and
    # 10-15 MB/s down across all of them. The paper gives no per-distance figure: near / mid / far taking the top,
    # middle and bottom of that range is our assumption. Delays are our picks (the paper gives none): a few ms
    # one way, growing with MAC retries at range.
    LinkProfile("wifi-near", 10 * MBYTE, 15 * MBYTE, 0.002, 0.0005, "WiFi at 2 m (HAT §4.1 range, top)"),
    LinkProfile("wifi-mid", 7.5 * MBYTE, 12.5 * MBYTE, 0.003, 0.001, "WiFi at 8 m (HAT §4.1 range, middle)"),
    LinkProfile("wifi-far", 5 * MBYTE, 10 * MBYTE, 0.004, 0.0015, "WiFi at 14 m (HAT §4.1 range, bottom)"),
    # Typical figures for a loaded LTE cell, not from a paper.
    LinkProfile("lte", 5 * MBIT, 20 * MBIT, 0.025, 0.005, "LTE, typical 5/20 Mbit/s, 25 ms (not from a paper)"),
    # QS-SD (Zhang et al.) Fig. 4(a): low-rate regime of 350 kbit/s on average, "typical of NB-IoT and satellite".
    # Downlink set equal to the uplink, and the 100 ms one-way delay, are our picks (real NB-IoT latency is often
    # longer, up to seconds).
    # 1 % segment loss is our pick for a cell-edge narrowband link.
    LinkProfile("nb-iot", 350 * KBIT, 350 * KBIT, 0.100, 0.020,
                "NB-IoT-like 350 kbit/s (QS-SD low regime), 100 ms, 1 % loss", loss=0.01),
    # Typical geostationary figures, not from a paper: ~250-300 ms one way, asymmetric consumer rates.
    # 0.5 % segment loss is our pick (rain fade and congestion on consumer GEO links).
    LinkProfile("satellite", 2 * MBIT, 10 * MBIT, 0.300, 0.010,
                "GEO satellite, typical 2/10 Mbit/s, 300 ms, 0.5 % loss", loss=0.005),
]
LINK_PROFILES: dict[str, LinkProfile] = {p.name: p for p in _PROFILES}


def get_link_profile(name: str | LinkProfile) -> LinkProfile:
    """The profile called ``name`` (a LinkProfile is returned as is); ValueError listing the known names."""
    if isinstance(name, LinkProfile):
        return name
    try:
        return LINK_PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown link profile {name!r}; known: {', '.join(LINK_PROFILES)}") from None
