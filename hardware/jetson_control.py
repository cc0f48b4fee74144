"""nvpmodel and jetson_clocks: query and set a Jetson's power mode and clocks, with clear errors where they cannot run.

Output formats (JetPack 4 to 7) the parsers read:
- `nvpmodel -q`: `NV Power Mode: <NAME>` then the id on its own line; JetPack 4 Xavier prints `NV Fan Mode:<mode>`
  first; without root it may add `NVPM ERROR: ...: 13` lines for files it cannot open, yet still report the mode.
- `nvpmodel -p --verbose`: `NVPM VERB: PM_CONFIG: DEFAULT=<NAME>(<id>)` and one `NVPM VERB: POWER_MODEL: ID=<id>
  NAME=<NAME>` per mode.
- `nvpmodel -m <id>`: silent on success; `NVPM ERROR ...` lines on failure (the exit status is not always non-zero, so
  the text decides); `NVPM WARN: Reboot required ...` and a YES/no question for a mode that power-gates hardware,
  which this wrapper answers "no" unless told to reboot.
- `jetson_clocks`: needs root for everything, `--show` included (`Error: Run this script(...) as a root user`).

Every wrapper raises JetsonControlError saying what failed and what to do: the tool is missing (not a Jetson),
the user is not root, the mode is unknown or needs a reboot.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

Runner = Callable[[Sequence[str], str], Tuple[int, str]]  # (argv, stdin) → (exit status, stdout + stderr)


class JetsonControlError(RuntimeError):
    pass


@dataclass
class NvpModes:
    modes: Dict[int, str] = field(default_factory=dict)  # id → name, as the board's configuration defines them
    default: Optional[Tuple[int, str]] = None


def run_tool(argv: Sequence[str], stdin: str = "") -> Tuple[int, str]:
    """Run a board tool; (status, stdout + stderr). JetsonControlError when it is not installed."""
    if shutil.which(argv[0]) is None:
        raise JetsonControlError(f"{argv[0]} is not installed: this is not a Jetson (or JetPack's tools are not on "
                                 "PATH)")
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr


def parse_query(text: str) -> Tuple[str, int]:
    """`nvpmodel -q` output → (mode name, id)."""
    m = re.search(r"NV Power Mode:\s*(\S+)\s*\n\s*(\d+)", text)
    if not m:
        raise JetsonControlError(f"unreadable nvpmodel -q output: {text.strip()[:200]!r}")
    return m.group(1), int(m.group(2))


def parse_modes(text: str) -> NvpModes:
    """`nvpmodel -p --verbose` output → the modes the board's configuration defines, and its default."""
    out = NvpModes()
    for m in re.finditer(r"POWER_MODEL:\s*ID=(\d+)\s+NAME=(\w+)", text):
        out.modes[int(m.group(1))] = m.group(2)
    d = re.search(r"PM_CONFIG:\s*DEFAULT=(\w+)\((\d+)\)", text)
    if d:
        out.default = (int(d.group(2)), d.group(1))
    if not out.modes:
        raise JetsonControlError(f"no POWER_MODEL lines in nvpmodel -p --verbose output: {text.strip()[:200]!r}")
    return out


def errors_in(text: str) -> List[str]:
    return [line.strip() for line in text.splitlines() if "NVPM ERROR" in line]


def query_mode(run: Runner = run_tool) -> Tuple[str, int]:
    """The board's current power mode (name, id); readable without root."""
    status, text = run(["nvpmodel", "-q"], "")
    try:
        return parse_query(text)
    except JetsonControlError:
        raise JetsonControlError(f"nvpmodel -q failed (status {status}): {text.strip()[:300]}") from None


def list_modes(run: Runner = run_tool) -> NvpModes:
    status, text = run(["nvpmodel", "-p", "--verbose"], "")
    return parse_modes(text)


def is_root() -> bool:
    return os.geteuid() == 0


def set_mode(mode: int, reboot: bool = False, run: Runner = run_tool) -> Tuple[str, int]:
    """Switch to mode id `mode` and return the mode the board then reports.

    A mode that power-gates hardware needs a reboot: without `reboot` the question is answered "no" and
    JetsonControlError says so; with it, the board reboots (and this call does not return normally)."""
    if not is_root():
        raise JetsonControlError(f"nvpmodel -m {mode} needs root: run as root, or allow this user `sudo -n "
                                 "nvpmodel` and run the agent under sudo")
    status, text = run(["nvpmodel", "-m", str(mode)], "YES\n" if reboot else "NO\n")
    if "Reboot required" in text and not reboot:
        raise JetsonControlError(f"power mode {mode} needs a reboot on this board (nvpmodel: "
                                 f"{' '.join(text.split())[:200]}); switch with reboot allowed, or pick another mode")
    errors = errors_in(text)
    if errors or status != 0:
        raise JetsonControlError(f"nvpmodel -m {mode} failed (status {status}): {'; '.join(errors) or text.strip()}")
    name, now = query_mode(run)
    if now != mode:
        raise JetsonControlError(f"asked for power mode {mode}, the board reports {now} ({name})")
    return name, now


def jetson_clocks(action: str = "show", run: Runner = run_tool) -> str:
    """`jetson_clocks` (pin clocks at the mode's maximum), `--show`, `--store` or `--restore`; its output."""
    flags = {"on": [], "show": ["--show"], "store": ["--store"], "restore": ["--restore"]}
    if action not in flags:
        raise ValueError(f"jetson_clocks action must be one of {', '.join(flags)}")
    if not is_root():
        raise JetsonControlError("jetson_clocks needs root (even --show): run as root")
    status, text = run(["jetson_clocks", *flags[action]], "")
    if status != 0 or "as a root user" in text:
        raise JetsonControlError(f"jetson_clocks {action} failed (status {status}): {text.strip()[:300]}")
    return text


# -- which board is this ------------------------------------------------------------------------------------------
PART_PROFILES = {  # module part number (device-tree compatible) → profile, before the super configuration is seen
    "p3701-0005": "agx-orin-64gb", "p3701-0000": "agx-orin-64gb", "p3701-0004": "agx-orin-32gb",
    "p2888-0004": "agx-xavier-32gb", "p2888-0001": "agx-xavier-32gb", "p2888-0005": "agx-xavier-64gb",
    "p3767-0000": "orin-nx-16gb", "p3767-0001": "orin-nx-8gb", "p3767-0003": "orin-nano-8gb",
    "p3767-0005": "orin-nano-8gb", "p3767-0004": "orin-nano-4gb", "p3834-0008": "agx-thor",
}


@dataclass
class BoardInfo:
    model: str  # /proc/device-tree/model
    compatible: List[str]
    l4t: str  # from /etc/nv_tegra_release, e.g. "36.4.3"
    profile: Optional[str]  # the matching profile name, None when no part number is known


def detect_board(root: str = "/", modes: Optional[NvpModes] = None) -> BoardInfo:
    """Read the device tree and /etc/nv_tegra_release under `root`; JetsonControlError on a machine without them.
    `modes` (from list_modes) tells a super-flashed Orin NX / Nano apart (its configuration has MAXN_SUPER)."""
    base = Path(root)
    model_file = base / "proc/device-tree/model"
    if not model_file.exists():
        raise JetsonControlError("no /proc/device-tree/model: not a Jetson")
    model = model_file.read_bytes().rstrip(b"\0").decode(errors="replace")
    compat_file = base / "proc/device-tree/compatible"
    compatible = [c for c in compat_file.read_bytes().decode(errors="replace").split("\0") if c] \
        if compat_file.exists() else []
    release = base / "etc/nv_tegra_release"
    l4t = ""
    if release.exists():
        m = re.search(r"# R(\d+) \(release\), REVISION: ([\d.]+)", release.read_text(errors="replace"))
        if m:
            l4t = f"{m.group(1)}.{m.group(2)}"
    profile = None
    for entry in compatible:
        for part, name in PART_PROFILES.items():
            if part in entry:
                profile = name
                break
        if profile:
            break
    if profile and modes is not None and "MAXN_SUPER" in modes.modes.values() and profile.startswith("orin-n"):
        profile += "-super"
    return BoardInfo(model, compatible, l4t, profile)


class ModeCycler:
    """HAT's testbed (paper 004, §4.1): a device switching nvpmodel modes every few requests. After every `every`
    requests `after_request()` moves to the next mode of `modes` (ids); a switch that fails (not a Jetson, not root,
    a mode needing a reboot) is recorded in `error` and the cycle stops trying, so a device never stalls on it."""

    def __init__(self, modes: List[int], every: int, run: Runner = run_tool):
        if not modes or every < 1:
            raise ValueError("a mode cycle needs at least one mode and every >= 1")
        self.modes, self.every, self.run = list(modes), every, run
        self.requests = 0
        self.index = -1
        self.current: Optional[str] = None
        self.error = ""
        self.switches = 0

    def after_request(self) -> Optional[str]:
        """Count a request; switch when due. Returns the new mode's name, or None."""
        self.requests += 1
        if self.error or self.requests % self.every:
            return None
        self.index = (self.index + 1) % len(self.modes)
        try:
            self.current, _ = set_mode(self.modes[self.index], run=self.run)
        except JetsonControlError as exc:
            self.error = str(exc)
            return None
        self.switches += 1
        return self.current
