"""ssh and scp command lines, built in one place: flashing bundles (export.deploy.flash), launching a fleet
(export.deploy.fleet) and the namespace devices of the testbed (testbed.netns_fleet).

ssh keeps the first value it reads for an option, so the defaults come first and a caller's options can add to
them but not override them: BatchMode=yes (never a password or host-key prompt, which would hang a fleet command)
always holds.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence, Union

BATCH = ("-o", "BatchMode=yes")  # no prompts: a device that wants a password fails at once instead of hanging


def login(host: str, user: str = "") -> str:
    """`user@host`, or `host` alone (ssh's default user)."""
    return f"{user}@{host}" if user else host


def _options(port: Optional[int], identity: str, options: Sequence[str], port_flag: str) -> List[str]:
    return [*BATCH, *([port_flag, str(port)] if port else []), *(["-i", identity] if identity else []), *options]


def ssh_argv(host: str, command: Optional[str] = None, *, user: str = "", port: Optional[int] = None,
             identity: str = "", options: Sequence[str] = ()) -> List[str]:
    """argv running the shell `command` on `host` over ssh; without a command, the prefix a caller appends one to.

    port: None for ssh's own (22, or the ssh config's); identity: a private key file; options: more ssh arguments
    (`-o Option=value`, ...)."""
    return ["ssh", *_options(port, identity, options, "-p"), login(host, user), *([command] if command else [])]


def scp_argv(local: Union[str, Path], host: str, remote_path: str, *, user: str = "", port: Optional[int] = None,
             identity: str = "", options: Sequence[str] = ()) -> List[str]:
    """argv copying the file `local` to `remote_path` on `host` (quietly, with ssh_argv's options)."""
    bracketed = f"[{host}]" if ":" in host else host  # an IPv6 address: scp splits host and path at the first ':'
    return ["scp", "-q", *_options(port, identity, options, "-P"), str(local),
            f"{login(bracketed, user)}:{remote_path}"]
