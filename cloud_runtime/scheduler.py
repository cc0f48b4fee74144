"""The cloud's continuous-batching scheduler (HAT §2.1, §3.3; Sarathi-style stall-free batching), plain Python.

Every device request becomes `Work` for one session: prompt positions to prefill (a prompt, or one of HAT's prompt
chunks) or a short decode / verify segment. Each step `plan()` packs one batch under a token budget:

1. decode / verify work first, whole: each is short and a device is waiting on it. Devices (a session's `owner`)
   take turns, the device served least recently first, each contributing its least recently served session's work
   per turn; so a device with many sessions gets no more of a step than one with a single session while the other
   waits. A segment that does not fit in what is left is passed over for smaller ones this step and, not having been
   served, comes before them next step;
2. the rest of the budget goes to prefill, shared out between the devices waiting with prompts (equal shares, what
   one cannot use going to the others), each device's oldest request first, split into chunks: a prompt longer than
   its share continues in the next step. Whenever prefill is waiting it gets at least `prefill_floor` tokens of every
   step, so a crowd of decoding devices cannot starve it.

Devices are also kept fair over time (least attained service): each device's recent usage is the positions planned
for it, halving every `usage_half_life` positions the cloud computes. The active devices are those with work or
served in the last `ACTIVE_STEPS` steps (a device drafting between two verifies has no work for a moment but is
still waiting on the cloud). An active device whose usage is above `OVER_SHARE` times the mean of the active
devices (and above one step's budget) is over its share: its decodes take their turns after the others', and while
any active device is within its share its prompts get no more than `prefill_floor` positions of a step (shared
among the devices over their share). So a device that floods the cloud with long prompts gets what the others
leave, in small chunks that do not stretch the steps they wait on, and closing its sessions does not reset its
usage. (The price: a device that sent much more than the others lately, say one very long prompt, waits in small
chunks while they are active; `usage_half_life = 0` turns this off.)

A session's works run in order, one segment per session per step (the runner appends each segment to that session's
KV cache). With `max_in_flight` > 1 (a pipeline of stages) the next batches are planned before the earlier ones come
back: a segment starts where the session's planned positions end, and batches are completed in the order planned.
Memory is a pool of `kv_capacity` positions and, when `kv_bytes` is set, of that many bytes, each session's
positions costing its own bytes (a split session's middle layers cost less than a token session's every layer): a
session holds its context plus the work it has queued; `open` and `submit` refuse what does not fit, and what
exceeds `max_context` or `max_sessions`, with a `SchedulerRefusal` naming the numbers; a refusal changes nothing.
`crop` gives back rejected draft positions, `close` everything a session held.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, FrozenSet, Hashable, List, Optional, Tuple

KINDS = ("prefill", "decode")
OVER_SHARE = 1.25  # a device whose recent usage exceeds this many times the mean of the active devices
ACTIVE_STEPS = 8  # a device served within this many steps is still active (its next request is on its way)
RECENT_STEPS = 16  # planned steps over which the positions of the devices other than one are averaged (cost reports)


class SchedulerRefusal(Exception):
    """Work or a session the cloud will not take; `code` is the protocol's error code."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class SchedulerConfig:
    token_budget: int = 512  # tokens per step (all segments together)
    prefill_floor: int = 64  # tokens of each step kept for waiting prefill work
    kv_capacity: int = 1 << 16  # positions of KV cache, all sessions together
    max_context: int = 8192  # positions one session may hold
    max_sessions: int = 64
    max_in_flight: int = 1  # batches planned and not yet completed (pipeline stages keep several in flight)
    kv_bytes: int = 0  # bytes of KV cache, all sessions together (each position at its session's cost); 0: unbounded
    usage_half_life: int = 4096  # positions computed over which a device's recent usage halves; 0: no usage priority

    def __post_init__(self) -> None:
        if self.kv_bytes < 0 or self.usage_half_life < 0:
            raise ValueError(f"kv_bytes and usage_half_life must be >= 0, got {self.kv_bytes}, "
                             f"{self.usage_half_life}")
        if min(self.token_budget, self.kv_capacity, self.max_context, self.max_sessions, self.max_in_flight) < 1:
            raise ValueError("token_budget, kv_capacity, max_context, max_sessions and max_in_flight must be >= 1")
        if not 0 <= self.prefill_floor <= self.token_budget:
            raise ValueError(f"prefill_floor must be in [0, token_budget={self.token_budget}], "
                             f"got {self.prefill_floor}")


@dataclass(eq=False)
class Work:
    session: Hashable
    kind: str  # "prefill" | "decode"
    tokens: int  # positions to process
    order: int  # arrival order
    tag: Any = None  # the caller's handle (the request to answer)
    done: int = 0  # positions processed so far
    planned: int = 0  # positions in planned batches (done or in flight)

    @property
    def left(self) -> int:
        return self.tokens - self.done


@dataclass(frozen=True)
class Segment:
    work: Work
    start: int  # the session's context length before this segment (its first position)
    offset: int  # where in its work this segment begins
    n: int  # positions in this step
    final: bool  # the work is complete after this segment

    @property
    def session(self) -> Hashable:
        return self.work.session

    @property
    def kind(self) -> str:
        return self.work.kind


@dataclass
class Batch:
    step: int
    segments: List[Segment]

    @property
    def tokens(self) -> int:
        return sum(s.n for s in self.segments)


@dataclass
class _Session:
    owner: Hashable = None  # the device it belongs to: the unit of fairness
    cost: int = 0  # bytes of KV cache per position
    context: int = 0  # positions in its KV cache
    queue: List[Work] = field(default_factory=list)
    served_at: int = 0  # the last step planned with a segment of it
    in_flight: int = 0  # positions planned, not yet completed

    def head(self) -> Optional[Work]:
        """Its first work with positions still to plan (works run in order)."""
        return next((w for w in self.queue if w.planned < w.tokens), None)

    @property
    def queued(self) -> int:
        return sum(w.left for w in self.queue)

    @property
    def held_bytes(self) -> int:
        """Bytes of KV cache it holds: its context and the work it has queued."""
        return (self.context + self.queued) * self.cost


class Scheduler:
    def __init__(self, config: SchedulerConfig = SchedulerConfig()):
        self.config = config
        self.sessions: Dict[Hashable, _Session] = {}
        self._order = itertools.count()
        self._step = 0
        self._in_flight: List[Batch] = []  # planned, not completed, oldest first
        self._recent: deque = deque(maxlen=RECENT_STEPS)  # per planned step: device → its positions in it
        self._owner_served: Dict[Hashable, int] = {}  # device → the last step planned with a segment of its
        self._usage: Dict[Hashable, float] = {}  # device → positions planned for it, decayed (usage_half_life)

    # -- admission --------------------------------------------------------------------------------------------------
    @property
    def kv_used(self) -> int:
        return sum(s.context + s.queued for s in self.sessions.values())

    @property
    def kv_free(self) -> int:
        """KV positions no session holds or has queued."""
        return max(0, self.config.kv_capacity - self.kv_used)

    @property
    def waiting(self) -> int:
        """Sessions with work queued."""
        return sum(1 for s in self.sessions.values() if s.queued)

    @property
    def kv_bytes_used(self) -> int:
        return sum(s.held_bytes for s in self.sessions.values())

    def open(self, session: Hashable, owner: Hashable = None, cost: int = 0) -> None:
        """Admit a session of device `owner` (None: the session is its own device) whose KV cache costs `cost`
        bytes per position."""
        if session in self.sessions:
            raise SchedulerRefusal("bad_session", f"session {session!r} is already open")
        if len(self.sessions) >= self.config.max_sessions:
            raise SchedulerRefusal("busy", f"the cloud holds its limit of {self.config.max_sessions} sessions")
        self.sessions[session] = _Session(session if owner is None else owner, int(cost))

    def submit(self, session: Hashable, kind: str, tokens: int, tag: Any = None) -> Work:
        """Queue `tokens` positions of `kind` work for an open session; refused (nothing queued) if it cannot fit."""
        s = self._get(session)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if tokens < 1:
            raise SchedulerRefusal("bad_request", f"work of {tokens} positions: at least 1 is needed")
        if kind == "decode" and tokens > self.config.token_budget:
            raise SchedulerRefusal("too_large", f"a decode segment of {tokens} positions exceeds the step budget of "
                                                f"{self.config.token_budget} (send it as prefill or shorter)")
        held = s.context + s.queued
        if held + tokens > self.config.max_context:
            raise SchedulerRefusal("context_full", f"session {session!r} would hold {held + tokens} positions; the "
                                                   f"limit is {self.config.max_context}")
        free = self.config.kv_capacity - self.kv_used
        if tokens > free:
            raise SchedulerRefusal("memory_full", f"{tokens} positions of KV cache needed, {free} of "
                                                  f"{self.config.kv_capacity} free")
        if self.config.kv_bytes:
            free = self.config.kv_bytes - self.kv_bytes_used
            if tokens * s.cost > free:
                raise SchedulerRefusal("memory_full", f"{tokens * s.cost} bytes of KV cache needed ({tokens} "
                                                      f"positions), {max(free, 0)} of {self.config.kv_bytes} free")
        work = Work(session, kind, int(tokens), next(self._order), tag)
        s.queue.append(work)
        return work

    def crop(self, session: Hashable, length: int) -> None:
        """The session's cache now holds `length` positions (rejected drafts rolled back); frees the rest."""
        s = self._get(session)
        if s.in_flight:
            raise SchedulerRefusal("busy_session", f"session {session!r} has positions in flight: it cannot crop")
        if not 0 <= length <= s.context:
            raise SchedulerRefusal("bad_position", f"cannot crop session {session!r} of {s.context} positions to "
                                                   f"{length}")
        s.context = length

    def close(self, session: Hashable) -> List[Work]:
        """Forget a session; returns its unfinished work (to answer with an error). Memory is free at once."""
        s = self.sessions.pop(session, None)
        if s is not None and not any(o.owner == s.owner for o in self.sessions.values()):
            self._owner_served.pop(s.owner, None)
        return list(s.queue) if s else []

    # -- steps ----------------------------------------------------------------------------------------------------
    def plan(self, fits: Optional[Callable[[Work], bool]] = None) -> Optional[Batch]:
        """The next step's batch (None when nothing waits or `max_in_flight` batches are out). `complete` each batch,
        in the order planned. fits: asked of each decode work the step has room for, in turn; False leaves it to a
        later step (a resource of the runner's own is short: llama.cpp's sequence ids for draft trees)."""
        if len(self._in_flight) >= self.config.max_in_flight:
            return None
        heads = [w for w in (s.head() for s in self.sessions.values()) if w is not None]
        if not heads:
            return None
        budget = self.config.token_budget
        active = self._active(heads)
        over = self._over_share(active)
        decodes = [w for w in heads if w.kind == "decode"]
        prefills = [w for w in heads if w.kind == "prefill"]
        unplanned = sum(w.tokens - w.planned for w in prefills)
        room = budget - min(self.config.prefill_floor, unplanned)
        segments: List[Segment] = []
        used = 0
        for w in self._turns(decodes, lambda w: (self.sessions[w.session].served_at, w.order), over):
            if used + w.tokens <= room and (fits is None or fits(w)):
                segments.append(self._segment(w, w.tokens))
                used += w.tokens
        within = [w for w in prefills if self._owner(w) not in over]
        beyond = [w for w in prefills if self._owner(w) in over]
        keep = min(self.config.prefill_floor, sum(w.tokens - w.planned for w in beyond))  # the floor is theirs too
        for w, n in self._shares(within, budget - used - keep):
            segments.append(self._segment(w, n))
            used += n
        rest = budget - used
        if active - over and (segments or self.config.prefill_floor):  # others are waiting on the cloud (and a
            rest = min(rest, self.config.prefill_floor)  # step with nothing else still makes progress)
        for w, n in self._shares(beyond, rest):
            segments.append(self._segment(w, n))
            used += n
        if not segments:
            return None
        self._step += 1
        self._account(segments)
        batch = Batch(self._step, segments)
        self._in_flight.append(batch)
        return batch

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def complete(self, batch: Batch) -> List[Work]:
        """Account a computed batch, the oldest in flight: contexts grow; returns the works it finished, in batch
        order."""
        if not self._in_flight or batch is not self._in_flight[0]:
            raise RuntimeError("complete() takes the oldest batch in flight")
        self._in_flight.pop(0)
        finished = []
        for seg in batch.segments:
            s = self.sessions.get(seg.session)
            if s is None or not s.queue or s.queue[0] is not seg.work:
                continue  # the session closed (or was reopened) while its segment was computed
            seg.work.done += seg.n
            s.context += seg.n
            s.in_flight -= seg.n
            if seg.work.left == 0:
                s.queue.pop(0)
                finished.append(seg.work)
        return finished

    def abandon(self) -> List[Batch]:
        """Forget every batch in flight (they could not be computed): nothing is accounted and their positions go
        back to planning; the caller closes their sessions. Returns the batches."""
        out, self._in_flight = self._in_flight, []
        for batch in out:
            for seg in batch.segments:
                seg.work.planned -= seg.n
                s = self.sessions.get(seg.session)
                if s is not None:
                    s.in_flight -= seg.n
        return out

    def _owner(self, work: Work) -> Hashable:
        return self.sessions[work.session].owner

    def _active(self, heads: List[Work]) -> FrozenSet[Hashable]:
        """The devices with work, or served within the last `ACTIVE_STEPS` steps."""
        recent = self._step - ACTIVE_STEPS
        return frozenset([self._owner(w) for w in heads] + [o for o, at in self._owner_served.items() if at > recent])

    def _over_share(self, active: FrozenSet[Hashable]) -> FrozenSet[Hashable]:
        """The active devices whose recent usage is over their share (see the module's docstring)."""
        if not self.config.usage_half_life:
            return frozenset()
        usage = {o: self._usage.get(o, 0.0) for o in active}
        mean = sum(usage.values()) / len(usage)
        return frozenset(o for o, u in usage.items() if u > OVER_SHARE * mean and u > self.config.token_budget)

    def _account(self, segments: List[Segment]) -> None:
        """The step is planned: its sessions and devices were served now; usage decays by the positions planned and
        grows by each device's."""
        half_life = self.config.usage_half_life
        if half_life:
            decay = 0.5 ** (sum(seg.n for seg in segments) / half_life)
            self._usage = {o: u * decay for o, u in self._usage.items() if u * decay >= 1.0}
        step: Dict[Hashable, int] = {}
        for seg in segments:
            owner = self._owner(seg.work)
            self.sessions[seg.session].served_at = self._owner_served[owner] = self._step
            step[owner] = step.get(owner, 0) + seg.n
            if half_life:
                self._usage[owner] = self._usage.get(owner, 0.0) + seg.n
        self._recent.append(step)

    def others_positions(self, owner: Hashable) -> float:
        """Positions per step planned for devices other than `owner`, the mean over the last `RECENT_STEPS` steps (0
        before any): what each step `owner` joins holds besides its own work. Unlike the mean positions per step,
        `owner`'s own prompt (a large step just before its session opened) does not count."""
        if not self._recent:
            return 0.0
        return sum(n for step in self._recent for o, n in step.items() if o != owner) / len(self._recent)

    @property
    def usage(self) -> Dict[Hashable, float]:
        """Each device's recent usage: positions planned for it, halving every `usage_half_life` positions."""
        return dict(self._usage)

    def _by_owner(self, works: List[Work], key: Any, over: frozenset = frozenset()) -> List[List[Work]]:
        """Works grouped by device: the devices within their share before those in `over`, each side the device
        served least recently first; each group ordered by `key`."""
        groups: Dict[Hashable, List[Work]] = {}
        for w in works:
            groups.setdefault(self._owner(w), []).append(w)
        order = sorted(groups, key=lambda o: (o in over, self._owner_served.get(o, 0), min(w.order for w in groups[o])))
        return [sorted(groups[o], key=key) for o in order]

    def _turns(self, works: List[Work], key: Any, over: frozenset = frozenset()) -> List[Work]:
        """Works in turns of the devices: each device's first, then each one's second, …"""
        groups = self._by_owner(works, key, over)
        return [g[i] for i in range(max((len(g) for g in groups), default=0)) for g in groups if i < len(g)]

    def _shares(self, works: List[Work], budget: int) -> List[Tuple[Work, int]]:
        """Prefill positions of `budget` shared out between the devices (equal shares; what a device cannot use goes
        to the others), each device's works oldest first: (work, positions) with one segment per work."""
        groups = self._by_owner(works, lambda w: w.order)
        want = [sum(w.tokens - w.planned for w in g) for g in groups]
        give = [0] * len(groups)
        left = budget
        while left > 0 and any(g < w for g, w in zip(give, want)):
            hungry = [i for i, (g, w) in enumerate(zip(give, want)) if g < w]
            share = max(1, left // len(hungry))
            for i in hungry:
                n = min(share, want[i] - give[i], left)
                give[i] += n
                left -= n
        out: List[Tuple[Work, int]] = []
        for g, n in zip(groups, give):
            for w in g:
                take = min(n, w.tokens - w.planned)
                if take <= 0:
                    break
                out.append((w, take))
                n -= take
        return out

    def _segment(self, work: Work, n: int) -> Segment:
        s = self.sessions[work.session]
        seg = Segment(work, s.context + s.in_flight, work.planned, n, work.planned + n == work.tokens)
        work.planned += n
        s.in_flight += n
        return seg

    def _get(self, session: Hashable) -> _Session:
        s = self.sessions.get(session)
        if s is None:
            raise SchedulerRefusal("no_session", f"session {session!r} is not open")
        return s
