"""`hat-flash`: put a bundle on devices over ssh, verified on the device, idempotent.

One device: the bundle is checked here first (hat_split.files.bundle.load); the device's copy is checked with
`sha256sum` over ssh; only files that are missing or differ are sent (scp) into `<dir>/.incoming/`, checked again
there, and moved into place with the manifest last, so a device never holds a manifest whose files are not all
verified. A second flash of the same bundle sends nothing. A fleet (an Ansible inventory) runs
export/deploy/flash.yml, which does the same per host with Ansible's own checksummed copies and then checks every
sha256 on the device. The ssh and scp command lines come from hat_split.net.ssh.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from hat_split.files import bundle as M
from hat_split.files.settings import setting
from hat_split.net.ssh import login, scp_argv, ssh_argv

DEFAULT_DIR = "/opt/hatspec/bundle"
LOCAL = "local:"
_RECAP = re.compile(r"^(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unreachable>\d+)"
                    r"\s+failed=(?P<failed>\d+)", re.M)
_TARGET = re.compile(r"^(?:(?P<user>[^@:\s]+)@)?(?P<host>\[[^\]]+\]|[^:@\s]+)(?::(?P<port>\d+))?(?::(?P<path>/\S*))?$")


class FlashError(RuntimeError):
    """A flash that did not land verified, and why."""


@dataclass(frozen=True)
class Target:
    host: str
    user: str = ""
    port: int = 22
    path: str = DEFAULT_DIR
    ssh_options: tuple = ()  # extra ssh arguments (-i KEY, -o Option=value, ...)
    local: bool = False  # `local:/path`: this machine, no ssh (a device installing itself, CI's device venvs)

    @staticmethod
    def parse(text: str, ssh_options: Sequence[str] = (), default_path: str = DEFAULT_DIR) -> "Target":
        """`[user@]host[:port][:/absolute/path]`, e.g. `root@10.0.0.7:2222:/opt/hatspec/bundle`, or
        `local:/absolute/path` for this machine."""
        text = text.strip()
        if text.startswith(LOCAL):
            path = text[len(LOCAL):]
            if not path.startswith("/"):
                raise ValueError(f"bad device {text!r}: local:/absolute/path")
            return Target("localhost", path=path.rstrip("/") or "/", local=True)
        m = _TARGET.match(text)
        if not m:
            raise ValueError(f"bad device {text!r}: expected [user@]host[:port][:/absolute/path] or local:/path")
        return Target(m["host"].strip("[]"), m["user"] or "", int(m["port"] or 22), m["path"] or default_path,
                      tuple(ssh_options))

    @property
    def login(self) -> str:
        return "local" if self.local else login(self.host, self.user)

    def ssh(self, command: str) -> List[str]:
        if self.local:
            return ["sh", "-c", command]
        return ssh_argv(self.host, command, user=self.user, port=self.port, options=self.ssh_options)

    def scp(self, local: Path, remote_rel: str) -> List[str]:
        if self.local:
            return ["cp", str(local), f"{self.path}/{remote_rel}"]
        return scp_argv(local, self.host, f"{self.path}/{remote_rel}", user=self.user, port=self.port,
                        options=self.ssh_options)


@dataclass(frozen=True)
class FlashConfig:
    """`hat-flash`: which bundle goes to which devices, and how ssh reaches them (docs/CONFIG.md)."""

    bundle: str = setting(help="a hat-export bundle directory (checked before anything is sent)", flag="")
    devices: Tuple[str, ...] = setting((), "[user@]host[:port][:/absolute/path] each (default path "
                                       "/opt/hatspec/bundle)", flag="")
    inventory: str = setting("", "an Ansible inventory: flash its hosts through flash.yml instead of `devices`",
                             metavar="FILE")
    limit: str = setting("", "Ansible host pattern within the inventory; \"\": every host", metavar="PATTERN")
    identity: str = setting("", "ssh private key file; \"\": ssh's own (the agent, ~/.ssh/id_*)", short="-i",
                            metavar="KEY")
    ssh_options: Tuple[str, ...] = setting((), "more `ssh -o` options, e.g. \"ConnectTimeout=10\" (a slow link to the "
                                           "device)", flag="--ssh-option", short="-o", append=True, metavar="OPTION")

    def __post_init__(self) -> None:
        if not self.bundle:
            raise ValueError("bundle must be given: the hat-export bundle directory to flash")
        if bool(self.devices) == bool(self.inventory):
            raise ValueError("give devices or --inventory (one of the two)")
        for text in self.devices:
            Target.parse(text)

    def ssh_args(self) -> List[str]:
        return ssh_args(self.identity, self.ssh_options)

    def targets(self) -> List[Target]:
        args = self.ssh_args()
        return [Target.parse(text, args) for text in self.devices]


@dataclass
class FlashResult:
    target: str
    files: int  # files the bundle has
    sent_files: List[str] = field(default_factory=list)
    sent_bytes: int = 0
    verified: bool = False


def bundle_files(bundle: Path) -> Dict[str, str]:
    """Every file of a verified bundle, relative path -> sha256, the manifest last."""
    man = M.load(bundle)
    files = dict(man.tokenizer)
    for a in man.artifacts:
        files.update(a.files)
    files[M.MANIFEST] = M.sha256(bundle / M.MANIFEST)
    return files


def _call(cmd: List[str], what: str, timeout: float = 600) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise FlashError(f"{what}: no answer within {timeout:.0f} s") from None
    if r.returncode != 0:
        raise FlashError(f"{what} failed (exit {r.returncode}): {r.stderr.strip()[-400:] or r.stdout.strip()[-400:]}")
    return r.stdout


def remote_sums(target: Target, rels: Sequence[str], subdir: str = "") -> Dict[str, str]:
    """sha256 of those files on the device (absent files are left out)."""
    root = target.path + (f"/{subdir}" if subdir else "")
    names = " ".join(shlex.quote(r) for r in rels)
    out = _call(target.ssh(f"cd {shlex.quote(root)} 2>/dev/null && sha256sum -- {names} 2>/dev/null; true"),
                f"checksums on {target.login}")
    sums = {}
    for line in out.splitlines():
        digest, _, name = line.partition("  ")
        if len(digest) == 64 and name:
            sums[name] = digest
    return sums


def flash(bundle: Path, target: Target, progress: bool = True) -> FlashResult:
    """Put `bundle` at target.path, verified; returns what was sent."""
    bundle = Path(bundle)
    files = bundle_files(bundle)
    result = FlashResult(f"{target.login}:{target.path}", len(files))
    result.sent_files, result.sent_bytes = send_files(bundle, files, target, last=M.MANIFEST, progress=progress)
    result.verified = True
    return result


def send_files(src: Path, files: Dict[str, str], target: Target, last: Optional[str] = None,
               progress: bool = True) -> Tuple[List[str], int]:
    """Make target.path hold `files` (relative path -> sha256) of `src`, verified: only files missing or different
    there are sent, into `.incoming/`, checked, and moved into place (`last` after every other). Returns the files
    sent and their bytes; FlashError when anything does not land verified."""
    from tqdm import tqdm  # the models extra

    have = remote_sums(target, list(files))
    todo = [rel for rel, digest in files.items() if have.get(rel) != digest]
    sent: List[str] = []
    if todo:
        dirs = sorted({os.path.dirname(r) for r in todo} - {""})
        mk = " ".join(shlex.quote(f"{target.path}/.incoming/{d}") for d in ["."] + dirs)
        _call(target.ssh(f"mkdir -p {mk}"), f"mkdir on {target.login}")
        total = sum((src / r).stat().st_size for r in todo)
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"flash {target.host}", disable=not progress) as bar:
            for rel in todo:
                _call(target.scp(src / rel, f".incoming/{rel}"), f"sending {rel} to {target.login}", 3600)
                sent.append(rel)
                bar.update((src / rel).stat().st_size)
        landed = remote_sums(target, todo, ".incoming")
        bad = [r for r in todo if landed.get(r) != files[r]]
        if bad:
            raise FlashError(f"{', '.join(bad)} arrived damaged on {target.login} (checksum differs); nothing was "
                             "moved into place, flash again")
        moves = [f"mkdir -p {shlex.quote(d)}" for d in dirs]
        moves += [f"mv -f {shlex.quote('.incoming/' + r)} {shlex.quote(r)}" for r in todo if r != last]
        if last in todo:
            moves.append(f"mv -f {shlex.quote('.incoming/' + last)} {shlex.quote(last)}")
        _call(target.ssh(f"cd {shlex.quote(target.path)} && " + " && ".join(moves) + " && rm -rf .incoming"),
              f"moving files into place on {target.login}")
    final = remote_sums(target, list(files))
    bad = [r for r, d in files.items() if final.get(r) != d]
    if bad:
        raise FlashError(f"{target.login}:{target.path} does not hold verified files after sending: "
                         f"{', '.join(bad[:5])} differ")
    return sent, sum((src / r).stat().st_size for r in sent)


def flash_fleet(bundle: Path, inventory: Path, limit: str = "", extra_ssh: str = "") -> dict:
    """Flash every host of an Ansible inventory with export/deploy/flash.yml; returns Ansible's per-host recap."""
    bundle = Path(bundle).resolve()
    files = bundle_files(bundle)
    extra = {"bundle": str(bundle), "files": [{"path": r, "sha256": d} for r, d in files.items()]}
    return run_playbook("flash.yml", inventory, extra, limit, extra_ssh, "fleet flash")


def run_playbook(name: str, inventory: Path, extra_vars: dict, limit: str = "", extra_ssh: str = "",
                 what: str = "fleet flash") -> dict:
    """Run export/deploy/<name> on an inventory with `extra_vars`; {host: {"changed": n, "ok": n}} from Ansible's
    recap, or FlashError naming the hosts that failed and Ansible's reasons."""
    if shutil.which("ansible-playbook") is None:
        raise FlashError(f"a {what} needs ansible-playbook: pip install ansible-core (the `fleet` extra)")
    playbook = Path(__file__).resolve().parent / name
    cmd = ["ansible-playbook", "-i", str(inventory), str(playbook), "-e", json.dumps(extra_vars)]
    if limit:
        cmd += ["--limit", limit]
    if extra_ssh:
        cmd += ["--ssh-extra-args", extra_ssh]
    # pipelining: each module runs over the task's one ssh connection instead of a copy, a run and a clean-up (the
    # per-file copy loop of a bundle is most of a flash); an operator's own setting wins
    env = dict(os.environ, ANSIBLE_HOST_KEY_CHECKING=os.environ.get("ANSIBLE_HOST_KEY_CHECKING", "True"),
               ANSIBLE_PIPELINING=os.environ.get("ANSIBLE_PIPELINING", "True"),
               ANSIBLE_PYTHON_INTERPRETER="auto_silent", ANSIBLE_NOCOLOR="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    recap = {m["host"]: {k: int(m[k]) for k in ("ok", "changed", "unreachable", "failed")}
             for m in _RECAP.finditer(r.stdout)}
    bad = {h: s for h, s in recap.items() if s["unreachable"] or s["failed"]}
    if r.returncode != 0 or bad or not recap:
        why = [line.strip()[:300] for line in r.stdout.splitlines() if line.startswith(("fatal:", "failed:"))]
        hosts = ", ".join(bad) or "the inventory"
        raise FlashError(f"{what} failed on {hosts} (ansible-playbook exit {r.returncode}): "
                         + ("; ".join(why[:6]) or (r.stderr or r.stdout).strip()[-600:]))
    return {h: {"changed": s["changed"], "ok": s["ok"]} for h, s in recap.items()}


def ssh_args(identity: str, options: Sequence[str]) -> List[str]:
    """The ssh arguments every connection gets: host keys trusted on first contact, the identity, the `-o` options."""
    return default_ssh_options(identity or None) + [a for o in options for a in ("-o", o)]


def default_ssh_options(key: Optional[str]) -> List[str]:
    """Trust a device's host key on first contact (a new Jetson), refuse a changed one; an identity when given."""
    return ["-o", "StrictHostKeyChecking=accept-new"] + (["-i", key] if key else [])
