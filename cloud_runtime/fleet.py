"""The fleet view: one JSON document of the cloud and every device it knows, one row per device (`hat-fleet top` and
the cloud's dashboard read it).

`read(server)` copies what it needs from a CloudServer into plain values (cloud_runtime.metrics.snapshot: safe
beside the serving loop) and `render(snapshot, now)` (pure) builds the document:

    {"time": unix seconds,
     "cloud": {"model", "engine", "sessions", "max_sessions", "kv_bytes", "kv_budget_bytes", "steps", "step_tokens",
               "devices"},
     "devices": [{"device", "connected", "state", "model", "bundle", "profile", "power_mode", "watts", "requests",
                  "protocols", "tokens_per_s", "ttft_p50_s", "tbt_p50_s", "acceptance", "up_bps", "down_bps",
                  "link_drops", "sessions", "kv_bytes", "usage", "last_report_s"}, ...]}

A device is named as quotas count it (its allow-list name over CurveZMQ, else its Hello's device id); the rows are
every device that said Hello (and is not forgotten yet) or holds sessions, sorted by name. Its state, bundle, watts,
requests, protocols, rates and times are what its agent last reported (hat_split.wire.messages.DeviceStats: its
recent window of requests); before a first report its state is "unknown" and what only a report says is null (a
count, 0). up_bps / down_bps are the link rates it measured (its DeviceState; 0 before it measured any); sessions,
kv_bytes and usage (positions planned for it lately, decaying) are the cloud's own accounting; last_report_s is the
time since its last Report message (null: none yet).
"""
from __future__ import annotations

import time
from typing import Any, Dict

from cloud_runtime.metrics import snapshot


def read(server: Any) -> Dict[str, Any]:
    """The server's state now, as plain values."""
    return snapshot(server, server.metrics)


def render(snap: Dict[str, Any], now: float) -> Dict[str, Any]:
    """The fleet document of a `read` snapshot at Unix time `now`."""
    devices, sessions = snap["devices"], snap["sessions"]
    names = sorted(set(devices) | {n for n, k in sessions.items() if k} | set(snap["connected"]))
    rows = [_row(name, devices.get(name, {}), snap, now) for name in names]
    steps = snap["steps"]
    return {"time": now,
            "cloud": {"model": snap["model"], "engine": snap["engine"], "sessions": sum(sessions.values()),
                      "max_sessions": snap["max_sessions"], "kv_bytes": snap["kv_bytes"],
                      "kv_budget_bytes": snap["kv_budget_bytes"], "steps": steps["steps"],
                      "step_tokens": steps["tokens"], "devices": len(rows)},
            "devices": rows}


def _row(name: str, entry: Dict[str, Any], snap: Dict[str, Any], now: float) -> Dict[str, Any]:
    stats = entry.get("stats") or {}
    report_at = entry.get("report_at")
    return {
        "device": name, "connected": name in snap["connected"], "state": stats.get("state") or "unknown",
        "model": stats.get("model") or entry.get("model", ""), "bundle": stats.get("bundle", ""),
        "profile": entry.get("profile", ""), "power_mode": entry.get("power_mode", ""), "watts": stats.get("watts"),
        "requests": stats.get("requests", 0), "protocols": dict(stats.get("protocols", {})),
        "tokens_per_s": stats.get("tokens_per_s"), "ttft_p50_s": stats.get("ttft_p50_s"),
        "tbt_p50_s": stats.get("tbt_p50_s"), "acceptance": stats.get("acceptance"),
        "up_bps": float(entry.get("up_bps", 0.0)), "down_bps": float(entry.get("down_bps", 0.0)),
        "link_drops": stats.get("link_drops", 0), "sessions": snap["sessions"].get(name, 0),
        "kv_bytes": snap["kv_by_device"].get(name, 0), "usage": float(snap["usage"].get(name, 0.0)),
        "last_report_s": max(0.0, now - report_at) if report_at is not None else None,
    }


def fleet_view(server: Any) -> Dict[str, Any]:
    """The fleet document of a CloudServer now."""
    return render(read(server), time.time())

