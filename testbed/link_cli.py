"""`hat-link`: run the link emulator, list the link profiles, or send a command to a running emulator.

    hat-link --list
    hat-link [serve] --profile wifi-near --listen 127.0.0.1:5601 --upstream 127.0.0.1:5555 [--control HOST:PORT]
    hat-link [serve] --netns dev1 --profile lte --upstream 127.0.0.1:5555   (root: rates by tc tbf, delay by the relay)
    hat-link serve --config link.toml [flags]   (a LinkEmulatorConfig, docs/CONFIG.md; flags given win)
    hat-link cut [stall|reset] --control 127.0.0.1:5602
    hat-link restore --control 127.0.0.1:5602
    hat-link profile lte --control 127.0.0.1:5602
    hat-link stats --control 127.0.0.1:5602
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from hat_split.files.config_file import add_config_argument, config_from_flags
from hat_split.files.settings import add_flags, overrides, setting
from testbed.link_emulator import CUT_MODES, LinkEmulator, send_control
from testbed.links import LINK_PROFILES
from testbed.netns_link import NetnsLink
from hat_split.files import strict_json

COMMANDS = ("cut", "restore", "profile", "stats")


def parse_address(text: str) -> tuple[str, int]:
    """("HOST", PORT) of "HOST:PORT", or a ValueError."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, e.g. 127.0.0.1:5601, got {text!r}")
    return host, int(port)


@dataclass(frozen=True)
class LinkEmulatorConfig:
    """`hat-link serve`: one emulated link between devices and the cloud (docs/LINKS.md, docs/CONFIG.md)."""

    upstream: str = setting(help="HOST:PORT of the real server (the cloud's endpoint without tcp://)",
                            metavar="HOST:PORT")
    profile: str = setting("loopback", "link profile (`hat-link --list`): rates, delay, jitter, loss; loopback only "
                           "forwards", choices=tuple(LINK_PROFILES))
    listen: str = setting("127.0.0.1:5601", "HOST:PORT devices connect to instead of the server; port 0 picks a free "
                          "one", metavar="HOST:PORT")
    control: str = setting("", "HOST:PORT for line commands (cut, restore, profile, stats) from other processes; \"\": "
                           "none", metavar="HOST:PORT")
    netns: str = setting("", "root: the device's network namespace NAME behind a tc-tbf-shaped veth (rates in the "
                         "kernel); \"\": the user-space relay alone", metavar="NAME")
    stats_interval_s: float = setting(5.0, "s between stats lines on stdout; 0: none", metavar="SECONDS")
    seed: Optional[int] = setting(None, "seed of the jitter and loss draws, for a reproducible run; None: a fresh one")
    connect_timeout_s: float = setting(5.0, "s the relay waits for the upstream connection before resetting the "
                                       "device's", metavar="SECONDS")

    def __post_init__(self) -> None:
        if self.profile not in LINK_PROFILES:
            raise ValueError(f"unknown link profile {self.profile!r}; known: {', '.join(LINK_PROFILES)}")
        for key in ("upstream", "listen") + (("control",) if self.control else ()):
            try:
                parse_address(getattr(self, key))
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
        if not self.stats_interval_s >= 0:
            raise ValueError(f"stats_interval_s must be >= 0 s (0: no stats lines), got {self.stats_interval_s}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0 s, got {self.connect_timeout_s}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return _send(argv)
    return _serve(argv[1:] if argv[:1] == ["serve"] else argv)


def _serve_parser() -> argparse.ArgumentParser:
    """--list, --config and a flag for every LinkEmulatorConfig key (hat_split.files.settings; its __post_init__
    checks the HOST:PORT addresses and names the key)."""
    parser = argparse.ArgumentParser(prog="hat-link", description="User-space link emulator (TCP relay); "
                                     f"also `hat-link {{{','.join(COMMANDS)}}} --control HOST:PORT`.")
    parser.add_argument("--list", action="store_true", help="print the link profiles and exit")
    add_config_argument(parser, "link")
    parser.set_defaults(flag_keys=add_flags(parser, LinkEmulatorConfig))
    return parser


def link_config(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]) -> LinkEmulatorConfig:
    """The --config file with the flags typed on this command line on top of it, or the flags alone."""
    typed = overrides(args, args.flag_keys)
    if not args.config and "upstream" not in typed:
        parser.error("--upstream HOST:PORT is required to run the emulator")
    return config_from_flags(LinkEmulatorConfig, args.config, typed)


def _serve(argv: Sequence[str]) -> int:
    parser = _serve_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(profile_table())
        return 0
    try:
        config = link_config(parser, args, argv)
    except ValueError as exc:  # a ConfigError: the file or a key of it
        print(f"hat-link: {exc}", file=sys.stderr)
        return 2
    if config.netns:
        return _serve_netns(config)
    _stop_on_signals()
    with LinkEmulator(config.profile, parse_address(config.upstream), parse_address(config.listen),
                      parse_address(config.control) if config.control else None, seed=config.seed,
                      connect_timeout_s=config.connect_timeout_s) as link:
        control = f", control {link.control_address[0]}:{link.control_address[1]}" if link.control_address else ""
        print(f"hat-link {link.profile.name}: {link.address} -> {config.upstream}{control}; Ctrl-C stops", flush=True)
        try:
            before, t0 = link.stats(), time.monotonic()
            while True:
                time.sleep(config.stats_interval_s or 3600)
                if config.stats_interval_s:
                    now, t1 = link.stats(), time.monotonic()
                    print(_stats_line(before, now, t1 - t0), flush=True)
                    before, t0 = now, t1
        except KeyboardInterrupt:
            return 0


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM stop the relay, even where SIGINT came in ignored (a process started in the
    background by a shell without job control, or by a parent that ignores it), which Python would otherwise keep."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)


def _serve_netns(config: LinkEmulatorConfig) -> int:
    try:
        link = NetnsLink(config.profile, parse_address(config.upstream), name=config.netns)
    except RuntimeError as exc:
        print(f"hat-link: {exc}", file=sys.stderr)
        return 1
    _stop_on_signals()
    with link:
        print(f"hat-link {link.profile.name} in namespace {link.name}: devices there connect to {link.address}; run "
              f"them with `ip netns exec {link.name} ...`; Ctrl-C removes the namespace\n{link.qdiscs()}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


def _send(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hat-link", description="Send a command to a running link emulator.")
    sub = parser.add_subparsers(dest="command", required=True)
    cut = sub.add_parser("cut", help="cut the link: stall (hold data) or reset (drop connections)")
    cut.add_argument("mode", nargs="?", default="stall", choices=CUT_MODES)
    sub.add_parser("restore", help="restore a cut link")
    profile = sub.add_parser("profile", help="switch to another link profile")
    profile.add_argument("name", choices=list(LINK_PROFILES))
    sub.add_parser("stats", help="print the emulator's counters as JSON")
    for p in sub.choices.values():
        p.add_argument("--control", type=_address, required=True, help="HOST:PORT of the emulator's control port")
    args = parser.parse_args(argv)
    line = {"cut": f"cut {getattr(args, 'mode', '')}", "profile": f"profile {getattr(args, 'name', '')}"}
    try:
        reply = send_control(parse_address(args.control), line.get(args.command, args.command))
    except (OSError, RuntimeError, ValueError) as e:
        print(f"hat-link {args.command}: {e}", file=sys.stderr)
        return 1
    print(strict_json.dumps(reply.get("stats", reply)))
    return 0


def profile_table() -> str:
    rows = [("name", "up", "down", "delay", "jitter", "loss", "description")]
    for p in LINK_PROFILES.values():
        rows.append((p.name, _rate(p.rate("up")), _rate(p.rate("down")), f"{p.delay_s * 1e3:g} ms",
                     f"±{p.jitter_s * 1e3:g} ms", f"{p.loss * 100:g} %", p.description))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)


def _rate(bytes_per_s: float) -> str:
    if math.isinf(bytes_per_s):
        return "unlimited"
    if bytes_per_s >= 1e6:
        return f"{bytes_per_s / 1e6:g} MB/s"
    return f"{bytes_per_s / 1e3:g} kB/s"


def _stats_line(before: dict, now: dict, seconds: float) -> str:
    parts = [f"[{now['profile']}{' CUT ' + now['cut'] if now['cut'] else ''}]"]
    for d in ("up", "down"):
        delta = now[d]["bytes"] - before[d]["bytes"]
        parts.append(f"{d} {now[d]['bytes'] / 1e6:.2f} MB ({delta / max(seconds, 1e-9) / 1e6:.2f} MB/s)")
    c = now["connections"]
    parts.append(f"connections {c['active']} active, {c['accepted']} accepted, {c['refused']} refused, "
                 f"{c['upstream_errors']} upstream errors")
    return "  ".join(parts)


def _address(text: str) -> str:
    """argparse type: a HOST:PORT checked and kept as text (the control commands' --control)."""
    try:
        parse_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


if __name__ == "__main__":
    sys.exit(main())
