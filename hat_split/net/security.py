"""The device-cloud link's security: CurveZMQ keys, one typed setting shared by both sides, and key files.

Every device-cloud socket uses CurveZMQ (elliptic-curve encryption and authentication) unless plaintext is asked for
explicitly: the cloud holds a secret key and an allow-list directory of device public keys (checked by its ZAP
handler, cloud_runtime.zap), a device holds its own secret key and the cloud's public key. Key files are ZeroMQ
certificates (`NAME.key` public, `NAME.key_secret` secret, written with mode 0600), as `hat-keys` makes them.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from hat_split.files.settings import setting

MODES = ("curve", "plaintext")


@dataclass(frozen=True)
class LinkSecurity:
    mode: str = setting("curve", "curve: CurveZMQ encryption and authentication | plaintext: neither (a lab only)",
                        flag="--plaintext", const="plaintext")
    secret_key: str = setting("", "this side's secret certificate (NAME.key_secret)",
                              flag="--curve-secret", metavar="FILE")
    server_key: str = setting("", "device: the cloud's public certificate (NAME.key)",
                              flag="--curve-server-key", metavar="FILE")
    allow_dir: str = setting("", "cloud: directory of the device public certificates it accepts",
                             flag="--curve-allow", metavar="DIR")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"security mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    @staticmethod
    def plaintext() -> "LinkSecurity":
        return LinkSecurity("plaintext")

    @property
    def curve(self) -> bool:
        return self.mode == "curve"

    def check(self, role: str) -> None:
        """ValueError naming what is missing for `role` ("cloud" or "device")."""
        if not self.curve:
            return
        need = {"cloud": ("secret_key", "allow_dir"), "device": ("secret_key", "server_key")}[role]
        missing = [n for n in need if not getattr(self, n)]
        if missing:
            flags = {"secret_key": "--curve-secret", "server_key": "--curve-server-key", "allow_dir": "--curve-allow"}
            raise ValueError(f"the link is encrypted (CurveZMQ) unless --plaintext is given; the {role} needs "
                             f"{' and '.join(flags[m] for m in missing)} (make keys with hat-keys generate)")
        for name in need:
            path = getattr(self, name)
            if not os.path.exists(path):
                raise ValueError(f"{name.replace('_', ' ')} {path!r} does not exist")


def generate(directory: str | os.PathLike, name: str) -> Tuple[Path, Path]:
    """A new key pair as NAME.key (public) and NAME.key_secret (secret, 0600) in `directory`."""
    import zmq.auth

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if (d / f"{name}.key_secret").exists():
        raise FileExistsError(f"{d / (name + '.key_secret')} exists: keys are never overwritten")
    public, secret = zmq.auth.create_certificates(str(d), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_secret(path: str) -> Tuple[bytes, bytes]:
    """(public, secret) z85 keys of a secret certificate."""
    import zmq.auth

    public, secret = zmq.auth.load_certificate(path)
    if not secret:
        raise ValueError(f"{path} holds no secret key (is it the .key file instead of .key_secret?)")
    return public, secret


def load_public(path: str) -> bytes:
    import zmq.auth

    return zmq.auth.load_certificate(path)[0]


def allowed_keys(directory: str) -> Dict[bytes, str]:
    """z85 public key → certificate name, for every certificate in an allow-list directory."""
    import zmq.auth

    out: Dict[bytes, str] = {}
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"allow-list {directory!r} is not a directory")
    for cert in sorted(d.glob("*.key")):
        out[zmq.auth.load_certificate(str(cert))[0]] = cert.stem
    return out


def ephemeral(directory: str | os.PathLike, devices: List[str]) -> Tuple[LinkSecurity, Dict[str, LinkSecurity]]:
    """Keys for one cloud and `devices` in `directory` (a demo, a test, a local fleet): the cloud's setting and each
    device's, every device in the allow-list."""

    d = Path(directory)
    _, cloud_secret = generate(d, "cloud")
    allow = d / "allow"
    allow.mkdir(exist_ok=True)
    out: Dict[str, LinkSecurity] = {}
    for name in devices:
        public, secret = generate(d, name)
        shutil.copy(public, allow / public.name)
        out[name] = LinkSecurity("curve", str(secret), str(d / "cloud.key"))
    return LinkSecurity("curve", str(cloud_secret), allow_dir=str(allow)), out


def fingerprint(public_z85: bytes) -> str:
    """A short name of a public key for logs."""
    return public_z85.decode(errors="replace")[:12]


def cli_args(security: Optional[LinkSecurity], role: str) -> List[str]:
    """Command-line flags of hat-cloud serve / hat-edge that give `security`."""
    if security is None or not security.curve:
        return ["--plaintext"]
    args = ["--curve-secret", security.secret_key]
    if role == "cloud":
        args += ["--curve-allow", security.allow_dir]
    else:
        args += ["--curve-server-key", security.server_key]
    return args
