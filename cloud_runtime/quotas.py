"""What one device may hold of a shared cloud (plain Python): per-device quotas, their usage, and which idle session
to evict when the cloud's KV memory runs out.

A device is who the cloud can tell apart: over CurveZMQ the allow-list certificate it authenticated with (its name;
cloud_runtime.zap), on a plaintext link (a lab) the device id its Hello declares. Its quotas (`Quota`) are the
cloud's defaults (CloudConfig's `device_*` keys) unless its allow-list entry carries its own: a file
`NAME.quota.toml` beside `NAME.key` (docs/SECURITY.md). A request over a quota is refused with an `Error` whose
code is "quota" and whose message names the quota, the device and its usage; other devices are not affected.

The quota math (`Quota`, `QuotaBook`, `eviction_order`, sizes and quota files) is pure. `Admission` applies it to
the cloud's open sessions (cloud_runtime.sessions.SessionTable) and the work runner holding their caches: it charges
each request to its device, refuses one over the cloud's session limit, and evicts idle sessions when the runner is
out of KV memory or sessions.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Deque, Dict, Hashable, Optional, Sequence, Tuple

from cloud_runtime.sessions import SessionTable
from cloud_runtime.work import Key
from hat_split.wire import messages as P

log = logging.getLogger("hatspec.cloud")

UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10 ** 3, "mb": 10 ** 6,
         "gb": 10 ** 9, "tb": 10 ** 12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
WINDOW_S = 60.0  # prompt tokens are counted over the last minute


def parse_bytes(text: Any, what: str = "size") -> int:
    """Bytes of a size like 8GiB, 512MiB, 1.5GB or 1048576 (ValueError naming `what` otherwise)."""
    if isinstance(text, int) and not isinstance(text, bool) and text >= 0:
        return text
    m = _SIZE.match(str(text))
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"{what} must be a size like 8GiB, 512MiB or a number of bytes, got {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Quota:
    """What one device may hold at once; 0 = no limit of that kind beyond the cloud's own."""

    sessions: int = 0  # sessions open
    kv_bytes: int = 0  # bytes of KV cache held by its sessions (token and split alike)
    in_flight: int = 0  # requests being computed
    prompt_tokens_per_min: int = 0  # prompt positions (OpenSession prompts, split prompt chunks) per minute

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"quota {f.name} must be >= 0, got {getattr(self, f.name)}")


QUOTA_KEYS = {"sessions": int, "kv_memory": str, "in_flight": int, "prompt_tokens_per_min": int}


def quota_from_file(path: Path, default: Quota) -> Quota:
    """An allow-list entry's quotas (`NAME.quota.toml`: any of sessions, kv_memory, in_flight,
    prompt_tokens_per_min) over the defaults; ValueError naming the file and the key."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    changes = {}
    for key, value in data.items():
        if key not in QUOTA_KEYS:
            raise ValueError(f"{path}: unknown quota {key!r}; known: {', '.join(QUOTA_KEYS)}")
        if key == "kv_memory":
            changes["kv_bytes"] = parse_bytes(value, f"{path}: kv_memory")
        elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{path}: {key} must be an integer >= 0, got {value!r}")
        else:
            changes[key] = value
    return dataclasses.replace(default, **changes)


def allow_list_quotas(directory: str, default: Quota) -> Dict[str, Quota]:
    """Certificate name → its quotas, for every `NAME.quota.toml` in an allow-list directory."""
    return {p.name[:-len(".quota.toml")]: quota_from_file(p, default)
            for p in sorted(Path(directory).glob("*.quota.toml"))}


class QuotaExceeded(Exception):
    code = "quota"


@dataclass
class Usage:
    """A device's use of the cloud now."""

    sessions: int = 0
    kv_bytes: int = 0
    in_flight: int = 0
    prompt_tokens: int = 0  # over the last WINDOW_S


class QuotaBook:
    """Each device's quotas and what it used recently; `check_*` raise QuotaExceeded with the quota's name and the
    device's usage, and change nothing."""

    def __init__(self, default: Quota, overrides: Optional[Dict[str, Quota]] = None):
        self.default = default
        self.overrides = dict(overrides or {})
        self._prompts: Dict[Hashable, Deque[Tuple[float, int]]] = collections.defaultdict(collections.deque)
        self.refusals: Dict[str, int] = collections.Counter()  # quota name → refusals

    def quota(self, device: Hashable) -> Quota:
        return self.overrides.get(device, self.default) if isinstance(device, str) else self.default

    def prompt_tokens(self, device: Hashable, now: float) -> int:
        window = self._prompts.get(device)
        if not window:
            return 0
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        return sum(n for _, n in window)

    def check(self, device: Hashable, usage: Usage, sessions: int = 0, kv_bytes: int = 0, in_flight: int = 0,
              prompt_tokens: int = 0) -> None:
        """Refuse adding these amounts to a device's `usage` if one would pass its quota."""
        q = self.quota(device)
        asks = (("sessions", q.sessions, usage.sessions, sessions, str),
                ("kv_memory", q.kv_bytes, usage.kv_bytes, kv_bytes, format_bytes),
                ("in_flight", q.in_flight, usage.in_flight, in_flight, str),
                ("prompt_tokens_per_min", q.prompt_tokens_per_min, usage.prompt_tokens, prompt_tokens, str))
        for name, limit, used, more, fmt in asks:
            if limit and more and used + more > limit:
                self.refusals[name] += 1
                raise QuotaExceeded(f"device {device} is over its {name} quota: it holds {fmt(used)} and asks "
                                    f"{fmt(more)} more; its quota is {fmt(limit)}")

    def spend_prompt(self, device: Hashable, tokens: int, now: float) -> None:
        if tokens:
            self._prompts[device].append((now, tokens))

    def prune(self, now: float) -> None:
        """Forget prompt windows with nothing in the last minute (devices come and go)."""
        for device in list(self._prompts):
            if not self.prompt_tokens(device, now):
                del self._prompts[device]


@dataclass(frozen=True)
class Holding:
    """A session as eviction sees it."""

    key: Hashable
    device: Hashable
    kv_bytes: int
    idle: bool  # nothing queued or being computed, no request waiting on it
    last_active: float  # monotonic time of its last request or answer


def eviction_order(sessions: Sequence[Holding], capacity: int, asking: Hashable, spare: Hashable = None) -> list:
    """Idle sessions to evict, first to last, when the cloud's KV memory (`capacity` bytes) or its sessions run out
    and device `asking` wants more: devices over their fair share (capacity / devices holding KV) first, the device
    furthest over first, each device's least recently active session first; then, only when `asking` is itself
    within its share, the idle sessions of devices within theirs, least recently active first (a device over its
    share never pushes out one within its own). `spare`: a session never evicted (the one asking for room)."""
    held: Dict[Hashable, int] = collections.Counter()
    for s in sessions:
        held[s.device] += s.kv_bytes
    share = capacity / max(1, len(held))
    over = lambda d: held[d] > share  # noqa: E731
    idle = [s for s in sessions if s.idle and s.key != spare and (over(s.device) or not over(asking))]
    return sorted(idle, key=lambda s: (not over(s.device), -(held[s.device] - share), s.last_active))


class Admission:
    """Who may take what of the cloud now: each request charged to its device (`charge`, `spend`), new sessions
    within the cloud's limit (`admit`), room made by evicting idle sessions (`with_room`)."""

    def __init__(self, sessions: SessionTable, quotas: QuotaBook, device_of: Callable[[bytes], Hashable],
                 max_sessions: int, kv_bytes: int = 0):
        """device_of: who a connection counts as (cloud_runtime.devices.DeviceRegistry.device_of); max_sessions: the
        cloud's session limit (CloudConfig.max_sessions); kv_bytes: the cloud's KV memory, for fair shares (0: what
        the sessions hold)."""
        self.sessions = sessions
        self.work = sessions.work
        self.quotas = quotas
        self.device_of = device_of
        self.kv_bytes = kv_bytes
        self.max_sessions = max_sessions
        self.evicted = 0  # sessions evicted to make room

    def usage(self, device: Any) -> Usage:
        """What a device holds now: sessions, their KV bytes, requests being computed, prompt tokens this minute."""
        u = Usage(prompt_tokens=self.quotas.prompt_tokens(device, time.monotonic()))
        for key, s in self.sessions.items():
            if s.device == device:
                u.sessions += 1
                u.kv_bytes += self.work.held_bytes(key)
                u.in_flight += bool(self.work.held(key)[1])
        return u

    def charge(self, identity: bytes, key: Key, cost: int, positions: int, new_session: bool = False,
               prompt: int = 0) -> Any:
        """Refuse (ProtocolError "quota", naming the quota and the usage) a request that would take its device past a
        quota: a new session, `positions` more KV positions at `cost` bytes each, one more request being computed,
        `prompt` prompt tokens (spent with `spend` once the work is queued). Returns the device."""
        device = self.device_of(identity)
        busy = key in self.sessions and bool(self.work.held(key)[1])
        try:
            self.quotas.check(device, self.usage(device), sessions=int(new_session), kv_bytes=cost * positions,
                              in_flight=int(positions > 0 and not busy), prompt_tokens=prompt)
        except QuotaExceeded as exc:
            raise P.ProtocolError("quota", str(exc)) from None
        return device

    def spend(self, device: Any, prompt: int) -> None:
        """Count prompt tokens a device sent, once its work is queued."""
        self.quotas.spend_prompt(device, prompt, time.monotonic())

    def admit(self, identity: bytes, key: Key) -> None:
        """Refuse (ProtocolError "busy") a new session while the cloud holds max_sessions and no idle one may go."""
        def room() -> None:
            if key not in self.sessions and len(self.sessions) >= self.max_sessions:
                raise P.ProtocolError("busy", f"the cloud holds its limit of {self.max_sessions} sessions")
        self.with_room(identity, key, room)

    def with_room(self, identity: bytes, key: Key, fn: Callable[[], Any]) -> Any:
        """fn() (it opens a session or queues work); when the cloud is out of KV memory or sessions, evict idle
        sessions (`eviction_order`) one at a time and try again, until it fits or none is left."""
        while True:
            try:
                return fn()
            except P.ProtocolError as exc:
                if exc.code not in ("memory_full", "busy") or not self.evict_one(identity, key):
                    raise

    def evict_one(self, identity: bytes, spare: Key) -> bool:
        """Close the first idle session eviction picks; its device reopens it from its own history when it next
        asks ("no_session"). False when none may go."""
        holdings = [Holding(k, s.device, self.work.held_bytes(k), not self.work.held(k)[1], s.last_active)
                    for k, s in self.sessions.items()]
        capacity = self.kv_bytes or sum(h.kv_bytes for h in holdings)
        order = eviction_order(holdings, capacity, self.device_of(identity), spare)
        if not order:
            return False
        victim = order[0]
        log.info("evicted session %s of device %s (idle, %d KV bytes) to make room for device %s", victim.key[1],
                 victim.device, victim.kv_bytes, self.device_of(identity))
        self.sessions.free(victim.key)
        self.evicted += 1
        return True
