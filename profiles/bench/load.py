"""`hat-bench auto`'s cloud load: other devices decoding on the cloud, in a process of their own on the cloud's cores.

On real hardware the other devices are other boards. Their connections were threads of the bench's own process
until stop 88, and so ran on the device's core: each one's Python and its ZMQ I/O thread took that core's time, and
the device's draft step measured under load was 15-50 % slower than idle (0.046-0.059 s against 0.040 on the AMD
EPYC of `fe2ad41`), a figure auto then carried back to the idle link phases of the next repetition, pricing sd
below its rows there (docs/AUTO.md "The other devices off the device's core"). In a process of their own, pinned to
the cloud's cores, what they cost falls on the cloud, which is the one they load."""
from __future__ import annotations

import multiprocessing
import os
import queue
import threading
from typing import List, Optional, Sequence

LOAD_CHUNK = 8  # tokens a load device asks for per request
LOAD_CONTEXT = 1024  # positions a load device's session reaches before it reopens (a prefill of its prompt)
LOAD_WARM = 3  # requests each load device completes before the phase's requests start (their prompts' prefill gone
# from the steps the cloud's report averages over: cloud_runtime.scheduler.RECENT_STEPS)
READY = "ready"


class Load:
    """N connections decoding on the cloud without pause until stopped (no model here): each keeps one session
    decoding, 8 tokens a request, and reopens it (its prompt prefilled again) only past LOAD_CONTEXT positions, so
    the load is steady decode work rather than bursts of prefill. They run in a process of their own (spawned: the
    bench's process holds models and threads), on `cpus` when given (the cloud's cores). Entering returns once every
    connection has made LOAD_WARM requests: the phase's requests meet the load in its steady state, not its start.
    A connection that fails, before or during the phase, is a RuntimeError naming it."""

    def __init__(self, link_config, n: int, prompt: Sequence[int], cpus: Optional[Sequence[int]] = None,
                 timeout_s: float = 300.0):
        if n < 1:
            raise ValueError(f"a load needs at least one device, got {n}")
        self.link_config, self.n, self.prompt, self.timeout_s = link_config, n, list(prompt), timeout_s
        self.cpus = sorted(cpus) if cpus else None
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.said = ctx.Queue()  # READY once warm, then any connection's failure as text
        self.process = ctx.Process(target=_devices, args=(link_config, n, self.prompt, self.cpus, self.stop,
                                                          self.said), name="hat-bench-load", daemon=True)

    def __enter__(self) -> "Load":
        self.process.start()
        try:
            first = self.said.get(timeout=self.timeout_s)
        except queue.Empty:
            first = f"not warm within {self.timeout_s:.0f} s"
        if first != READY:
            self._halt()
            raise RuntimeError(f"the load's {self.n} devices did not all start decoding: {first}")
        return self

    def __exit__(self, *exc) -> None:
        self._halt()
        failed = self._failures()
        if failed and not any(exc):  # the phase did not have the load it claims
            raise RuntimeError(f"a load device failed during the phase: {failed[0]}")

    def _halt(self) -> None:
        self.stop.set()
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)

    def _failures(self) -> List[str]:
        out = []
        while True:
            try:
                out.append(self.said.get_nowait())
            except queue.Empty:
                return out


def _devices(link_config, n: int, prompt: List[int], cpus: Optional[List[int]], stop, said) -> None:
    """The load's process: on `cpus`, n connections as threads; READY once each made LOAD_WARM requests, a failure's
    text whenever one fails; back once `stop` is set (or the bench that started it is gone) and every connection has
    closed."""
    parent = os.getppid()
    if cpus:
        os.sched_setaffinity(0, cpus)
    warm = threading.Semaphore(0)
    failed: List[str] = []

    def device(i: int) -> None:
        try:
            _decode(link_config, i, prompt, stop, warm)
        except BaseException as exc:  # said to the bench
            failed.append(f"load-{i}: {exc!r}")
            said.put(failed[-1])
            warm.release()

    threads = [threading.Thread(target=device, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for _ in range(n):
        warm.acquire()
    if not failed:
        said.put(READY)
    while not stop.wait(1.0):
        if os.getppid() != parent:  # the bench is gone (killed): so is the phase
            stop.set()
    for t in threads:
        t.join(timeout=60)


def _decode(link_config, i: int, prompt: List[int], stop, warm: threading.Semaphore) -> None:
    import numpy as np

    from edge_runtime.client import CloudClient, expect
    from hat_split.wire import messages as P

    hello = P.Hello(f"load-{i}", "load", 0, "", "hat-bench-auto")
    done = 0
    with CloudClient(link_config, hello) as client:
        sid = 0
        while not stop.is_set():
            sid += 1
            opened = expect(client.request(P.OpenSession(sid, "llm", np.asarray(prompt, np.int32),
                                                         P.Sampling(0.0), seed=i)), P.SessionOpened, P.OpenSession)
            position, step = opened.position, 0
            while not stop.is_set() and position + LOAD_CHUNK <= LOAD_CONTEXT:
                step += 1
                out = expect(client.request(P.Generate(sid, step, position, np.zeros(0, np.int32), LOAD_CHUNK)),
                             P.Generated, P.Generate)
                position = out.position
                done += 1
                if done == LOAD_WARM:
                    warm.release()
            client.request(P.CloseSession(sid, None, None, position))
