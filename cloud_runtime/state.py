"""What the cloud serves now, in one owner, plain Python (no torch): `CloudTables` holds the open sessions
(cloud_runtime.sessions.SessionTable), the devices that said Hello (cloud_runtime.devices.DeviceRegistry: peers,
users, devices) and the server's counters (`ServerStats`). The request handlers (cloud_runtime.handlers), admission
(cloud_runtime.quotas.Admission), the server's loop (cloud_runtime.server) and what operators read (its report,
cloud_runtime.metrics, cloud_runtime.fleet) reach them through `CloudServer.tables`; sessions change only through
the session table's methods, devices only through the registry's.

(Not the wire's `CloudState`, which is the load a device is told: hat_split.wire.messages.CloudState.)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict

from cloud_runtime.devices import DeviceRegistry
from cloud_runtime.sessions import SessionTable

log = logging.getLogger("hatspec.cloud")


@dataclass
class ServerStats:
    requests: int = 0
    errors: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    sessions_opened: int = 0
    sessions_expired: int = 0
    errors_by_code: Dict[str, int] = field(default_factory=dict)
    busy_s: float = 0.0  # loop time spent handling messages and computing steps (waiting on the socket excluded)
    heap_trims: int = 0  # times the C heap's free pages went back to the system (hat_split.heap)
    heap_trim_s: float = 0.0  # seconds those took, on the serving loop


@dataclass
class CloudTables:
    """The sessions, the devices and the counters of one cloud."""

    sessions: SessionTable  # (identity, session id) → TargetSession or MiddleSession, caches in sessions.work
    registry: DeviceRegistry  # identity → last message, allow-list name, HAT §3.2 state
    stats: ServerStats = field(default_factory=ServerStats)

    def expire(self, now: float, limit: float) -> None:
        """Free sessions silent for `limit` seconds since their last reply (never one the cloud still owes an answer:
        under load a request can wait longer than the timeout), and forget peers silent as long with no session
        left."""
        for key in self.sessions.idle(now, limit):
            log.info("session %s of %r idle for over %.0f s: freed", key[1], key[0], limit)
            self.sessions.free(key)
            self.stats.sessions_expired += 1
        for peer in self.registry.silent(now, limit):
            if not self.sessions.of_peer(peer):
                self.registry.forget(peer)
