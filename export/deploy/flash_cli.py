"""`hat-flash`: put a hat-export bundle on devices over ssh, verified on each device; a second flash sends nothing.

    hat-flash BUNDLE DEVICE...            DEVICE = [user@]host[:port][:/absolute/path] (default path /opt/hatspec/bundle)
    hat-flash BUNDLE --inventory INV.yml  a fleet, through export/deploy/flash.yml (ansible-playbook)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hat-flash", description=__doc__.split("\n\n")[0])
    p.add_argument("bundle", help="a hat-export bundle directory (checked before anything is sent)")
    p.add_argument("devices", nargs="*", help="[user@]host[:port][:/absolute/path]")
    p.add_argument("--inventory", help="an Ansible inventory: flash every host (or --limit)")
    p.add_argument("--limit", default="", help="Ansible host pattern within the inventory")
    p.add_argument("-i", "--identity", default="", help="ssh private key")
    p.add_argument("-o", "--ssh-option", action="append", default=[], help="extra ssh -o option (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print a JSON report")
    return p


def main(argv=None) -> int:
    from export.deploy.flash import FlashError, Target, default_ssh_options, flash, flash_fleet
    from hat_split.files.bundle import BundleError

    args = _parser().parse_args(argv)
    try:
        if bool(args.devices) == bool(args.inventory):
            raise ValueError("give devices or --inventory (one of the two)")
        opts = default_ssh_options(args.identity or None)
        for o in args.ssh_option:
            opts += ["-o", o]
        if args.inventory:
            report = flash_fleet(Path(args.bundle), Path(args.inventory), args.limit, " ".join(opts))
            for host, r in report.items():
                print(f"hat-flash: {host}: verified, {r['changed']} changed")
        else:
            report = {}
            for text in args.devices:
                r = flash(Path(args.bundle), Target.parse(text, opts), progress=not args.quiet)
                report[r.target] = r.__dict__
                print(f"hat-flash: {r.target}: verified {r.files} files, sent {len(r.sent_files)} "
                      f"({r.sent_bytes / 2 ** 20:.1f} MB)")
        if args.json:
            print(json.dumps(report, indent=1))
        return 0
    except (ValueError, FlashError, BundleError, OSError) as exc:
        print(f"hat-flash: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
