"""`hat-link`: run the link emulator, list the link profiles, or send a command to a running emulator.

    hat-link --list
    hat-link --profile wifi-near --listen 127.0.0.1:5601 --upstream 127.0.0.1:5555 [--control 127.0.0.1:5602]
    hat-link --netns dev1 --profile lte --upstream 127.0.0.1:5555   (root: tc tbf rates, the relay's delay and loss)
    hat-link cut [stall|reset] --control 127.0.0.1:5602
    hat-link restore --control 127.0.0.1:5602
    hat-link profile lte --control 127.0.0.1:5602
    hat-link stats --control 127.0.0.1:5602
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from profiles.testbed.link_emulator import CUT_MODES, LinkEmulator, send_control
from profiles.testbed.links import LINK_PROFILES

COMMANDS = ("cut", "restore", "profile", "stats")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        return _send(argv)
    return _serve(argv)


def _serve(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hat-link", description="User-space link emulator (TCP relay); "
                                     f"also `hat-link {{{','.join(COMMANDS)}}} --control HOST:PORT`.")
    parser.add_argument("--list", action="store_true", help="print the link profiles and exit")
    parser.add_argument("--profile", default="loopback", choices=list(LINK_PROFILES))
    parser.add_argument("--listen", type=_address, default=("127.0.0.1", 5601), help="HOST:PORT devices connect to")
    parser.add_argument("--upstream", type=_address, help="HOST:PORT of the real server")
    parser.add_argument("--control", type=_address, help="HOST:PORT for line commands (cut, restore, ...)")
    parser.add_argument("--netns", default="", metavar="NAME",
                        help="root: put the device in network namespace NAME behind a tc-tbf-shaped veth (rates in "
                             "the kernel; delay, jitter and loss from the relay); run it there with ip netns exec")
    parser.add_argument("--stats-interval", type=float, default=5.0, help="seconds between stats lines; 0 = none")
    args = parser.parse_args(argv)
    if args.list:
        print(profile_table())
        return 0
    if args.upstream is None:
        parser.error("--upstream HOST:PORT is required to run the emulator")
    if args.netns:
        return _serve_netns(args)
    with LinkEmulator(args.profile, args.upstream, args.listen, args.control) as link:
        control = f", control {link.control_address[0]}:{link.control_address[1]}" if link.control_address else ""
        print(f"hat-link {link.profile.name}: {link.address} -> {args.upstream[0]}:{args.upstream[1]}{control}; "
              "Ctrl-C stops", flush=True)
        try:
            before, t0 = link.stats(), time.monotonic()
            while True:
                time.sleep(args.stats_interval or 3600)
                if args.stats_interval:
                    now, t1 = link.stats(), time.monotonic()
                    print(_stats_line(before, now, t1 - t0), flush=True)
                    before, t0 = now, t1
        except KeyboardInterrupt:
            return 0


def _serve_netns(args) -> int:
    from profiles.testbed.netns_link import NetnsLink

    try:
        link = NetnsLink(args.profile, args.upstream, name=args.netns)
    except RuntimeError as exc:
        print(f"hat-link: {exc}", file=sys.stderr)
        return 1
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
        reply = send_control(args.control, line.get(args.command, args.command))
    except (OSError, RuntimeError, ValueError) as e:
        print(f"hat-link {args.command}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(reply.get("stats", reply)))
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


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, e.g. 127.0.0.1:5601, got {text!r}")
    return host, int(port)


if __name__ == "__main__":
    sys.exit(main())
