"""The draft model reading the committed tokens it lacks on a thread of its own, while the device waits for the cloud
(protocol auto's llm rounds and its opening, on a device with cores of its own: edge_runtime.sessions.auto).

The session's own thread never waits for a read: a reply that comes while the draft model is in a forward is
handled at once, the next request leaves, and the reading goes on behind it (a read in the session's thread held
every reply that came during a forward: 0.2–1.1 s of time to first token at low power under load, docs/AUTO.md).
The thread touches only the draft model's cache, up to the committed tokens it is handed (Drafter.catch_up never
reads past them), and the session lets it finish (`settle`) before it drafts, rolls back, generates alone or ends
the request: one writer of the cache at a time. What each forward took is kept for the session to hand to the cost
model on its own thread (`drain`), and (`compare`) what sd's drafts would have had accepted at the target's tokens it
read (Drafter.catch_up): the prompt's acceptance, measured while llm runs.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from edge_runtime.drafter import Drafter

READ_MOST = 64  # tokens per forward: a forward in progress when the session settles (a drafting round, the request's
# end) finishes first, so one forward is the most it waits; 64 tokens cost a few forwards of one (its fixed cost paid
# once), a prompt of hundreds a few forwards


@dataclass(frozen=True)
class Read:
    """One forward of the reader."""

    tokens: int
    seconds: float
    agreed: float = 0.0  # of `compared` target tokens read, the drafts sd would have had accepted (compare only)
    compared: int = 0
    marks: Tuple[Tuple[int, bool, float], ...] = ()  # at temperature 0, each compared token's (Drafter.marks)


class ReadAhead:
    """One request's reader of `drafter`'s missing tokens (module docstring)."""

    def __init__(self, drafter: Drafter, most: int = READ_MOST, compare: bool = False):
        """compare: measure the draft's acceptance on the target's tokens read (Drafter.catch_up)."""
        if most < 1:
            raise ValueError(f"a read takes at least one token per forward, got {most}")
        self.drafter, self.most, self.compare = drafter, most, compare
        self._lock = threading.Lock()
        self._running = False  # a thread is reading (set and cleared under the lock)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._reads: List[Read] = []  # each forward since the last drain
        self._error: Optional[BaseException] = None

    @property
    def running(self) -> bool:
        return self._running

    def start(self, whole: bool = False) -> None:
        """Read what the draft model lacks, a forward of at most `most` tokens at a time, until it lacks nothing or
        `stop`; a reader already running goes on (it reads what was committed since as well, a `stop` asked of it
        withdrawn). whole: a reader that starts now reads all the draft model lacks in its first forward — the
        opening's prompt, when the first round will likely draft and so wait for all of it: one forward of a prompt
        costs less than its forwards of `most` (7–11 % less for prompts of 120 and 250 tokens, the 0.5B draft on
        llama.cpp on one core here: 0.1–0.2 s, three times that on a board three times slower) and is the read a
        fixed sd request makes."""
        with self._lock:
            if self._running:  # its thread has not yet seen the stop (it checks under this lock): it goes on
                self._stop.clear()
                return
            if not self.drafter.behind:
                return
            self._running = True
            self._stop.clear()
            self._thread = threading.Thread(target=self._read, args=(whole,), name="hatspec-read-ahead", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """No forward after the one in progress (which finishes on its own thread: nobody waits for it)."""
        self._stop.set()

    def settle(self) -> None:
        """Stop and wait for the forward in progress: the caller may use the draft model after. Re-raises what
        failed on the reader's thread."""
        self.stop()
        thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the draft model's read while waiting failed: {error}") from error

    def drain(self) -> List[Read]:
        """The forwards finished since the last drain."""
        with self._lock:
            reads, self._reads = self._reads, []
        return reads

    def step(self) -> bool:
        """One forward of one token the draft model lacks, on the caller's thread, when no reader is running: a
        draft step's forward, which times the draft step where nothing drafts (protocol auto's step probe,
        edge_runtime.sessions.auto). Kept for `drain` as every read is; False when it read nothing."""
        with self._lock:
            if self._running or not self.drafter.behind:
                return False
        read = self._forward(1)
        with self._lock:
            self._reads.append(read)
        return True

    def _forward(self, most: int) -> Read:
        """One forward of at most `most` tokens the draft model lacks, timed (and compared, `compare`)."""
        d = self.drafter
        agreed, compared, marked, t0 = d.agreed, d.compared, len(d.marks), time.perf_counter()
        n = d.catch_up(most, compare=True) if self.compare else d.catch_up(most)
        return Read(n, time.perf_counter() - t0, d.agreed - agreed, d.compared - compared, tuple(d.marks[marked:]))

    def _read(self, whole: bool) -> None:
        """whole: the first forward reads all the draft model lacks (`start`)."""
        try:
            while True:
                with self._lock:
                    if self._stop.is_set() or not self.drafter.behind:
                        self._running = False
                        return
                    most, whole = (self.drafter.behind if whole else self.most), False
                read = self._forward(most)
                with self._lock:
                    self._reads.append(read)
        except BaseException as exc:  # handed to the session's thread by `settle`
            with self._lock:
                self._error, self._running = exc, False
