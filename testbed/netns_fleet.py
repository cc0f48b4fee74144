"""A local fleet of "devices": network namespaces, each with its own veth link, its own /opt/hatspec (a private
tmpfs in its own mount namespace) and an sshd, so flashing and fleet launch run over real ssh on one machine.

Needs root, `ip`, `unshare` and OpenSSH's sshd (scripts/bootstrap.sh installs openssh-server and rsync).
`LocalFleet` is a context manager: leaving it stops every sshd and removes every namespace and link it made.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from hat_split.net.ssh import ssh_argv

DEVICE_ROOT = "/opt/hatspec"  # every device's own directory for bundles (a private tmpfs per device)


def unavailable() -> Optional[str]:
    """Why a local fleet cannot start here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/usr/sbin/sshd").exists():
        return "sshd is not installed (apt-get install openssh-server; scripts/bootstrap.sh does it)"
    name = f"hs-probe-{os.getpid()}"  # this process's own: two processes probing at once must not collide
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns add failed: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


@dataclass
class Device:
    name: str  # namespace name
    address: str  # its IPv4 address on its veth link
    host_side: str  # the veth interface left in the root namespace
    pid: int = 0  # sshd


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


class LocalFleet:
    """K namespace devices reachable by ssh as root at 10.<net>.<i>.2, key-only, from the root namespace."""

    def __init__(self, k: int, prefix: str = "hs", net: int = 77, directory: Optional[str | os.PathLike] = None):
        self.k, self.prefix, self.net = k, prefix, net
        self.devices: List[Device] = []
        self.dir = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="hatspec-fleet-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.key = self.dir / "id_ed25519"

    def start(self) -> "LocalFleet":
        """Make the devices; on any failure, remove what was made."""
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __enter__(self) -> "LocalFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / "host_key"))
        (self.dir / "authorized_keys").write_text(Path(str(self.key) + ".pub").read_text())
        os.chmod(self.dir / "authorized_keys", 0o600)
        for i in range(1, self.k + 1):
            dev = Device(f"{self.prefix}-dev{i}", f"10.{self.net}.{i}.2", f"{self.prefix}-h{i}")
            self.devices.append(dev)
            _run("ip", "netns", "add", dev.name)
            _run("ip", "link", "add", dev.host_side, "type", "veth", "peer", "name", "eth0", "netns", dev.name)
            _run("ip", "addr", "add", f"10.{self.net}.{i}.1/24", "dev", dev.host_side)
            _run("ip", "link", "set", dev.host_side, "up")
            for cmd in (["ip", "addr", "add", f"{dev.address}/24", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"],
                        ["ip", "link", "set", "lo", "up"]):
                _run("ip", "netns", "exec", dev.name, *cmd)
            cfg = self.dir / f"sshd_{i}.conf"
            cfg.write_text("\n".join([
                f"ListenAddress {dev.address}", "Port 22", f"HostKey {self.dir / 'host_key'}",
                f"AuthorizedKeysFile {self.dir / 'authorized_keys'}", "PermitRootLogin prohibit-password",
                "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
                f"PidFile {self.dir / f'sshd_{i}.pid'}", "Subsystem sftp internal-sftp", ""]))
            # its own mount namespace: /opt/hatspec is a tmpfs only this device sees
            script = (f"mkdir -p {DEVICE_ROOT} && mount -t tmpfs -o size=2g hatspec {DEVICE_ROOT} && "
                      f"exec /usr/sbin/sshd -D -e -f {cfg}")
            with open(self.dir / f"sshd_{i}.log", "wb") as log:  # the child keeps its own descriptor
                proc = subprocess.Popen(["ip", "netns", "exec", dev.name, "unshare", "--mount", "--propagation",
                                         "private", "sh", "-c", script], stdout=subprocess.DEVNULL, stderr=log,
                                        start_new_session=True)
            dev.pid = proc.pid
        for dev in self.devices:
            self._wait(dev)

    def _wait(self, dev: Device, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if subprocess.run(self.ssh(dev) + ["true"], capture_output=True).returncode == 0:
                return
            time.sleep(0.2)
        log = (self.dir / f"sshd_{self.devices.index(dev) + 1}.log").read_text(errors="replace")
        raise RuntimeError(f"device {dev.name} did not accept ssh within {timeout:.0f} s: {log[-500:]}")

    def save(self) -> Path:
        """Write this fleet's state (devices, sshd pids, key) to <dir>/fleet.json, so `attach` can stop it later from
        another process (`hat-fleet local up` / `hat-fleet local down`)."""
        path = self.dir / "fleet.json"
        path.write_text(json.dumps({"k": self.k, "prefix": self.prefix, "net": self.net,
                                    "devices": [vars(d) for d in self.devices]}, indent=1))
        return path

    @classmethod
    def attach(cls, directory: str | os.PathLike) -> "LocalFleet":
        """The fleet a previous process started and saved in `directory`."""
        state = json.loads((Path(directory) / "fleet.json").read_text())
        fleet = cls(state["k"], state["prefix"], state["net"], directory=directory)
        fleet.devices = [Device(**d) for d in state["devices"]]
        return fleet

    def inventory(self, python: str, cloud_port: int = 5555, **edge_vars) -> dict:
        """An Ansible-style inventory (export/deploy/fleet.py's format) of these devices, the cloud on this host."""
        hosts = {}
        for i, dev in enumerate(self.devices, 1):
            hosts[dev.name] = {"ansible_host": dev.address, "ansible_user": "root",
                               "ansible_ssh_private_key_file": str(self.key),
                               "ansible_ssh_common_args": " ".join(self.ssh_options()[2:]),
                               "ansible_python_interpreter": "/usr/bin/python3",
                               "hatspec_server": f"tcp://10.{self.net}.{i}.1:{cloud_port}"}
        return {"all": {"vars": {"hatspec_python": python}, "children": {
            "cloud": {"hosts": {"cloud": {"ansible_connection": "local",
                                          "hatspec_bind": f"tcp://0.0.0.0:{cloud_port}"}}},
            "edge": {"vars": {"hatspec_run_dir": f"{DEVICE_ROOT}/run", **edge_vars}, "hosts": hosts}}}}

    def ssh_options(self) -> List[str]:
        """ssh arguments for these devices: the fleet's key, and host keys neither checked nor kept (every fleet's
        sshd has a fresh one)."""
        return ["-i", str(self.key), "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=5"]

    def ssh(self, dev: Device) -> List[str]:
        """The ssh command prefix of one device (as root); append the shell command."""
        return ssh_argv(dev.address, user="root", options=self.ssh_options())

    def close(self) -> None:
        for dev in self.devices:
            if dev.pid:
                try:
                    os.killpg(dev.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for dev in self.devices:
            for pid in subprocess.run(["ip", "netns", "pids", dev.name], capture_output=True,
                                      text=True).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "link", "del", dev.host_side], capture_output=True)
            subprocess.run(["ip", "netns", "del", dev.name], capture_output=True)
        self.devices = []
        shutil.rmtree(self.dir, ignore_errors=True)
