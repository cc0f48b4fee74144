"""The devices the cloud knows, plain Python (no torch): who said Hello, who they are, and what they report.

`DeviceRegistry` owns three tables keyed by the connection's identity (the ROUTER's): `peers` (the monotonic time of
its last message, for devices that said Hello: any other request needs one), `users` (the allow-list name it
authenticated with over CurveZMQ, cloud_runtime.zap) and `devices` (its HAT §3.2 state: device id, model, profile,
power mode, the rates and times it measured, and an agent's latest stats for the fleet view, cloud_runtime.fleet).
It answers Hello (the vocabularies must match) and Report, and names the device quotas count (`device_of`).
A peer silent for the session timeout with no session left is forgotten (cloud_runtime.state.CloudTables.expire).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Dict, List

import msgspec

from cloud_runtime.config import CloudConfig
from cloud_runtime.work import ModelFacts
from hat_split.protocols import NAMES as PROTOCOL_NAMES, of_family
from hat_split.wire import messages as P

log = logging.getLogger("hatspec.cloud")

SERVED = of_family("token") + of_family("split")  # the protocols a Welcome offers (split ones may still be refused)
SOFTWARE = "hatspec-cloud/0.1"
MEASURED = ("draft_s", "up_bps", "down_bps", "input_s", "adapter_s")  # a DeviceState's numbers
STATS_FIGURES = ("tokens_per_s", "ttft_p50_s", "tbt_p50_s", "acceptance", "watts")  # a DeviceStats' floats


class DeviceRegistry:
    """The handshake and every device's latest state, by connection identity."""

    def __init__(self, config: CloudConfig, model: ModelFacts):
        self.config = config  # what a Welcome states: session timeout, draft and context limits
        self.model = model
        self.peers: Dict[bytes, float] = {}  # identity → monotonic time of its last message (it said Hello)
        self.users: Dict[bytes, str] = {}  # identity → the allow-list name it authenticated with (CurveZMQ)
        self.devices: Dict[bytes, dict] = {}  # identity → HAT §3.2 state: device id, profile, power mode, γ, β

    # -- connections ----------------------------------------------------------------------------------------------
    def knows(self, identity: bytes) -> bool:
        """Whether the connection said Hello (and has not been forgotten since)."""
        return identity in self.peers

    def authenticated(self, identity: bytes, user: str) -> None:
        """The allow-list name a connection authenticated with (CurveZMQ)."""
        self.users[identity] = user

    def heard(self, identity: bytes) -> None:
        """A request of the connection was handled (a refused Hello is no handshake: not called for it)."""
        self.peers[identity] = time.monotonic()

    def silent(self, now: float, limit: float) -> List[bytes]:
        """Connections whose last message is over `limit` seconds before monotonic time `now`."""
        return [p for p, t in self.peers.items() if now - t > limit]

    def forget(self, identity: bytes) -> None:
        """Drop a connection and what it told: its next request needs a new Hello."""
        del self.peers[identity]
        self.devices.pop(identity, None)
        self.users.pop(identity, None)

    def device_of(self, identity: bytes) -> Any:
        """Who quotas and fair shares count: the allow-list name the connection authenticated with, else (a plaintext
        link) the device id its Hello declared, else the connection."""
        return self.users.get(identity) or self.devices.get(identity, {}).get("device_id") or identity

    # -- requests -------------------------------------------------------------------------------------------------
    def hello(self, identity: bytes, msg: P.Hello) -> P.Welcome:
        if msg.vocab_fingerprint and msg.vocab_fingerprint != self.model.vocab_fingerprint:
            raise P.ProtocolError(
                "vocab_mismatch",
                f"device model {msg.model!r} has vocabulary {msg.vocab_fingerprint[:12]}, cloud model "
                f"{self.model.name!r} has {self.model.vocab_fingerprint[:12]}: they cannot generate together",
            )
        self.devices.setdefault(identity, {"device_id": msg.device_id, "model": msg.model})
        nodes = self.model.tree_nodes(self.config.tree_nodes)
        return P.Welcome(
            protocol_version=P.PROTOCOL_VERSION,
            model=self.model.name,
            vocab_size=self.model.vocab_size,
            vocab_fingerprint=self.model.vocab_fingerprint,
            session_timeout_s=self.config.session_timeout_s,
            max_draft_len=self.config.max_draft_len,
            max_context=self.config.max_context,
            protocols=list(SERVED),
            software=SOFTWARE,
            max_tree_nodes=nodes,
            max_tree_depth=self.config.max_tree_depth if nodes else 0,
        )

    def report(self, identity: bytes, msg: P.Report) -> None:
        """A device's state (`observe`) and, from an agent, what it served lately: kept as its latest `stats` (the
        fleet view, cloud_runtime.fleet), replacing the previous ones (a report without stats keeps those), with
        the time of the report (`report_at`, Unix time)."""
        if msg.stats is not None:
            check_stats(msg.stats)
        self.observe(identity, msg.device)
        entry = self.devices[identity]
        entry["report_at"] = time.time()
        if msg.stats is not None:
            entry["stats"] = msgspec.structs.asdict(msg.stats)  # plain values: the status file is JSON

    def observe(self, identity: bytes, state: P.DeviceState) -> None:
        """Keep a device's latest self-report (HAT §3.2); a changed power mode is logged. Refuses (before anything
        changes) rates and times that are negative or not finite."""
        bad = [k for k in MEASURED if not (math.isfinite(getattr(state, k)) and getattr(state, k) >= 0)]
        if bad:
            raise P.ProtocolError("invalid", f"the device's {', '.join(bad)} must be finite and >= 0")
        entry = self.devices.setdefault(identity, {"device_id": identity.decode(errors="replace")})
        if state.power_mode and entry.get("power_mode") not in (None, state.power_mode):
            log.info("device %s: power mode %s -> %s", entry["device_id"], entry["power_mode"], state.power_mode)
        for key in ("power_mode", "profile"):
            if getattr(state, key):
                entry[key] = getattr(state, key)
        for key in MEASURED:
            if getattr(state, key) > 0:
                entry[key] = getattr(state, key)
        entry["reported_at"] = time.time()


def check_stats(stats: P.DeviceStats) -> None:
    """Refuse (ProtocolError "invalid") a device's stats whose figures are not finite, whose protocols are not known
    ones ("unknown": a name the agent did not know) or do not add up to its requests."""
    bad = [k for k in STATS_FIGURES if getattr(stats, k) is not None and not math.isfinite(getattr(stats, k))]
    if bad:
        raise P.ProtocolError("invalid", f"the device's stats {', '.join(bad)} must be finite")
    unknown = sorted(set(stats.protocols) - set(PROTOCOL_NAMES) - {"unknown"})
    if unknown:
        raise P.ProtocolError("invalid", f"the device's stats count unknown protocols {unknown}")
    if sum(stats.protocols.values()) != stats.requests:
        raise P.ProtocolError("invalid", f"the device's stats count {stats.requests} requests but "
                              f"{sum(stats.protocols.values())} by protocol")
