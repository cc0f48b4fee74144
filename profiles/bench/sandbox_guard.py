"""The child side of `profiles.bench.code_exec`: run as a script by a fresh `python -I -B` in the sandbox directory.

    python -I -B sandbox_guard.py RESULT_FD PROGRAM_FILE SANDBOX_DIR      (stdin: one line, the run's nonce)

It reads the nonce and the program, installs an audit hook (sys.addaudithook, PEP 578), then executes the program.
The verdict goes to RESULT_FD (a pipe the parent holds) as one JSON line {"nonce", "status", "message"} with status
"passed" (the program ran to its end), "failed" (an exception: AssertionError from the tests, or any other) or
"blocked" (the hook stopped an operation; the process ends at once, so candidate code cannot catch it). The parent
trusts only a line carrying the nonce, so a program that exits early (sys.exit, os._exit) never reads as passed.

What the hook stops:
  * open() / os.open() for writing of any path outside SANDBOX_DIR (/dev/null excepted); for reading, of any path
    outside SANDBOX_DIR and the Python installation (sys.prefix, the stdlib, site-packages; /dev/null, /dev/urandom);
  * deleting, renaming, linking, chmod/chown/utime, mkdir and chdir outside SANDBOX_DIR, and any of them relative to
    a dir_fd; listing a directory outside what may be read;
  * every socket.* event (socket creation, connect, bind, getaddrinfo, ...), subprocess.Popen, os.system, os.exec*,
    os.posix_spawn, os.spawn*, os.fork / forkpty, os.kill / killpg, signal.pthread_kill, pty.spawn, ctypes.* (loading
    a library), resource.setrlimit / prlimit;
  * `_posixsubprocess.fork_exec` (which has no audit event of its own) is replaced by a blocking function.

Audit hooks guard against a model's careless or stray code, not against a determined attacker inside the interpreter
(CPython documents that hooks are no sandbox): the parent's resource limits, empty environment, temporary working
directory, process-group kill and, as root, a network namespace are the outer walls. Stdlib only: this file must not
import the project (it runs isolated, from outside the project's import path).
"""
import json
import os
import sys
import sysconfig

BLOCKED_EVENTS = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                  "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill", "pty.spawn", "ctypes.",
                  "resource.setrlimit", "resource.prlimit", "os.startfile", "_posixsubprocess")
# Events that change the file system at their path arguments, with the argument positions that are dir_fd (a path
# relative to an open directory could point anywhere: refused when given).
WRITE_EVENTS = {"os.remove": (1,), "os.rmdir": (1,), "os.mkdir": (2,), "os.chmod": (2,), "os.chown": (3,),
                "os.rename": (2, 3), "os.symlink": (2,), "os.link": (2, 3), "os.utime": (3,), "os.truncate": (),
                "os.chdir": (), "os.chflags": (), "os.lchflags": (), "shutil.rmtree": (1,), "shutil.copyfile": (),
                "shutil.copymode": (), "shutil.copystat": (), "shutil.move": (), "shutil.chown": ()}
READ_EVENTS = ("os.listdir", "os.scandir")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
DEVICES_READ = ("/dev/null", "/dev/urandom", "/dev/random")


def _real(path) -> str:
    return os.path.realpath(os.fsdecode(os.fspath(path)))


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


class Guard:
    def __init__(self, fd: int, nonce: str, sandbox: str):
        self.fd, self.nonce = fd, nonce
        self.write_roots = (_real(sandbox),)
        installation = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
        installation.update(v for k, v in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib", "purelib",
                                                                                  "platlib"))
        self.read_roots = self.write_roots + tuple(sorted(_real(p) for p in installation if p))
        self.busy = False  # the hook's own calls (realpath, json) raise events too: do not recurse

    def report(self, status: str, message: str) -> None:
        line = json.dumps({"nonce": self.nonce, "status": status, "message": message[:2000]}) + "\n"
        os.write(self.fd, line.encode("utf-8", "replace"))

    def block(self, what: str) -> None:
        self.report("blocked", what)
        os._exit(3)

    def hook(self, event: str, args: tuple) -> None:
        if self.busy:
            return
        self.busy = True
        try:
            self._check(event, args)
        finally:
            self.busy = False

    def _path_ok(self, path, write: bool) -> bool:
        if isinstance(path, int) and not isinstance(path, bool):
            return True  # an already open descriptor: its opening passed this check
        if path is None:
            return True
        real = _real(path)
        if real == "/dev/null":
            return True
        if write:
            return _under(real, self.write_roots)
        return real in DEVICES_READ or _under(real, self.read_roots)

    def _check(self, event: str, args: tuple) -> None:
        if event == "ctypes.dlopen" and (tuple(args) + (None,))[0] is None:
            return  # `import ctypes` opens the running process itself (no new code); any lookup in it is blocked
        if event.startswith(BLOCKED_EVENTS):
            self.block(f"{event} {_brief(args)}")
        elif event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            write = any(ch in mode for ch in "wax+") if isinstance(mode, str) else bool((flags or 0) & WRITE_FLAGS)
            if not self._path_ok(path, write):
                self.block(f"open {'for writing' if write else 'for reading'} outside the sandbox: {path!r}")
        elif event in WRITE_EVENTS:
            dir_fds = WRITE_EVENTS[event]
            if any(i < len(args) and args[i] not in (None, -1) for i in dir_fds):  # -1: no dir_fd given
                self.block(f"{event} relative to a dir_fd: {_brief(args)}")
            for i, arg in enumerate(args):
                if i not in dir_fds and isinstance(arg, (str, bytes, os.PathLike)) and not self._path_ok(arg, True):
                    self.block(f"{event} outside the sandbox: {arg!r}")
        elif event in READ_EVENTS:
            if args and isinstance(args[0], (str, bytes, os.PathLike)) and not self._path_ok(args[0], False):
                self.block(f"{event} outside the sandbox: {args[0]!r}")


def _brief(args: tuple) -> str:
    text = repr(args)
    return text if len(text) <= 200 else text[:200] + "..."


def main(argv) -> int:
    fd, program, sandbox = int(argv[1]), argv[2], argv[3]
    nonce = sys.stdin.readline().strip()
    with open(program, encoding="utf-8") as f:
        source = f.read()
    guard = Guard(fd, nonce, sandbox)
    try:
        code = compile(source, "candidate.py", "exec")
    except (SyntaxError, ValueError) as e:  # ValueError: a null byte in the source
        guard.report("failed", f"{type(e).__name__}: {e}")
        return 1
    import _posixsubprocess

    _posixsubprocess.fork_exec = lambda *a, **k: guard.block("_posixsubprocess.fork_exec")
    sys.dont_write_bytecode = True
    import tempfile

    tempfile.tempdir = sandbox  # the environment is empty (no TMPDIR): temporary files go to the sandbox, not /tmp
    sys.addaudithook(guard.hook)
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except AssertionError as e:
        guard.report("failed", f"AssertionError: {e}" if str(e) else "AssertionError (a test assertion)")
        return 1
    except BaseException as e:  # noqa: BLE001 - the verdict names whatever the program raised, SystemExit too
        guard.report("failed", f"{type(e).__name__}: {e}")
        return 1
    guard.report("passed", "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
