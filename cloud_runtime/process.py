"""Start `hat-cloud serve` as a real separate process and wait until it is ready (used by demo, bench, tests)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import List, Optional, Sequence

from cloud_runtime.cli import READY_LINE
from hat_split.net.security import LinkSecurity, cli_args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


def die_with(parent: int) -> None:
    """In a child process: be sent SIGTERM when `parent` ends, however it ends (a benchmark killed by a signal, or by
    SIGKILL, runs no cleanup of its own), so no server outlives it holding cores and ports. Linux only; elsewhere
    nothing. A parent already gone by now ends the child at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class CloudProcess:
    """Context manager: a cloud server process on 127.0.0.1:<port>; `endpoint` once ready."""

    def __init__(self, model: str, port: Optional[int] = None, extra_args: List[str] = (),
                 ready_timeout_s: float = 900.0, threads: int = 0, log_path: Optional[str] = None,
                 security: Optional[LinkSecurity] = None, cpus: Sequence[int] = ()):
        """security: the link's keys; None passes --plaintext (say so where it is meant: benchmarks, tests).
        cpus: the cores the process (and every thread it starts) may run on; empty: any."""
        self.model = model
        self.cpus = set(cpus)
        self.port = port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "cloud_runtime.cli", "serve", "--model", model, "--bind", self.endpoint,
                     "--threads", str(threads), *cli_args(security, "cloud"), *extra_args]
        self.ready_timeout_s = ready_timeout_s
        self.log_path = log_path
        self.ready_info = ""
        self.proc: Optional[subprocess.Popen] = None
        self._stderr: List[str] = []

    def __enter__(self) -> "CloudProcess":
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        parent, cpus = os.getpid(), self.cpus

        def in_child() -> None:  # after the fork, before the server starts
            die_with(parent)
            if cpus:
                os.sched_setaffinity(0, cpus)  # before torch starts its threads

        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     preexec_fn=in_child)
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        ready = threading.Event()

        def watch_stdout():
            for line in self.proc.stdout:
                if line.startswith(READY_LINE):
                    self.ready_info = line.strip()
                    ready.set()

        threading.Thread(target=watch_stdout, daemon=True).start()
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                tail = "".join(self._stderr[-60:])  # torchrun prints its summary after the cause
                raise RuntimeError(f"the cloud process did not become ready (exit {self.proc.returncode}):\n{tail}")
        return self

    def _drain_stderr(self) -> None:
        log = open(self.log_path, "a", encoding="utf-8") if self.log_path else None
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-200]
            if log:
                log.write(line)
                log.flush()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
